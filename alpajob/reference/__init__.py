"""The reference pages of the documentation site, generated from the code.

Each module renders one page of ``docs/reference/`` from the one place its facts live,
so the page cannot say what the code does not:

- :mod:`.api`: the AlpaJob API, from the CustomResourceDefinition that
  :mod:`alpajob.api.crd` generates from the typed spec and status (types, defaults,
  bounds, enums, CEL rules, descriptions);
- :mod:`.cli`: every ``alpajob`` command and flag, from the argparse parsers;
- :mod:`.metrics`: every Prometheus series, from the trainer's and the operator's
  registries;
- :mod:`.alerts`: every alert, from the Helm chart's PrometheusRule as rendered with its
  default values;
- :mod:`.helm_values`: every chart value, from ``values.schema.json`` and ``values.yaml``.

:mod:`.pages` lists them; ``python -m alpajob.reference`` writes them and
``python -m alpajob.reference --check`` (and ``tests/test_reference.py``) fails when a
committed page differs from what the code generates. This package sits above the CLI in
the import layers: it reads every layer and nothing imports it.
"""
