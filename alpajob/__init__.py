"""AlpaJob: Alpa's two-level automatic parallelization on stock JAX, as a Kubernetes job.

Subpackages (each a top-level folder of the repository):

- ``alpajob.planner``  (planner/): pure planning, from a traced training step and a
  cluster spec to a Plan document.
- ``alpajob.trainer``  (trainer_image/): the model zoo and, later, the runtime that
  executes a Plan.
- ``alpajob.operator`` (operator/): the Kubernetes operator.
- ``alpajob.cli``: the ``alpajob`` console script.
"""

__version__ = "0.1.0"
