"""kstatus (Flux's ``wait`` and ``healthChecks``, kpt) reads every phase of an AlpaJob
as its published rules say it should (the rules: ``gitops_health``'s docstring):
InProgress on the way, Current when done or running, Failed when failed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from alpajob.api.status import ConditionType, Phase, Status
from alpajob.operator.status import set_phase

sys.path.insert(0, str(Path(__file__).parent))
from gitops_health import VERDICTS, kstatus  # noqa: E402

NOW = "2026-11-27T10:00:00Z"


def job_in(phase: Phase, generation: int = 2, reason: str = "Because", message: str = "why") -> dict:
    """An AlpaJob as the API returns it after the operator put it in ``phase``
    (having passed through Pending first, as every job does)."""
    status = Status()
    set_phase(status, Phase.PENDING, "Created", "", generation, NOW, False)
    set_phase(status, phase, reason, message, generation, NOW, phase is Phase.RUNNING)
    return {"apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob",
            "metadata": {"name": "j", "namespace": "ns", "generation": generation},
            "status": status.to_dict()}


EXPECTED = {Phase(phase): flux for phase, (_argo, flux) in VERDICTS.items()}


def test_every_phase_has_an_expected_result():
    assert set(EXPECTED) == set(Phase)


@pytest.mark.parametrize("phase", list(Phase))
def test_kstatus_reads_each_phase(phase):
    assert kstatus(job_in(phase)) == EXPECTED[phase]


@pytest.mark.parametrize("phase", list(Phase))
def test_conditions_carry_the_generation_and_the_failure(phase):
    """observedGeneration on the status and on every condition; Stalled carries the
    failure's reason and message, Reconciling the reason of the phase it waits in."""
    job = job_in(phase, generation=7, reason="PlannerFailed", message="the plan does not fit")
    status = job["status"]
    assert status["observedGeneration"] == 7
    conditions = {c["type"]: c for c in status["conditions"]}
    assert {ConditionType.RECONCILING.value, ConditionType.STALLED.value} <= set(conditions)
    assert all(c["observedGeneration"] == 7 for c in conditions.values())
    stalled, reconciling = conditions["Stalled"], conditions["Reconciling"]
    assert (stalled["status"] == "True") == (phase is Phase.FAILED)
    if phase is Phase.FAILED:
        assert (stalled["reason"], stalled["message"]) == ("PlannerFailed", "the plan does not fit")
    assert (reconciling["status"] == "True") == (EXPECTED[phase] == "InProgress")


def test_a_spec_change_not_yet_seen_is_in_progress():
    """A finished job whose spec was edited (generation 3) reads InProgress until the
    operator writes the new generation, never Current on the old one."""
    job = job_in(Phase.SUCCEEDED, generation=2)
    job["metadata"]["generation"] = 3
    assert kstatus(job) == "InProgress"
    failed = job_in(Phase.FAILED, generation=2)
    failed["metadata"]["generation"] = 3
    assert kstatus(failed) == "InProgress"


def test_a_job_without_status_and_a_deleted_job():
    """Before the operator writes anything there is no observedGeneration and no
    condition, and kstatus's rules call that Current (the operator writes Pending on
    its first pass); a job being deleted is Terminating."""
    bare = {"metadata": {"name": "j", "generation": 1}}
    assert kstatus(bare) == "Current"
    deleting = job_in(Phase.RUNNING)
    deleting["metadata"]["deletionTimestamp"] = NOW
    assert kstatus(deleting) == "Terminating"
