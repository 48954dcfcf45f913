"""The one front door of manifests (:mod:`alpajob.api.documents`): what an attacker or a
careless user hands ``alpajob plan`` is refused in one line naming the file and the
line, at once, and what YAML allows on purpose (merge keys, anchors that repeat a
part) still loads."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from alpajob.api.documents import MAX_BYTES, MAX_DEPTH, MAX_NODES, load_documents, read_text
from alpajob.api.errors import ManifestError
from alpajob.api.resource import load_job

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = (ROOT / "manifests" / "examples" / "manual-gpt.yaml").read_text()


def refusal(text: str) -> str:
    started = time.perf_counter()
    with pytest.raises(ManifestError) as refused:
        load_documents(text, "job.yaml")
    assert time.perf_counter() - started < 5.0
    message = str(refused.value)
    assert "\n" not in message and message.startswith("job.yaml")
    return message


def bomb(levels: int) -> str:
    """The billion-laughs document: each anchor is nine aliases of the one before."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_a_duplicate_key_is_refused_naming_both_lines() -> None:
    text = EXAMPLE + "spec:\n  cluster: {gpu: cpu}\n"
    message = refusal(text)
    assert "gives the key 'spec' twice" in message and "also on line" in message
    assert refusal("{a: 1, a: 2}").startswith("job.yaml: line 1:")
    nested = "spec:\n  cluster:\n    nodes: 1\n    nodes: 2\n"
    assert refusal(nested) == ("job.yaml: line 4: gives the key 'nodes' twice (also on line 3): "
                               "YAML would keep only the last one; keep one")


def test_merge_keys_and_anchors_that_repeat_a_part_still_load() -> None:
    [doc] = load_documents("base: &b {x: 1, y: 2}\nd:\n  <<: *b\n  x: 3\ne: *b\n")
    assert doc == {"base": {"x": 1, "y": 2}, "d": {"x": 3, "y": 2}, "e": {"x": 1, "y": 2}}
    assert len(load_documents(bomb(4))[0]) == 4  # 9**4 values: repeated, not multiplied past the bound


def test_an_alias_bomb_is_counted_not_built() -> None:
    message = refusal(bomb(9))  # 9**9 "lol"s: 387,420,489 values in the last key alone
    assert f"more than {MAX_NODES:,}" in message
    assert int(message.split("expands to ")[1].split(" ")[0].replace(",", "")) > 9**9


def test_a_node_that_contains_itself_is_refused() -> None:
    assert "refers to itself" in refusal("a: &a [*a]\n")
    assert "refers to itself" in refusal("a: &a {b: *a}\n")


@pytest.mark.parametrize("text", ["a: " + "[" * 5000 + "]" * 5000,
                                  "".join("  " * i + f"k{i}:\n" for i in range(300)) + "  " * 300 + "v: 1\n"])
def test_deep_nesting_is_refused_before_the_stack_ends(text: str) -> None:
    assert f"nests deeper than {MAX_DEPTH} levels" in refusal(text)


def test_invalid_yaml_is_one_line_with_its_line_and_column() -> None:
    assert refusal("a: [\n").startswith("job.yaml: line 2, column 1: is not valid YAML: expected the node content")
    assert refusal("a: b: c\n").startswith("job.yaml: line 1, column 5: is not valid YAML")
    assert "keys are names" in refusal("? [1, 2]\n: x\n")


def test_a_binary_or_endless_or_huge_file_is_refused_at_once(tmp_path: Path) -> None:
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"kind: AlpaJob\n\xff\xfe\x00junk")
    with pytest.raises(ManifestError, match=r"is not UTF-8 text \(byte 14 is 0xff\)"):
        read_text(binary)
    huge = tmp_path / "huge.yaml"
    huge.write_bytes(b"# " + b"x" * MAX_BYTES + b"\n")
    with pytest.raises(ManifestError, match="larger than 3 MiB"):
        load_job(huge)
    started = time.perf_counter()
    with pytest.raises(ManifestError, match="larger than 3 MiB"):
        load_job("/dev/zero")
    assert time.perf_counter() - started < 5.0
    with pytest.raises(ManifestError, match="cannot read the manifest"):
        load_job(tmp_path / "missing.yaml")


def test_the_cli_answers_each_in_one_line_and_exit_code_2(tmp_path: Path) -> None:
    bad = tmp_path / "bomb.yaml"
    bad.write_text(EXAMPLE + "extra: " + bomb(9).replace("\n", "\n  ").replace("a0:", "\n  a0:", 1))
    done = subprocess.run([sys.executable, "-m", "alpajob", "plan", str(bad)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "expands to" in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr


def _fields(model: type, seen: set[type]) -> list[tuple[str, Any, Any]]:
    """Every (model.field, annotation, FieldInfo) reachable from ``model``."""
    import typing

    from pydantic import BaseModel

    if model in seen:
        return []
    seen.add(model)
    out = []
    for name, info in model.model_fields.items():  # type: ignore[attr-defined]
        out.append((f"{model.__name__}.{name}", info.annotation, info))
        stack = [info.annotation]
        while stack:
            kind = stack.pop()
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                out += _fields(kind, seen)
            stack += list(typing.get_args(kind))
    return out


def test_every_number_of_the_spec_is_bounded_as_the_api_server_bounds_it() -> None:
    """What users write (``spec``; the status is the operator's). An int of format int64/int32 is bounded by it in the typed model (a larger one
    was a traceback deep in the planner); a float is finite (``.inf`` trained to a NaN
    loss and exit 0)."""
    import typing

    from alpajob.api.spec import Spec

    ints = floats = 0
    for name, annotation, info in _fields(Spec, set()):
        kinds = set(typing.get_args(annotation)) | {annotation}
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        limits = {type(m).__name__: m for m in info.metadata}
        if int in kinds and extra.get("format") in ("int64", "int32"):
            ints += 1
            top = 2**63 - 1 if extra["format"] == "int64" else 2**31 - 1
            bound = (getattr(limits.get("Le"), "le", None) or getattr(limits.get("Lt"), "lt", None)
                     or extra.get("maximum"))  # a sane range (alpajob.api.limits) below the format's
            assert bound is not None and bound <= top, name
        if float in kinds:
            floats += 1
            finite = any(getattr(m, "allow_inf_nan", None) is False for m in info.metadata)
            assert finite or name == "DataSource.weight", f"{name} takes .inf and .nan"  # weight: its own check
    assert ints >= 15 and floats >= 7


@pytest.mark.parametrize(("edit", "field", "says"), [
    ({"globalBatchSize": 2**63}, "spec.training.globalBatchSize", "is above 16,777,216, the most AlpaJob takes"),
    ({"seed": 2**64}, "spec.training.seed", "less than or equal to"),
    ({"seed": -1}, "spec.training.seed", "greater than or equal to 0"),
    ({"learningRate": float("inf")}, "spec.training.learningRate", "finite number"),
    ({"optimizer": {"name": "adamw", "weightDecay": float("inf")}}, "spec.training.optimizer", "finite number"),
    ({"optimizer": {"name": "adamw", "clipNorm": float("nan")}}, "spec.training.optimizer", "finite number"),
])
def test_numbers_out_of_bounds_are_one_line_naming_the_field(edit: dict[str, Any], field: str, says: str) -> None:
    import yaml

    from alpajob.api.resource import parse_job

    doc = yaml.safe_load(EXAMPLE)
    doc["spec"].setdefault("training", {}).update(edit)
    with pytest.raises(ManifestError) as refused:
        parse_job(doc)
    message = str(refused.value)
    assert message.startswith(field) and says in message and "\n" not in message, message
