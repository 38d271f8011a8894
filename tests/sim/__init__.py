"""The recipe's deterministic simulator: ``model`` (etcd's semantics, pure Python),
``real`` (the same interface on a real etcd, for the comparison), ``scenarios`` (operation
sequences run on both), ``schedule`` (the seeded scheduler and the properties), ``variants``
(broken Waiters and read plans, each with one known mistake the simulator must catch).
docs/design.md, "What the simulator explores, and what it cannot", says what it covers."""
