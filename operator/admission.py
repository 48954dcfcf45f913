"""The validating webhook's judgement: what the CRD's schema and CEL cannot say.

The API server first checks an AlpaJob against the CRD (generated from the typed spec:
types, enums, bounds, defaults, CEL rules). The webhook then calls
:func:`validate_alpajob`, which returns one message per problem, each starting with the
field's path in the manifest's camelCase spelling and saying how to fix it::

    spec.model.config: unknown gpt size '9b'; choose one of tiny, 350m, 1.3b, ...

The checks are the contracts' own (:func:`alpajob.api.resource.document_problems`: the
typed model, then :mod:`alpajob.api.validation`), the same the CLI runs, then the
cluster's: data schemes, credentials written as literals, and the free-form parts of
``spec.podTemplate`` against Kubernetes' types (:mod:`alpajob.operator.pod_shapes`). The webhook
judges ``spec`` only: on an UPDATE the API server sends the whole object, status and
finalizers included, and an update that leaves ``spec`` as it was (a status write, a
finalizer added or removed, a deletion in progress) is always allowed, so the webhook can
never hold a job's deletion up. An update that changes ``spec`` is judged whole and
refused if it changes an immutable field.

It imports neither kopf nor JAX; the operator's webhook handler wraps it.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

from alpajob.api.data import DEFAULT_DATA_SCHEMES, DataSpec
from alpajob.api.resource import document_problems
from alpajob.operator.pod_shapes import template_problems

#: Other spellings fsspec accepts for one store.
SCHEME_ALIASES = {"gcs": "gs", "s3a": "s3", "local": "file"}


def scheme_of(location: str) -> str:
    """``s3`` for ``s3://bucket/x``; ``file`` for a path."""
    if "://" not in location:
        return "file"
    scheme = location.split("://", 1)[0].lower()
    return SCHEME_ALIASES.get(scheme, scheme)


def data_scheme_problems(body: Mapping[str, Any], allowed: Collection[str]) -> list[str]:
    """One problem per place of ``spec.data`` whose scheme the cluster does not allow."""
    raw = (body.get("spec") or {}).get("data")
    if not raw:
        return []
    data = DataSpec.model_validate(raw)
    wanted = {SCHEME_ALIASES.get(s, s) for s in allowed}
    return [f"{field}: {location!r} reads over {scheme}://, which this cluster does not allow (its operator "
            f"allows {', '.join(sorted(wanted))}); copy the data to an allowed store, or ask the cluster's "
            f"admins to add {scheme} to the operator's --data-schemes (the chart's dataSchemes)"
            for field, location in data.locations() if (scheme := scheme_of(location)) not in wanted]


#: Parts of an env var's name (split at ``_``, ``-``, ``.``) that say it holds a
#: credential: ``HF_TOKEN``, ``DB_PASSWORD``, ``WANDB_API_KEY``, ``AWS_SECRET_ACCESS_KEY``
#: (but not ``TOKENIZERS_PARALLELISM`` or ``MAX_TOKENS``).
CREDENTIAL_WORDS = frozenset({"PASSWORD", "PASSWD", "SECRET", "TOKEN", "APIKEY", "CREDENTIAL", "CREDENTIALS"})
CREDENTIAL_PAIRS = frozenset({("API", "KEY"), ("ACCESS", "KEY"), ("PRIVATE", "KEY"), ("AUTH", "KEY")})
#: What a credential's value looks like, whatever its name: an AWS access key id, a
#: GitHub or Slack or OpenAI-style token, a JWT, a PEM private key.
CREDENTIAL_VALUE = re.compile(r"AKIA[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{30,}|xox[abpr]-[A-Za-z0-9-]{10,}"
                              r"|sk-[A-Za-z0-9_-]{20,}|eyJ[A-Za-z0-9_-]{8,}\.eyJ|-----BEGIN [A-Z ]*PRIVATE KEY-----")


def credential_problems(body: Mapping[str, Any]) -> list[str]:
    """One problem per literal ``env[].value`` of ``spec.podTemplate`` that looks like a
    credential: the job's pods read the job from ``<job>-config``, a ConfigMap every pod
    of the namespace may read, so a value written there is no secret."""
    templates = ((body.get("spec") or {}).get("podTemplate")) or {}
    problems = []
    for role in ("planner", "head", "mesh"):
        for index, var in enumerate(((templates.get(role) or {}).get("env")) or []):
            if not isinstance(var, Mapping) or not var.get("value"):
                continue
            parts = [p for p in re.split(r"[_.-]", str(var.get("name", "")).upper()) if p]
            named = any(p in CREDENTIAL_WORDS for p in parts) or any(pair in CREDENTIAL_PAIRS
                                                                    for pair in zip(parts, parts[1:], strict=False))
            if named or CREDENTIAL_VALUE.search(str(var["value"])):
                problems.append(
                    f"spec.podTemplate.{role}.env[{index}] ({var.get('name')}): a literal value that looks like a "
                    "credential would be readable by every pod of the namespace (the job is kept in a ConfigMap); "
                    f"put it in a Secret and use valueFrom: {{secretKeyRef: {{name: <secret>, key: <key>}}}}")
    return problems


def validate_alpajob(body: Mapping[str, Any], old: Mapping[str, Any] | None = None,
                     data_schemes: Collection[str] = DEFAULT_DATA_SCHEMES) -> list[str]:
    """Every problem of the AlpaJob ``body`` (``old``: the stored object, on an update);
    ``data_schemes``: the URL schemes ``spec.data`` may read over."""
    if old is not None and body.get("spec") == old.get("spec"):
        return []
    problems = [str(problem) for problem in document_problems(dict(body), dict(old) if old else None)]
    return problems or (data_scheme_problems(body, data_schemes) + credential_problems(body)
                        + template_problems(body))
