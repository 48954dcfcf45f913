"""The intra-operator pass (Alpa section 4): one layer or stage on one logical mesh.

Sharding specs and resharding costs (:mod:`.sharding`), each op's strategies
(:mod:`.strategies`) and followers (:mod:`.follow`, :mod:`.op_tables`), the ILP's nodes,
edges and memory (:mod:`.model`, :mod:`.edge_costs`), its solution (:mod:`.ilp` over
:mod:`.milp`), and the pass's entry (:mod:`.solve`: ``solve_intra_op``)."""
