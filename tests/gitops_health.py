"""How GitOps tools judge an AlpaJob, each run as the tool runs it:

- Argo CD's Lua health check (``gitops/argocd/alpajob.io/AlpaJob/health.lua``) in a
  real Lua interpreter (lupa), the object as the global ``obj``;
- Flux's health expressions (``gitops/flux/alpajob-health.yaml``) evaluated by a CEL
  implementation (cel-python) in kustomize-controller's order;
- kstatus's generic rules (Flux's ``wait`` without expressions, kpt), written out.

kstatus's rules for a custom resource (sigs.k8s.io/cli-utils, pkg/kstatus/status:
the generic checks, all that apply to a kind it does not know), in order:

1. ``metadata.deletionTimestamp`` set: Terminating (in progress).
2. ``status.observedGeneration`` present and not ``metadata.generation``: InProgress
   (the controller has not seen the latest spec).
3. Condition ``Reconciling`` with status True: InProgress.
4. Condition ``Stalled`` with status True: Failed.
5. Otherwise: Current.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lupa

ROOT = Path(__file__).resolve().parent.parent
ARGOCD = ROOT / "gitops" / "argocd" / "alpajob.io" / "AlpaJob"


def argocd_health(obj: dict[str, Any] | None, script: Path = ARGOCD / "health.lua") -> dict[str, str]:
    """``{status, message}`` as Argo CD's health check says of ``obj``."""
    lua = lupa.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj or {}, recursive=True)
    result = lua.execute(script.read_text())
    return {key: str(result[key]) for key in ("status", "message") if result[key] is not None}


FLUX = ROOT / "gitops" / "flux" / "alpajob-health.yaml"
#: What each phase must read as, once the operator has seen the job's spec: (Argo CD's
#: health, Flux's and kstatus's status). Running is Healthy once Ready.
VERDICTS = {"Pending": ("Progressing", "InProgress"), "Planning": ("Progressing", "InProgress"),
            "Queued": ("Progressing", "InProgress"),
            "Starting": ("Progressing", "InProgress"), "Restarting": ("Progressing", "InProgress"),
            "Running": ("Healthy", "Current"), "Succeeded": ("Healthy", "Current"),
            "Suspended": ("Suspended", "Current"), "Failed": ("Degraded", "Failed")}
#: The object's top-level fields, each a variable of Flux's health expressions.
TOP_LEVEL = frozenset({"apiVersion", "kind", "metadata", "spec", "status"})


class CelError(Exception):
    """An expression Flux could not evaluate (it keeps waiting, up to its timeout)."""


def flux_health(obj: dict[str, Any], check: dict[str, str] | None = None) -> str:
    """Flux's verdict on ``obj`` under the health expressions ``check`` (default the
    shipped ones), evaluated as kustomize-controller evaluates them (Flux RFC-0009):
    a generation the status has not observed is InProgress; then inProgress, failed
    and current in that order, the first true one wins; none true is InProgress. The
    object's top-level fields are the expressions' variables; an evaluation error is
    raised as :class:`CelError`."""
    import celpy
    import yaml

    if check is None:
        [check] = yaml.safe_load(FLUX.read_text())
    status = obj.get("status") or {}
    observed = status.get("observedGeneration")
    if observed is not None and observed != obj.get("metadata", {}).get("generation"):
        return "InProgress"
    env = celpy.Environment()
    activation = {key: celpy.json_to_cel(value) for key, value in obj.items()}
    for field, verdict in (("inProgress", "InProgress"), ("failed", "Failed"), ("current", "Current")):
        if not check.get(field):
            continue
        # cel-go (Flux) fails on a top-level variable the object lacks, even inside
        # has(), which cannot test a top-level field; cel-python is lenient there.
        absent = sorted(name for name in TOP_LEVEL - set(obj)
                        if re.search(rf"(?<![.\w]){name}\b", check[field]))
        if absent:
            raise CelError(f"{field}: no such attribute {absent[0]!r}")
        try:
            result = env.program(env.compile(check[field])).evaluate(activation)
        except Exception as error:  # celpy raises several kinds for a missing variable
            raise CelError(f"{field}: {error}") from error
        if isinstance(result, celpy.CELEvalError):
            raise CelError(f"{field}: {result}")
        if bool(result):
            return verdict
    return "InProgress"


def kstatus(obj: dict[str, Any]) -> str:
    """The kstatus result of ``obj`` by the rules in the module docstring."""
    meta, status = obj.get("metadata", {}), obj.get("status") or {}
    if meta.get("deletionTimestamp"):
        return "Terminating"
    observed = status.get("observedGeneration")
    if observed is not None and observed != meta.get("generation"):
        return "InProgress"
    conditions = {c["type"]: c for c in status.get("conditions", [])}
    if conditions.get("Reconciling", {}).get("status") == "True":
        return "InProgress"
    if conditions.get("Stalled", {}).get("status") == "True":
        return "Failed"
    return "Current"


#: Why the operator put the fixture job in each phase (reason, message).
PHASE_REASONS = {
    "Pending": ("Created", ""),
    "Planning": ("Planning", "the planner pod gpt-small-planner is running"),
    "Queued": ("Queued", "waiting for quota in LocalQueue team (Workload gpt-small-0): couldn't assign flavors "
                         "to pod set mesh-5f0c2a9e: insufficient unused quota for nvidia.com/gpu in flavor h100, "
                         "8 more needed"),
    "Starting": ("PodsStarting", "0 of 3 pods running"),
    "Running": ("Training", "step 40 of 100"),
    "Restarting": ("PodFailed", "pod gpt-small-0-m1-h0 failed (OOMKilled); restart 1 of 3"),
    "Succeeded": ("TrainingFinished", "trained 100 steps"),
    "Failed": ("PlanningFailed", "spec.model: gpt 175b needs 350.2 GiB per device on 8 x a100-80gb; "
                                 "the largest plan holds 72.0 GiB: add nodes or choose a smaller model"),
    "Suspended": ("Suspended", "spec.runPolicy.suspend is true"),
}


def phase_fixture(phase: str) -> dict[str, Any]:
    """``testdata/phase-<phase>.yaml``: a job the operator's own status code
    (:func:`~alpajob.operator.status.set_phase`) put in ``phase``, from Pending."""
    from alpajob.api.status import Phase, PlanSummary, Status
    from alpajob.operator.status import set_phase

    status = Status()
    set_phase(status, Phase.PENDING, "Created", "", 1, "2026-11-27T10:00:00Z", False)
    if phase not in ("Pending", "Planning", "Failed"):
        status.plan = PlanSummary(config_map="gpt-small-plan", hash="3f2a", stages=2, meshes=2,
                                  predicted_step_seconds=0.41, num_micro_batches=4)
    reason, message = PHASE_REASONS[phase]
    set_phase(status, Phase(phase), reason, message, 1, "2026-11-27T10:05:00Z", phase == "Running")
    return {"apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob",
            "metadata": {"name": "gpt-small", "namespace": "ml", "generation": 1},
            "spec": {"model": {"zoo": "gpt", "config": "tiny"},
                     "training": {"globalBatchSize": 32, "steps": 100}},
            "status": status.to_dict()}
