"""The validating webhook's judgement: what the CRD's schema and CEL cannot say.

The API server first checks an AlpaJob against the CRD (generated from the typed spec:
types, enums, bounds, defaults, CEL rules). The webhook then calls
:func:`validate_alpajob`, which returns one message per problem, each starting with the
field's path in the manifest's camelCase spelling and saying how to fix it::

    spec.model.config: unknown gpt size '9b'; choose one of tiny, 350m, 1.3b, ...

The checks are the contracts' own (:func:`alpajob.api.resource.document_problems`: the
typed model, then :mod:`alpajob.api.validation`), the same the CLI runs. The webhook
judges ``spec`` only: on an UPDATE the API server sends the whole object, status and
finalizers included, and an update that leaves ``spec`` as it was (a status write, a
finalizer added or removed, a deletion in progress) is always allowed, so the webhook can
never hold a job's deletion up. An update that changes ``spec`` is judged whole and
refused if it changes an immutable field.

It imports neither kopf nor JAX; the operator's webhook handler wraps it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from alpajob.api.resource import document_problems


def validate_alpajob(body: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> list[str]:
    """Every problem of the AlpaJob ``body`` (``old``: the stored object, on an update)."""
    if old is not None and body.get("spec") == old.get("spec"):
        return []
    return [str(problem) for problem in document_problems(dict(body), dict(old) if old else None)]
