"""How each op may be sharded: its index map (:mod:`index_maps`, built from the type in
:mod:`letters` and the per-family rules in :mod:`rules`) and the candidate strategies that map
yields on a logical mesh (:mod:`candidates`)."""
