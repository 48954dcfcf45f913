"""The data pipeline: sources, tokenizers, token shards, the sample order and the loader,
on real text (this repository's own sources), real files and fsspec's memory
filesystem (a remote store: ranged reads, the block cache, retries)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import fsspec
import grain
import numpy as np
import pytest

from alpajob.api.data import DataFormat, DataSpec, IndexShard, TokenDtype, TokenIndex
from alpajob.api.errors import ManifestError, TransientError
from alpajob.api.resource import parse_job
from alpajob.trainer_image.data.corpus import TokenCorpus, check_known_ids, open_source, open_train
from alpajob.trainer_image.data.feed import SYNTHETIC, batch_sources, open_feed, token_shape
from alpajob.trainer_image.data.loader import Batches, Need, eval_reader, train_reader
from alpajob.trainer_image.data.remote import (
    BLOCK_BYTES,
    BlockCache,
    DataReadError,
    Retry,
    with_retries,
)
from alpajob.trainer_image.data.shards import FileHandles, Opener, in_memory, open_token_files
from alpajob.trainer_image.data.sources import expand
from alpajob.trainer_image.data.tokenizer import ByteTokenizer, check_vocabulary, load_tokenizer
from alpajob.trainer_image.zoo import resolve_model

ROOT = Path(__file__).resolve().parent.parent
#: Real text that is always here: this repository's own planner sources.
TEXT = str(ROOT / "planner" / "**" / "*.py")


def corpus_of(tokens: np.ndarray, name: str = "train") -> TokenCorpus:
    return TokenCorpus.of(name, "spec.data.train", [in_memory(np.asarray(tokens, np.uint16), "memory")])


def opener(tmp_path: Path | None = None, cache: str = "0", dtype: TokenDtype = TokenDtype.UINT16) -> Opener:
    return Opener("spec.data.train", dtype, BlockCache(tmp_path or "/nonexistent", cache))


def job(data: dict | None, **training: object) -> object:
    spec: dict = {"model": {"zoo": "gpt", "config": "tiny"},
                  "training": {"globalBatchSize": 8, **training}, "cluster": {"gpu": "cpu"}}
    if data is not None:
        spec["data"] = data
    return parse_job({"apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob",
                      "metadata": {"name": "data"}, "spec": spec})


def ids(batch: dict[str, np.ndarray]) -> np.ndarray:
    return batch["input_ids"]


# ----------------------------------------------------------------------------- sources
def test_globs_expand_to_sorted_files_and_stdlib_is_found() -> None:
    files = [f.url for f in expand([TEXT], "spec.data.train")]
    assert len(files) > 20 and files == sorted(files)
    assert all(f.endswith(".py") for f in files)
    stdlib = expand(["{stdlib}/os.py"], "spec.data.train")
    assert len(stdlib) == 1 and Path(stdlib[0].url).name == "os.py" and stdlib[0].size > 1000


def test_a_pattern_that_matches_nothing_names_the_field() -> None:
    with pytest.raises(ManifestError) as info:
        expand([str(ROOT / "no-such-folder" / "*.txt")], "spec.data.eval")
    assert info.value.field == "spec.data.eval" and "matches no file" in str(info.value)


def test_memory_urls_jsonl_and_token_files() -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe("/alpajob-test/a.jsonl", b'{"text": "hello"}\n\n{"text": "world", "id": 2}\n')
    fs.pipe("/alpajob-test/t.bin", np.arange(10, dtype=np.uint16).tobytes())
    data = DataSpec(train="memory://alpajob-test/*.jsonl", format=DataFormat.JSONL)
    corpus = open_source(data, "train", "spec.data.train", data.train_paths(), ByteTokenizer(), opener())
    assert bytes(corpus.read(0, corpus.tokens)[0].astype(np.uint8)) == b"hello\0world\0"
    tokens = DataSpec(train="memory://alpajob-test/t.bin", format=DataFormat.TOKENS)
    [read] = open_train(tokens, ByteTokenizer(), opener())
    assert read.read(0, read.tokens)[0].tolist() == list(range(10))
    fs.pipe("/alpajob-test/bad.jsonl", b'{"body": "x"}\n')
    with pytest.raises(ManifestError) as info:
        bad = DataSpec(train="memory://alpajob-test/bad.jsonl", format=DataFormat.JSONL)
        open_train(bad, ByteTokenizer(), opener())
    assert info.value.field == "spec.data.field"


def test_array_record_files_hold_one_document_per_record(tmp_path: Path) -> None:
    from array_record.python import array_record_module

    writer = array_record_module.ArrayRecordWriter(str(tmp_path / "docs.array_record"), "group_size:1")
    for text in (b"stage", b"plan"):
        writer.write(text)
    writer.close()
    data = DataSpec(train=str(tmp_path / "*.array_record"), format=DataFormat.ARRAYRECORD)
    [corpus] = open_train(data, ByteTokenizer(), opener())
    assert bytes(corpus.read(0, corpus.tokens)[0].astype(np.uint8)) == b"stage\0plan\0"


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


def test_ids_beyond_the_model_vocabulary_are_refused_before_training_when_known() -> None:
    corpus = corpus_of(np.array([1, 299, 3]))
    corpus.shards[0].max_id = 299
    with pytest.raises(ManifestError, match="at least 300"):
        check_known_ids(corpus, 256)


# ----------------------------------------------------------------------------- token shards
def write_shards(folder: Path, pieces: list[np.ndarray], npy: tuple[int, ...] = ()) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, piece in enumerate(pieces):
        if k in npy:
            path = folder / f"part-{k:03d}.npy"
            np.save(path, piece)
        else:
            path = folder / f"part-{k:03d}.bin"
            path.write_bytes(piece.tobytes())
        paths.append(path)
    return paths


def test_many_shards_are_one_stream_read_in_place_across_their_boundaries(tmp_path: Path) -> None:
    whole = np.random.default_rng(0).integers(0, 60000, 10_000).astype(np.uint16)
    pieces = np.split(whole, [1234, 1235, 5000, 9999])  # one shard of a single id
    write_shards(tmp_path / "corpus", pieces, npy=(2,))
    shards = open_token_files([str(tmp_path / "corpus")], opener())  # a folder: its .bin and .npy files
    corpus = TokenCorpus.of("train", "spec.data.train", shards)
    assert [s.tokens for s in shards] == [len(p) for p in pieces] and corpus.tokens == 10_000
    for start, stop in [(0, 10_000), (1230, 1240), (1234, 1236), (4990, 5010), (9998, 10_000), (7, 7)]:
        got, nbytes = corpus.read(start, stop)
        assert got.dtype == np.uint16 and nbytes == 2 * (stop - start)  # read as stored, nothing more
        np.testing.assert_array_equal(got, whole[start:stop])
    assert open_token_files([str(tmp_path / "corpus" / "part-00[0-1].bin")], opener())[1].tokens == 1


def test_a_corpus_of_many_shards_keeps_few_files_open(tmp_path: Path) -> None:
    import os

    whole = np.arange(3000, dtype=np.uint16)
    write_shards(tmp_path / "many", list(np.split(whole, 300)))  # 300 shards of 10 ids
    handles = FileHandles(limit=16)
    shards = open_token_files([str(tmp_path / "many")], replace(opener(), handles=handles))
    corpus = TokenCorpus.of("train", "spec.data.train", shards)
    before = len(os.listdir("/proc/self/fd"))
    for start in np.random.default_rng(2).integers(0, 2990, 500):
        np.testing.assert_array_equal(corpus.read(int(start), int(start) + 10)[0], whole[start:start + 10])
    assert len(os.listdir("/proc/self/fd")) - before <= 16
    handles.close()
    assert len(os.listdir("/proc/self/fd")) <= before


def test_an_index_orders_its_shards_and_must_agree_with_them(tmp_path: Path) -> None:
    folder = tmp_path / "prepared"
    a, b = np.arange(100, dtype=np.uint32), np.arange(100, 130, dtype=np.uint32)
    write_shards(folder, [a, b])
    index = TokenIndex(dtype=TokenDtype.UINT32, shards=[IndexShard(path="part-001.bin", tokens=30, max_id=129),
                                                        IndexShard(path="part-000.bin", tokens=100, max_id=99)])
    (folder / "index.json").write_text(index.model_dump_json(by_alias=True))
    corpus = TokenCorpus.of("train", "spec.data.train", open_token_files([str(folder)], opener()))
    np.testing.assert_array_equal(corpus.read(0, 130)[0], np.concatenate([b, a]))  # the index's order
    assert corpus.max_id == 129 and corpus.dtype == np.uint32  # the index's dtype, not tokenDtype's
    for shards, needle in [([IndexShard(path="part-000.bin", tokens=99)], "disagree"),
                           ([IndexShard(path="part-007.bin", tokens=1)], "incomplete")]:
        (folder / "index.json").write_text(TokenIndex(dtype=TokenDtype.UINT32, shards=shards)
                                           .model_dump_json(by_alias=True))
        with pytest.raises(ManifestError, match=needle) as info:
            open_token_files([str(folder / "index.json")], opener())
        assert info.value.field == "spec.data.train"
    (folder / "index.json").write_text('{"version": 1, "shards": []}')
    with pytest.raises(ManifestError, match="dtype"):
        open_token_files([str(folder)], opener())


def test_token_files_that_cannot_be_ids_are_refused_naming_the_field(tmp_path: Path) -> None:
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ManifestError, match="not a whole number of uint16") as info:
        open_token_files([str(tmp_path / "odd.bin")], opener())
    assert info.value.field == "spec.data.tokenDtype"
    np.save(tmp_path / "matrix.npy", np.zeros((2, 3), np.int32))
    with pytest.raises(ManifestError, match="1-D array of token ids"):
        open_token_files([str(tmp_path / "matrix.npy")], opener())
    np.save(tmp_path / "cut.npy", np.arange(100, dtype=np.int32))
    (tmp_path / "cut.npy").write_bytes((tmp_path / "cut.npy").read_bytes()[:-8])
    with pytest.raises(ManifestError, match="cut short"):
        open_token_files([str(tmp_path / "cut.npy")], opener())


def test_an_id_beyond_the_vocabulary_is_refused_where_a_window_reads_it(tmp_path: Path) -> None:
    tokens = np.full(4000, 7, np.uint16)
    tokens[2500] = 300
    (tmp_path / "big.bin").write_bytes(tokens.tobytes())
    [corpus] = open_train(DataSpec(train=str(tmp_path / "big.bin"), format=DataFormat.TOKENS),
                          ByteTokenizer(), opener())
    reader = eval_reader(corpus, 16, 8, vocab=256)  # in order: batch k is windows 8k .. 8k + 7
    reader.read(0)
    with pytest.raises(ManifestError, match="token id 300") as info:
        reader.read(19)  # windows 152..159 cover tokens 2432..2560
    assert info.value.field == "spec.data.train" and "big.bin" in str(info.value)


# ----------------------------------------------------------------------------- loader
def test_windows_cover_every_token_once_as_a_target() -> None:
    corpus = corpus_of(np.arange(101))
    reader = eval_reader(corpus, 10, 5)
    rows = [reader.read(k) for k in range(2)]
    inputs = np.concatenate([b["input_ids"] for b in rows])
    labels = np.concatenate([b["labels"] for b in rows])
    assert inputs.shape == (10, 10) and (labels == inputs + 1).all()
    assert sorted(labels.ravel().tolist()) == list(range(1, 101))


def test_the_loader_is_deterministic_by_seed_and_its_order_is_grains_shuffle() -> None:
    corpus = corpus_of(np.arange(2000))
    first, again, other = (train_reader([corpus], [1.0], 16, 8, seed) for seed in (3, 3, 4))
    a, b, c = ([ids(r.read(k)) for k in range(30)] for r in (first, again, other))
    assert all((x == y).all() for x, y in zip(a, b, strict=True))
    assert not all((x == y).all() for x, y in zip(a, c, strict=True))
    # One source's order is Grain's own range(W).shuffle(seed), reshuffled each epoch.
    order = grain.MapDataset.range(124).shuffle(seed=3).repeat(None)
    windows = np.concatenate([row[:, 0] // 16 for row in a])
    assert windows.tolist() == [order[g] for g in range(240)]


def test_a_reader_reads_only_the_rows_and_leaves_it_needs() -> None:
    corpus = corpus_of(np.arange(4000))
    reader = train_reader([corpus], [1.0], 16, 8, seed=1)
    whole = reader.read(5)
    halves = [Need(rows=(0, 1, 2, 3)), Need(rows=(4, 5, 6, 7))]
    before = reader.books.bytes
    parts = [reader.read(5, need) for need in halves]
    assert reader.books.bytes - before == 8 * 17 * 2  # every row once, 17 uint16 ids each
    for part, need in zip(parts, halves, strict=True):
        rows = list(need.rows or ())
        np.testing.assert_array_equal(part["input_ids"][rows], whole["input_ids"][rows])
        np.testing.assert_array_equal(part["labels"][rows], whole["labels"][rows])
        others = sorted(set(range(8)) - set(rows))
        assert not part["input_ids"][others].any()  # never read
    before = reader.books.bytes
    first_stage = reader.read(5, Need(frozenset({"input_ids"})))
    last_stage = reader.read(5, Need(frozenset({"labels"})))
    middle = reader.read(5, Need(frozenset(), ()))
    assert reader.books.bytes - before == 2 * 8 * 16 * 2  # 16 ids a row for one leaf, none for no leaf
    np.testing.assert_array_equal(first_stage["input_ids"], whole["input_ids"])
    np.testing.assert_array_equal(last_stage["labels"], whole["labels"])
    assert not first_stage["labels"].any() and not last_stage["input_ids"].any()
    assert not middle["input_ids"].any() and not middle["labels"].any()


def test_a_resumed_loader_continues_with_the_next_unseen_batch() -> None:
    corpus = corpus_of(np.arange(3000))
    uninterrupted = Batches.open(train_reader([corpus], [1.0], 16, 8, seed=7))
    expected = [ids(next(uninterrupted)) for _ in range(9)]
    killed = Batches.open(train_reader([corpus], [1.0], 16, 8, seed=7))
    for _ in range(4):
        next(killed)
    state = json.loads(json.dumps(killed.state()))  # as a checkpoint stores it
    killed.close()  # the process dies; a new one starts from the checkpoint
    resumed = Batches.open(train_reader([corpus], [1.0], 16, 8, seed=7))
    resumed.restore(state)
    for k in range(4, 9):
        assert (ids(next(resumed)) == expected[k]).all(), k
        assert (ids(resumed.at(k)) == expected[k]).all(), k  # and any batch directly
    for reader in (uninterrupted, resumed):
        reader.close()


def test_epochs_reshuffle_and_never_run_dry() -> None:
    corpus = corpus_of(np.arange(16 * 8 + 1))  # exactly one global batch per epoch
    reader = train_reader([corpus], [1.0], 16, 8, seed=0)
    epochs = [ids(reader.read(k))[:, 0].tolist() for k in range(3)]
    assert all(sorted(e) == list(range(0, 128, 16)) for e in epochs) and epochs[0] != epochs[1]


def test_too_little_data_for_one_batch_names_the_split() -> None:
    with pytest.raises(ManifestError, match="fewer than one global batch") as info:
        train_reader([corpus_of(np.arange(50))], [1.0], 16, 8, seed=0)
    assert info.value.field == "spec.data.train"


# ----------------------------------------------------------------------------- mixtures
def test_a_mixture_holds_its_weights_in_every_batch_and_exactly_in_the_long_run() -> None:
    sources = [corpus_of(np.arange(0, 5000), "web"), corpus_of(np.arange(10000, 12000), "code"),
               corpus_of(np.arange(20000, 20400), "off"), corpus_of(np.arange(30000, 31000), "math")]
    weights = [0.55, 0.3, 0.0, 0.15]
    reader = train_reader(sources, weights, 16, 40, seed=5)
    totals = np.zeros(4)
    seen: list[set[int]] = [set() for _ in sources]
    for k in range(60):
        batch = ids(reader.read(k))
        which = batch[:, 0] // 10000
        counts = np.bincount(which, minlength=4)
        # Within two rows of its share in every batch (one per split level), none from weight 0.
        assert np.abs(counts - 40 * np.array(weights)).max() < 2 and counts[2] == 0, (k, counts)
        assert reader.order.counts(k, 40) == counts.tolist()
        totals += counts
        for row in batch[:, 0]:
            seen[row // 10000].add(int(row))
    np.testing.assert_allclose(totals / totals.sum(), weights, atol=1.5 / 2400)
    code_windows = (2000 - 1) // 16  # 124: "code" gave 720 rows, so every window at least 5 times
    assert len(seen[1]) == code_windows
    assert reader.books.rows == totals.astype(int).tolist()


def test_mixture_weights_are_exact_not_rounded_to_a_hundredth() -> None:
    from alpajob.trainer_image.data.order import proportions, select

    assert proportions([0.7, 0.3]) == [7, 3] and proportions([1, 1e-4]) == [10000, 1]
    assert proportions([2.5, 0.0, 5]) == [1, 0, 2]
    parts = [1003, 997]  # Grain's mix would make these 100 : 99
    picks = [select(g, parts) for g in range(20000)]
    firsts = sum(1 for source, _ in picks if source == 0)
    assert firsts == 10030
    for source in (0, 1):  # each source's rows are 0, 1, 2, ... in order: nothing skipped or twice
        rows = [row for s, row in picks if s == source]
        assert rows == list(range(len(rows)))


def test_bad_mixtures_are_refused_naming_the_field() -> None:
    cases = [
        ([{"path": "a/*.bin", "weight": -1}], "greater than or equal to 0"),
        ([{"path": "a/*.bin", "weight": 0}, {"path": "b/*.bin", "weight": 0}], "sum to 0"),
        (["a/*.bin", {"path": "b/*.bin", "weight": 1}], "objects only"),
        ([{"path": "a/*.bin", "weight": 1, "name": "x"}, {"path": "b/*.bin", "weight": 1, "name": "x"}], "named"),
        ([{"path": "a/*.bin", "weight": float("inf")}], "finite"),
    ]
    for train, needle in cases:
        with pytest.raises(ManifestError, match=needle) as info:
            job({"train": train, "format": "tokens"})
        assert info.value.field.startswith("spec.data"), (train, info.value.field)


def test_bad_cache_and_source_fields_are_refused_naming_the_field() -> None:
    cases = [
        ({"cache": {"size": "-4Gi"}}, "spec.data.cache.size", "negative"),
        ({"cache": {"size": -1}}, "spec.data.cache.size", "negative"),
        ({"cache": {"size": "lots"}}, "spec.data.cache.size", "not a Kubernetes quantity"),
        ({"cache": {"path": ""}}, "spec.data.cache.path", "at least 1"),
        ({"train": [{"path": "a/*.bin", "weight": 1, "name": "no spaces"}]}, "spec.data.train", "pattern"),
        ({"train": [{"path": [], "weight": 1}]}, "spec.data.train", "non-empty list"),
    ]
    for extra, field, needle in cases:
        with pytest.raises(ManifestError, match=needle) as info:
            job({"train": "a/*.bin", "format": "tokens", **extra})
        assert info.value.field.startswith(field), (extra, info.value.field)


def test_prepare_options_refuse_bad_values_naming_the_flag() -> None:
    from alpajob.api.options import PrepareOptions, from_flags

    for flags, flag in [({"output": "x", "workers": 0}, "--workers"), ({"output": "x", "shard_size": 10}, "--shard-size"),
                        ({"output": ""}, "--output")]:
        with pytest.raises(ManifestError) as info:
            from_flags(PrepareOptions, flags)
        assert info.value.field == flag


def test_a_mixture_feed_reports_its_sources(tmp_path: Path) -> None:
    for name, base in (("web", 1), ("code", 2)):
        (tmp_path / f"{name}.bin").write_bytes(np.full(3000, base, np.uint16).tobytes())
    data = {"train": [{"path": str(tmp_path / "web.bin"), "weight": 3, "name": "web"},
                      {"path": str(tmp_path / "code.bin"), "weight": 1, "name": "code"}], "format": "tokens"}
    spec = job(data)
    feed = open_feed(spec, resolve_model("gpt", "tiny"))
    try:
        assert feed.source.startswith("mixture of 2 sources (bytes): web 75%") and "code 25%" in feed.source
        batch = feed.batch(0)[0]
        assert feed.source_rows(0) == batch_sources(spec.spec.data, 0, 8) == {
            "web": int((batch[:, 0] == 1).sum()), "code": int((batch[:, 0] == 2).sum())}
        assert sum(feed.source_rows(0).values()) == 8
    finally:
        feed.close()


# ----------------------------------------------------------------------------- remote reads
def test_a_remote_corpus_is_read_by_ranges_through_a_bounded_cache(tmp_path: Path) -> None:
    tokens = np.random.default_rng(1).integers(0, 256, 3 * BLOCK_BYTES).astype(np.uint16)  # 6 blocks
    fsspec.filesystem("memory").pipe("/alpajob-remote/c.bin", tokens.tobytes())
    cache = BlockCache(tmp_path / "cache", str(4 * BLOCK_BYTES))
    [shard] = open_token_files(["memory://alpajob-remote/c.bin"], Opener("spec.data.train", TokenDtype.UINT16, cache))
    assert shard.remote
    corpus = TokenCorpus.of("train", "spec.data.train", [shard])
    np.testing.assert_array_equal(corpus.read(100, 40000)[0], tokens[100:40000])  # spans two blocks
    fetched = shard.reader.fetched
    assert fetched == 2 * BLOCK_BYTES and cache.misses == 2
    np.testing.assert_array_equal(corpus.read(200, 300)[0], tokens[200:300])
    assert shard.reader.fetched == fetched and cache.hits == 1  # from the cache
    corpus.read(0, len(tokens))  # all six blocks: the oldest are dropped
    assert cache.total <= 4 * BLOCK_BYTES and len(list((tmp_path / "cache").glob("*/*.blk"))) == 4


def test_failed_and_short_reads_are_tried_again_and_then_fail_as_transient() -> None:
    answers: list[object] = [ConnectionResetError("reset by peer"), b"abc", TimeoutError(), b"abcdef"]

    def fetch() -> bytes:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        assert isinstance(answer, bytes)
        return answer

    waits: list[float] = []
    assert with_retries(fetch, 6, "x", Retry(attempts=5), sleep=waits.append) == b"abcdef"
    assert waits == [0.25, 0.5, 1.0]  # a cut-short answer is never used
    with pytest.raises(DataReadError, match="after 3 tries .*3 of 6 bytes") as info:
        with_retries(lambda: b"abc", 6, "s3://b/x.bin", Retry(attempts=3), sleep=waits.append)
    assert isinstance(info.value, TransientError) and info.value.exit_code == 3
    with pytest.raises(FileNotFoundError):  # a missing object is not retried
        with_retries(lambda: (_ for _ in ()).throw(FileNotFoundError("gone")), 6, "x", Retry(), sleep=waits.append)


# ----------------------------------------------------------------------------- feed
def test_a_feed_of_real_text_gives_the_models_batches() -> None:
    model = resolve_model("gpt", "tiny")
    feed = open_feed(job({"train": TEXT, "eval": str(ROOT / "operator" / "*.py")}, evalEvery=2), model,
                     prefetch=0)
    try:
        leaves = feed.batch(0)
        assert [x.shape for x in leaves] == [(8, 32), (8, 32)]  # input_ids, labels (sorted)
        assert "tokens (bytes)" in feed.source and feed.state() == {"next_index": 1}
        assert len(feed.eval_batches(2)) == 2
        np.testing.assert_array_equal(feed.batch_at(0)[0], leaves[0])
        assert feed.read_bytes == 2 * 8 * 33 * 2 + 2 * 8 * 33 * 2  # two train reads, two eval batches
    finally:
        feed.close()


def test_without_data_the_feed_is_synthetic_and_says_so() -> None:
    feed = open_feed(job(None), resolve_model("gpt", "tiny"))
    assert feed.source == SYNTHETIC and feed.state() is None and feed.read_bytes == 0
    assert [x.shape for x in feed.batch(0)] == [(8, 32), (8, 32)]


def test_token_data_needs_a_language_model() -> None:
    with pytest.raises(ManifestError) as info:
        token_shape(resolve_model("mlp", "tiny"), 8)
    assert info.value.field == "spec.data" and "input_ids" in str(info.value)


def test_eval_every_needs_eval_data() -> None:
    with pytest.raises(ManifestError) as info:
        job({"train": TEXT}, evalEvery=5)
    assert info.value.field == "spec.training.evalEvery"


def test_eval_data_without_eval_every_is_evaluated_after_the_last_step() -> None:
    """spec.data.eval alone is not ignored: the run evaluates once, after its last step."""
    from alpajob.api.options import TrainOptions
    from alpajob.trainer_image.local_run import run

    result = run(job({"train": TEXT, "eval": str(ROOT / "operator" / "*.py")}, evalSteps=1),
                 TrainOptions(steps=3, serial=True))
    assert [step for step, _ in result.evals] == [3] and np.isfinite(result.evals[0][1])
    batch = 8 * 33 * 2  # uint16 ids of 8 windows
    # 3 steps and 1 eval batch, and at most the 2 the loader's thread had read ahead
    assert 4 * batch <= result.data_read_bytes <= 6 * batch and result.source_rows == {"train": 24}


def test_the_data_metrics_count_bytes_per_reader_and_rows_per_source() -> None:
    from alpajob.trainer_image.metrics import TrainingMetrics

    metrics = TrainingMetrics("job")
    metrics.data({("0", "0"): 100, ("1", "0"): 0}, {"web": 6, "code": 2})
    metrics.data({("0", "0"): 50, ("1", "0"): 0}, {"web": 5, "code": 3})
    value = metrics.registry.get_sample_value
    assert value("alpajob_data_read_bytes_total", {"job": "job", "mesh": "0", "host": "0"}) == 150
    assert value("alpajob_data_read_bytes_total", {"job": "job", "mesh": "1", "host": "0"}) == 0  # a middle stage
    assert value("alpajob_data_source_rows_total", {"job": "job", "source": "web"}) == 11
    assert value("alpajob_data_source_rows_total", {"job": "job", "source": "code"}) == 5
