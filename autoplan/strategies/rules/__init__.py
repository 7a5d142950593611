"""Index-map rules, one module per op family: element-wise ops and reductions
(:mod:`pointwise`), views, slices and concatenations (:mod:`shapes`), contractions
(:mod:`contractions`), and normalisation, attention, losses and pooling (:mod:`nn`).
Each module's ``RULES`` maps ATen overload-packet names to its rules."""
