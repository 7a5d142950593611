"""Index-map rules, one module per op family: element-wise ops and reductions
(:mod:`pointwise`), views, slices and concatenations (:mod:`shapes`), contractions
(:mod:`contractions`), normalisation, attention, losses and pooling (:mod:`nn`), and
mixture-of-experts ops: grouped matmuls, ``histc``, ``scatter`` (:mod:`moe`).
Each module's ``RULES`` maps ATen overload-packet names to its rules."""
