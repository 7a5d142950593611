"""How each op may be sharded: its index map (:mod:`index_maps`) and the candidate strategies
that map yields on a logical mesh (:mod:`candidates`)."""
