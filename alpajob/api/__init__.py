"""The contracts between AlpaJob's parts: typed, JAX-free, imported by everything else.

One module per contract, each the only home of its names:

=============  ==============================================================
spec           the AlpaJob's ``spec`` (contract 1), its enums and sections
status         its ``status``: phases, conditions, plan summary, meshes
progress       what a trainer reports (status, Prometheus and the CLI read it)
resource       the whole resource; reading and judging a manifest
validation     what the types cannot say (manual stages, memory, immutability)
catalog        the device presets a spec may name
zoo            the zoo's models: sizes, config keys and their ranges, parameter counts
limits         the sane range of every count, and why it ends where it does
crd            the CustomResourceDefinition, generated from the models above
plan           the Plan document (contract 2), from the planner to everyone
runtime        what the operator gives a trainer pod (env, ports, paths)
options        what the CLI and the Python API pass to planning and training
names          labels, annotations, ConfigMap keys, the finalizer, the API group
errors         the error hierarchy (every message names a field and the fix)
release        the one version, and the image and chart references made from it
=============  ==============================================================

This package imports nothing else of AlpaJob's (import-linter enforces it).
"""
