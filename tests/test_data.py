"""The data pipeline: sources, tokenizers, corpora and the Grain loader, on real text
(this repository's own sources) and in fsspec's memory filesystem."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import fsspec
import numpy as np
import pytest

from alpajob.api.errors import ManifestError
from alpajob.api.resource import parse_job
from alpajob.api.spec import DataFormat, DataSpec, TokenDtype
from alpajob.trainer_image.data.corpus import Corpus, check_ids, load_corpus
from alpajob.trainer_image.data.feed import SYNTHETIC, open_feed, token_shape
from alpajob.trainer_image.data.loader import Shard, eval_batches, train_batches, windows
from alpajob.trainer_image.data.sources import expand
from alpajob.trainer_image.data.tokenizer import ByteTokenizer, check_vocabulary, load_tokenizer
from alpajob.trainer_image.zoo import resolve_model

ROOT = Path(__file__).resolve().parent.parent
#: Real text that is always here: this repository's own planner sources.
TEXT = str(ROOT / "planner" / "**" / "*.py")


def corpus_of(tokens: np.ndarray) -> Corpus:
    return Corpus(tokens.astype(np.int32), ("memory",), "spec.data.train")


def job(data: dict | None, **training: object) -> object:
    spec: dict = {"model": {"zoo": "gpt", "config": "tiny"},
                  "training": {"globalBatchSize": 8, **training}, "cluster": {"gpu": "cpu"}}
    if data is not None:
        spec["data"] = data
    return parse_job({"apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob",
                      "metadata": {"name": "data"}, "spec": spec})


# ----------------------------------------------------------------------------- sources
def test_globs_expand_to_sorted_files_and_stdlib_is_found() -> None:
    files = expand([TEXT], "spec.data.train")
    assert len(files) > 20 and files == sorted(files)
    assert all(f.endswith(".py") for f in files)
    stdlib = expand(["{stdlib}/os.py"], "spec.data.train")
    assert len(stdlib) == 1 and Path(stdlib[0]).name == "os.py"


def test_a_pattern_that_matches_nothing_names_the_field() -> None:
    with pytest.raises(ManifestError) as info:
        expand([str(ROOT / "no-such-folder" / "*.txt")], "spec.data.eval")
    assert info.value.field == "spec.data.eval" and "matches no file" in str(info.value)


def test_memory_urls_jsonl_and_token_files() -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe("/alpajob-test/a.jsonl", b'{"text": "hello"}\n\n{"text": "world", "id": 2}\n')
    fs.pipe("/alpajob-test/t.bin", np.arange(10, dtype=np.uint16).tobytes())
    data = DataSpec(train="memory://alpajob-test/*.jsonl", format=DataFormat.JSONL)
    corpus = load_corpus(data, "train", ByteTokenizer())
    assert bytes(corpus.tokens.astype(np.uint8)) == b"hello\0world\0"
    tokens = load_corpus(DataSpec(train="memory://alpajob-test/t.bin", format=DataFormat.TOKENS,
                                  token_dtype=TokenDtype.UINT16), "train", ByteTokenizer())
    assert tokens.tokens.tolist() == list(range(10))
    fs.pipe("/alpajob-test/bad.jsonl", b'{"body": "x"}\n')
    with pytest.raises(ManifestError) as info:
        load_corpus(DataSpec(train="memory://alpajob-test/bad.jsonl", format=DataFormat.JSONL),
                    "train", ByteTokenizer())
    assert info.value.field == "spec.data.field"


def test_array_record_files_hold_one_document_per_record(tmp_path: Path) -> None:
    from array_record.python import array_record_module

    writer = array_record_module.ArrayRecordWriter(str(tmp_path / "docs.array_record"), "group_size:1")
    for text in (b"stage", b"plan"):
        writer.write(text)
    writer.close()
    data = DataSpec(train=str(tmp_path / "*.array_record"), format=DataFormat.ARRAYRECORD)
    corpus = load_corpus(data, "train", ByteTokenizer())
    assert bytes(corpus.tokens.astype(np.uint8)) == b"stage\0plan\0"


def test_a_tokenizer_json_and_the_vocabulary_check(tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(["the", "plan", "stage"])}}
    made = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    made.pre_tokenizer = Whitespace()
    path = tmp_path / "tokenizer.json"
    made.save(str(path))
    tokenizer = load_tokenizer(str(path))
    assert (tokenizer.vocab_size, tokenizer.end_of_text) == (5, 0)
    assert tokenizer.encode_all(["the plan", "stage x"])[1].tolist() == [4, 1]
    check_vocabulary(tokenizer, 5)
    with pytest.raises(ManifestError, match="at least 5") as info:
        check_vocabulary(tokenizer, 4)
    assert info.value.field == "spec.data.tokenizer"
    with pytest.raises(ManifestError) as info:
        load_tokenizer(str(tmp_path / "missing.json"))
    assert info.value.field == "spec.data.tokenizer"


def test_ids_beyond_the_model_vocabulary_are_refused() -> None:
    with pytest.raises(ManifestError, match="at least 300"):
        check_ids(corpus_of(np.array([1, 299, 3])), 256)


# ----------------------------------------------------------------------------- loader
def test_windows_cover_every_token_once_as_a_target() -> None:
    corpus = corpus_of(np.arange(101))
    assert windows(corpus, 10) == 10
    batches = eval_batches(corpus, 10, 5)
    rows = [next(batches) for _ in range(2)]
    ids = np.concatenate([b["input_ids"] for b in rows])
    labels = np.concatenate([b["labels"] for b in rows])
    assert ids.shape == (10, 10) and (labels == ids + 1).all()
    assert sorted(labels.ravel().tolist()) == list(range(1, 101))


def test_the_loader_is_deterministic_by_seed() -> None:
    corpus = corpus_of(np.arange(2000))
    first, again, other = (train_batches(corpus, 16, 8, seed) for seed in (3, 3, 4))
    a = [next(first)["input_ids"] for _ in range(6)]
    b = [next(again)["input_ids"] for _ in range(6)]
    c = [next(other)["input_ids"] for _ in range(6)]
    assert all((x == y).all() for x, y in zip(a, b, strict=True))
    assert not all((x == y).all() for x, y in zip(a, c, strict=True))
    for reader in (first, again, other):
        reader.close()


def test_ranks_read_disjoint_shards_that_make_up_the_global_batch() -> None:
    corpus = corpus_of(np.arange(4000))
    whole = train_batches(corpus, 16, 8, seed=1)
    shards = [train_batches(corpus, 16, 8, seed=1, shard=Shard(k, 4)) for k in range(4)]
    starts = [set((next(s)["input_ids"][:, 0] // 16).tolist()) for s in shards]
    assert all(len(rows) == 2 for rows in starts)  # 8 rows over 4 ranks
    assert not any(a & b for a, b in itertools.combinations(starts, 2))
    full = set((next(whole)["input_ids"][:, 0] // 16).tolist())
    assert len(full) == 8
    for reader in (whole, *shards):
        reader.close()


def test_a_resumed_loader_continues_with_the_next_unseen_batch() -> None:
    corpus = corpus_of(np.arange(3000))
    uninterrupted = train_batches(corpus, 16, 8, seed=7)
    expected = [next(uninterrupted)["input_ids"] for _ in range(9)]
    killed = train_batches(corpus, 16, 8, seed=7)
    for _ in range(4):
        next(killed)
    state = json.loads(json.dumps(killed.state()))  # as a checkpoint stores it
    killed.close()  # the process dies; a new one starts from the checkpoint
    resumed = train_batches(corpus, 16, 8, seed=7)
    resumed.restore(state)
    for k in range(4, 9):
        assert (next(resumed)["input_ids"] == expected[k]).all(), k
    for reader in (uninterrupted, resumed):
        reader.close()


def test_epochs_reshuffle_and_never_run_dry() -> None:
    corpus = corpus_of(np.arange(16 * 8 + 1))  # exactly one global batch per epoch
    reader = train_batches(corpus, 16, 8, seed=0)
    epochs = [sorted(next(reader)["input_ids"][:, 0].tolist()) for _ in range(3)]
    assert epochs[0] == epochs[1] == epochs[2] == list(range(0, 128, 16))
    reader.close()


def test_too_little_data_for_one_batch_names_the_split() -> None:
    with pytest.raises(ManifestError, match="fewer than one global batch") as info:
        train_batches(corpus_of(np.arange(50)), 16, 8, seed=0)
    assert info.value.field == "spec.data.train"


# ----------------------------------------------------------------------------- feed
def test_a_feed_of_real_text_gives_the_models_batches() -> None:
    model = resolve_model("gpt", "tiny")
    feed = open_feed(job({"train": TEXT, "eval": str(ROOT / "operator" / "*.py")}, evalEvery=2), model)
    try:
        leaves = feed.batch(0)
        assert [x.shape for x in leaves] == [(8, 32), (8, 32)]  # input_ids, labels (sorted)
        assert "tokens (bytes)" in feed.source and feed.state() == {"next_index": 1}
        assert len(feed.eval_batches(2)) == 2
    finally:
        feed.close()


def test_without_data_the_feed_is_synthetic_and_says_so() -> None:
    feed = open_feed(job(None), resolve_model("gpt", "tiny"))
    assert feed.source == SYNTHETIC and feed.state() is None
    assert [x.shape for x in feed.batch(0)] == [(8, 32), (8, 32)]


def test_token_data_needs_a_language_model() -> None:
    with pytest.raises(ManifestError) as info:
        token_shape(resolve_model("mlp", "tiny"), 8)
    assert info.value.field == "spec.data" and "input_ids" in str(info.value)


def test_eval_every_needs_eval_data() -> None:
    with pytest.raises(ManifestError) as info:
        job({"train": TEXT}, evalEvery=5)
    assert info.value.field == "spec.training.evalEvery"


def test_prepared_token_files_hold_the_same_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from alpajob.cli.main import main

    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump({
        "apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "prep"},
        "spec": {"model": {"zoo": "gpt", "config": "tiny"}, "cluster": {"gpu": "cpu"},
                 "data": {"train": TEXT, "eval": str(ROOT / "operator" / "*.py")}}}))
    assert main(["data", "prepare", str(manifest), "--output", str(tmp_path / "tokens")]) == 0
    printed = yaml.safe_load(capsys.readouterr().out.split("read them with:", 1)[1])
    prepared = DataSpec.model_validate(printed["spec"]["data"])
    assert prepared.format is DataFormat.TOKENS
    for split in ("train", "eval"):
        direct = load_corpus(job({"train": TEXT, "eval": str(ROOT / "operator" / "*.py")}).spec.data,
                             split, ByteTokenizer())
        again = load_corpus(prepared, split, ByteTokenizer())
        np.testing.assert_array_equal(again.tokens, direct.tokens)
    assert main(["data", "prepare", str(manifest), "--output", str(manifest)]) == 2


def test_eval_data_without_eval_every_is_evaluated_after_the_last_step() -> None:
    """spec.data.eval alone is not ignored: the run evaluates once, after its last step."""
    from alpajob.api.options import TrainOptions
    from alpajob.trainer_image.local_run import run

    result = run(job({"train": TEXT, "eval": str(ROOT / "operator" / "*.py")}, evalSteps=1),
                 TrainOptions(steps=3, serial=True))
    assert [step for step, _ in result.evals] == [3] and np.isfinite(result.evals[0][1])
