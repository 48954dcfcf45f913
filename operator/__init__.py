"""The kopf operator for AlpaJob resources (``alpajob.operator``).

Not built yet: it lands with the operator issue. It may import the planner's plan
and spec types, kopf and kubernetes, never JAX (see shared ARCHITECTURE.md).
"""
