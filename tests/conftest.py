"""Test setup: 8 forced CPU devices for JAX, set before JAX is first imported; every
test its own plan cache (``XDG_CACHE_HOME``), so no test reads a plan another made;
a real plan of the manual example for the operator's tests (``plan_json``)."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(autouse=True)
def _own_plan_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def plan_json(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A real plan of the 2-stage manual example (``alpajob plan --output``)."""
    from alpajob.cli.main import main

    out = tmp_path_factory.mktemp("plan") / "plan.json"
    example = Path(__file__).parent.parent / "manifests" / "examples" / "manual-gpt.yaml"
    assert main(["plan", str(example), "--output", str(out)]) == 0
    return out.read_text()
