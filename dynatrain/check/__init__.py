"""The check of a switch: every element indexed by what its tensor says, never by the plan the engine ran.

placement.py (where a local tensor lies, from its own placements), hashing.py and hash_weights.py (the element
hash: separable odd weights summed through int8 matrix products), scalars.py (scalars and objects hashed whole),
state_sums.py (per-state sums of a whole state, reduced and compared, replication counted from the tensors),
module_states.py (a live module and optimizer named as the switch's capture names them), verify.py (the check of
one switch: what was sent against what was received), replicas.py (before a recovery, the survivors' copies of
each region compared). Below the switch, which calls it; above the engine, whose
pieces and boxes it reads; it moves no byte.
"""
