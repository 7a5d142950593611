"""What the model is: its ATen-level graph with shapes and costs (:mod:`tracer`, built from
:mod:`export`, :mod:`values`, :mod:`node_costs`, :mod:`naming` and :mod:`graph_hash`, held in
:mod:`graph`), the blocks it repeats (:mod:`repeated`), its cut into pipeline layers
(:mod:`layers`), and the pieces a pipeline needs (:mod:`subgraph`, :mod:`microbatch`)."""
