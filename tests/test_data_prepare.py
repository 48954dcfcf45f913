"""``alpajob data prepare``: real text and jsonl into token shards with an index, cut into
units mid-file, in parallel processes, resumed after an interruption to the same result."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from alpajob.api.data import DataFormat, DataSpec, TokenIndex
from alpajob.api.errors import ManifestError
from alpajob.api.options import PrepareOptions
from alpajob.trainer_image.data.corpus import TokenCorpus, open_source, open_train
from alpajob.trainer_image.data.prepare import STATE_FILE, Tick, prepare
from alpajob.trainer_image.data.remote import BlockCache
from alpajob.trainer_image.data.shards import Opener
from alpajob.trainer_image.data.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parent.parent
TEXT = str(ROOT / "planner" / "**" / "*.py")


def opener() -> Opener:
    return Opener("spec.data.train", DataSpec(train="x").token_dtype, BlockCache("/nonexistent", "0"))


def stream(spec: DataSpec, split: str = "train") -> np.ndarray:
    """Every id of a split, as one array."""
    patterns = spec.train_paths() if split == "train" else spec.eval_paths()
    corpus = open_source(spec, split, f"spec.data.{split}", patterns, ByteTokenizer(), opener())
    return corpus.read(0, corpus.tokens)[0]


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real documents as jsonl: each planner source file one line."""
    path = tmp_path_factory.mktemp("jsonl") / "docs.jsonl"
    files = sorted((ROOT / "planner").rglob("*.py"))
    path.write_text("".join(json.dumps({"text": f.read_text(), "path": f.name}) + "\n" for f in files))
    return path


def test_prepared_shards_hold_the_ids_of_tokenizing_whole_files(tmp_path: Path, jsonl: Path) -> None:
    for data, unit in ((DataSpec(train=TEXT, eval=str(ROOT / "operator" / "*.py")), 5_000),
                       (DataSpec(train=str(jsonl), format=DataFormat.JSONL), 7_777)):
        out = tmp_path / data.format.value
        # Units of a few KB: files are cut mid-line and small ones share a unit.
        spec = prepare(data, PrepareOptions(output=str(out), shard_size=40_000, workers=1, unit_bytes=unit))
        prepared = DataSpec.model_validate(spec)
        assert prepared.format is DataFormat.TOKENS and prepared.train == str(out / "train")
        np.testing.assert_array_equal(stream(prepared), stream(data))
        index = TokenIndex.model_validate_json((out / "train" / "index.json").read_text())
        assert index.vocab_size == 256 and index.end_of_text == 0 and index.dtype.value == "uint16"
        assert all(s.tokens == 20_000 for s in index.shards[:-1]) and 0 < index.shards[-1].tokens <= 20_000
        documents = int((stream(data) == 0).sum())
        assert sum(s.documents for s in index.shards) == documents
        assert index.max_id == int(stream(data).max())
        if data.eval is not None:
            np.testing.assert_array_equal(stream(prepared, "eval"), stream(data, "eval"))
        # The printed spec opens with no listing of its shards: the index says it all.
        [corpus] = open_train(prepared, ByteTokenizer(), opener())
        assert corpus.max_id == index.max_id and len(corpus.shards) == len(index.shards)


def test_parallel_workers_write_what_one_process_writes(tmp_path: Path, jsonl: Path) -> None:
    data = DataSpec(train=str(jsonl), format=DataFormat.JSONL)
    one = prepare(data, PrepareOptions(output=str(tmp_path / "one"), shard_size=50_000, workers=1,
                                       unit_bytes=20_000))
    two = prepare(data, PrepareOptions(output=str(tmp_path / "two"), shard_size=50_000, workers=2,
                                       unit_bytes=20_000))
    a, b = Path(one["train"]), Path(two["train"])
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for shard in a.glob("*.bin"):
        assert shard.read_bytes() == (b / shard.name).read_bytes(), shard.name


def test_an_interrupted_prepare_resumes_keeping_its_finished_shards(tmp_path: Path, jsonl: Path) -> None:
    data = DataSpec(train=str(jsonl), format=DataFormat.JSONL)
    options = dict(shard_size=30_000, workers=1, unit_bytes=9_000)
    whole = tmp_path / "whole"
    prepare(data, PrepareOptions(output=str(whole), **options))

    cut = tmp_path / "cut"

    def stop_midway(tick: Tick) -> None:
        if tick.units_done == tick.units // 2:
            raise KeyboardInterrupt  # Ctrl-C (SIGTERM unwinds the same way in the CLI)

    with pytest.raises(KeyboardInterrupt):
        prepare(data, PrepareOptions(output=str(cut), **options), stop_midway)
    state = json.loads((cut / STATE_FILE).read_text())["splits"]["train"]
    finished = {p.name: p.stat().st_mtime_ns for p in (cut / "train").glob("*.bin")}
    assert len(finished) == len(state["shards"]) >= 2 and not state["done"]
    assert not (cut / "train" / "index.json").exists()

    ticks: list[Tick] = []
    prepare(data, PrepareOptions(output=str(cut), **options), ticks.append)
    assert ticks[0].units_done > 1  # it did not start from the first unit again
    last = ticks[-1]
    assert (last.units_done, last.files_done, last.bytes_done) == (last.units, last.files, last.bytes) == (
        last.units, 1, jsonl.stat().st_size)
    for name, mtime in finished.items():
        assert (cut / "train" / name).stat().st_mtime_ns == mtime, f"{name} was rewritten"
    for shard in (whole / "train").glob("*.bin"):
        assert shard.read_bytes() == (cut / "train" / shard.name).read_bytes(), shard.name
    assert (whole / "train" / "index.json").read_text() == (cut / "train" / "index.json").read_text()
    # Done: a third run writes nothing; other inputs are refused, not mixed in.
    prepare(data, PrepareOptions(output=str(cut), **options), ticks.append)
    with pytest.raises(ManifestError, match="other inputs .*shardSize") as info:
        prepare(data, PrepareOptions(output=str(cut), **{**options, "shard_size": 60_000}))
    assert info.value.field == "--output"


def test_a_tokenizer_json_prepares_in_worker_processes(tmp_path: Path, jsonl: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = ["def", "return", "self", "import", "the", "plan", "stage", "<|endoftext|>", "[UNK]"]
    made = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    made.pre_tokenizer = Whitespace()
    made.save(str(tmp_path / "tokenizer.json"))
    data = DataSpec(train=str(jsonl), format=DataFormat.JSONL, tokenizer=str(tmp_path / "tokenizer.json"))
    spec = prepare(data, PrepareOptions(output=str(tmp_path / "out"), workers=2, unit_bytes=50_000))
    from alpajob.trainer_image.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(data.tokenizer)
    direct = open_source(data, "train", "spec.data.train", data.train_paths(), tokenizer, opener())
    prepared = DataSpec.model_validate(spec)
    [again] = open_train(prepared, tokenizer, opener())
    np.testing.assert_array_equal(again.read(0, again.tokens)[0], direct.read(0, direct.tokens)[0])
    index = TokenIndex.model_validate_json((tmp_path / "out" / "train" / "index.json").read_text())
    assert (index.vocab_size, index.end_of_text, index.tokenizer) == (9, 7, data.tokenizer)


def test_the_cli_prints_the_spec_that_reads_the_shards(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from alpajob.cli.main import main

    manifest = tmp_path / "job.yaml"
    document = {"apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "prep"},
                "spec": {"model": {"zoo": "gpt", "config": "tiny"}, "cluster": {"gpu": "cpu"},
                         "data": {"train": TEXT}}}
    manifest.write_text(yaml.safe_dump(document))
    assert main(["data", "prepare", str(manifest), "--output", str(tmp_path / "tokens"), "--shard-size",
                 "64Ki", "--workers", "2"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out.split("read them with:", 1)[1])
    assert printed["spec"]["data"] == {"train": str(tmp_path / "tokens" / "train"), "format": "tokens",
                                       "tokenizer": "bytes"}
    assert max(p.stat().st_size for p in (tmp_path / "tokens" / "train").glob("*.bin")) == 64 * 1024
    assert main(["data", "prepare", str(manifest), "--output", str(manifest)]) == 2
    assert "is a file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:  # argparse's usage error: one line naming the flag
        main(["data", "prepare", str(manifest), "-o", str(tmp_path / "x"), "--shard-size", "lots"])
    assert usage.value.code == 2 and "--shard-size: 'lots' is not a size" in capsys.readouterr().err
    document["spec"]["data"] = {"train": [{"path": TEXT, "weight": 1}, {"path": TEXT, "weight": 2, "name": "b"}]}
    manifest.write_text(yaml.safe_dump(document))
    assert main(["data", "prepare", str(manifest), "-o", str(tmp_path / "mix")]) == 2
    assert "mixture" in capsys.readouterr().err


def test_prepared_data_trains_as_its_text_does(tmp_path: Path) -> None:
    """The same batches from the shards as from the text they came from."""
    from alpajob.api.resource import parse_job
    from alpajob.trainer_image.data.feed import open_feed
    from alpajob.trainer_image.zoo import resolve_model

    text = DataSpec(train=TEXT)
    spec = prepare(text, PrepareOptions(output=str(tmp_path / "p"), shard_size=100_000, workers=1))

    def feed_of(data: dict) -> object:
        return open_feed(parse_job({"apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob",
                                    "metadata": {"name": "p"},
                                    "spec": {"model": {"zoo": "gpt", "config": "tiny"}, "cluster": {"gpu": "cpu"},
                                             "training": {"globalBatchSize": 8}, "data": data}}),
                         resolve_model("gpt", "tiny"), prefetch=0)

    a, b = feed_of({"train": TEXT}), feed_of(spec)
    try:
        for step in (0, 1, 50):
            for x, y in zip(a.batch_at(step), b.batch_at(step), strict=True):
                np.testing.assert_array_equal(x, y)
        assert isinstance(b.train.reader.corpora[0], TokenCorpus) and len(b.train.reader.corpora[0].shards) > 1
    finally:
        a.close()
        b.close()
