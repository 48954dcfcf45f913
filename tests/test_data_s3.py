"""Training data in object storage, for real: a moto S3 server in its own process with
authentication on (tests/object_store.py), read through s3fs by ranged requests, the
block cache and retries; and a proxy in front of it that cuts connections mid-read."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from object_store import FlakyProxy, S3Server  # tests/object_store.py

from alpajob.api.data import DataSpec, TokenDtype
from alpajob.api.errors import ManifestError
from alpajob.api.options import PrepareOptions, TrainOptions
from alpajob.api.resource import parse_job
from alpajob.trainer_image.data.corpus import TokenCorpus, open_train
from alpajob.trainer_image.data.prepare import prepare
from alpajob.trainer_image.data.remote import BlockCache, Retry
from alpajob.trainer_image.data.shards import Opener
from alpajob.trainer_image.data.tokenizer import ByteTokenizer

s3fs = pytest.importorskip("s3fs")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[S3Server, Path]]:
    """The server, with bucket ``corpus`` holding the planner's sources prepared into
    shards (``prepared/``, as ``alpajob data prepare`` wrote them here, at ``local``)."""
    server = S3Server.start()
    local = tmp_path_factory.mktemp("prepared")
    prepare(DataSpec(train=str(ROOT / "planner" / "**" / "*.py")),
            PrepareOptions(output=str(local), shard_size=100_000, workers=1))
    client = server.client()
    client.create_bucket(Bucket="corpus")
    for path in (local / "train").iterdir():
        client.upload_file(str(path), "corpus", f"prepared/{path.name}")
    try:
        yield server, local / "train"
    finally:
        server.stop()


@pytest.fixture
def reach(store: tuple[S3Server, Path], monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Sets the process' environment as a pod's would be: ``reach(endpoint=, secret=)``."""
    server, _ = store

    def use(endpoint: str | None = None, secret: str | None = None) -> None:
        for key, value in server.env(endpoint, secret).items():
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()  # s3fs keeps a client per arguments, not per env

    yield use
    s3fs.S3FileSystem.clear_instance_cache()


def corpus_at(url: str, cache: BlockCache, retry: Retry | None = None) -> TokenCorpus:
    [corpus] = open_train(DataSpec(train=url, format="tokens"), ByteTokenizer(),
                          Opener("spec.data.train", TokenDtype.UINT16, cache, retry or Retry()))
    return corpus


def test_a_bucket_reads_as_the_folder_it_was_copied_from(store: tuple[S3Server, Path], reach: object,
                                                         tmp_path: Path) -> None:
    _, local = store
    reach()  # type: ignore[operator]
    remote = corpus_at("s3://corpus/prepared", BlockCache(tmp_path / "cache", "64Mi"))
    here = corpus_at(str(local), BlockCache(tmp_path / "unused", "0"))
    assert remote.tokens == here.tokens and remote.max_id == here.max_id  # from the index: no listing
    assert all(s.remote for s in remote.shards)
    rng = np.random.default_rng(0)
    for start in rng.integers(0, remote.tokens - 200, 40):
        np.testing.assert_array_equal(remote.read(int(start), int(start) + 129)[0],
                                      here.read(int(start), int(start) + 129)[0])


def test_a_server_that_drops_connections_mid_read_neither_fails_nor_corrupts(
        store: tuple[S3Server, Path], reach: object, tmp_path: Path) -> None:
    server, local = store
    proxy = FlakyProxy(server.port, low=2 * 1024, high=160 * 1024)
    try:
        reach(endpoint=proxy.url)  # type: ignore[operator]
        remote = corpus_at("s3://corpus/prepared", BlockCache(tmp_path / "cache", "0"),  # every read goes out
                           Retry(attempts=12, first_delay=0.01, max_delay=0.1))
        here = corpus_at(str(local), BlockCache(tmp_path / "unused", "0"))
        got, nbytes = remote.read(0, remote.tokens)
        np.testing.assert_array_equal(got, here.read(0, here.tokens)[0])
        assert nbytes == 2 * remote.tokens and proxy.drops > 3, proxy.drops  # it did drop, often
    finally:
        proxy.close()


def test_an_object_uploaded_again_is_never_read_from_the_old_ones_cached_blocks(
        store: tuple[S3Server, Path], reach: object, tmp_path: Path) -> None:
    server, _ = store
    reach()  # type: ignore[operator]
    client, cache = server.client(), BlockCache(tmp_path / "cache", "64Mi")
    first, second = np.arange(5000, dtype=np.uint16), np.arange(5000, dtype=np.uint16)[::-1].copy()
    client.put_object(Bucket="corpus", Key="again/ids.bin", Body=first.tobytes())
    np.testing.assert_array_equal(corpus_at("s3://corpus/again/ids.bin", cache).read(0, 5000)[0], first)
    client.put_object(Bucket="corpus", Key="again/ids.bin", Body=second.tobytes())  # same name, same size
    s3fs.S3FileSystem.clear_instance_cache()  # a new run lists the bucket afresh
    np.testing.assert_array_equal(corpus_at("s3://corpus/again/ids.bin", cache).read(0, 5000)[0], second)


@pytest.mark.slow
def test_a_job_trains_from_a_bucket_through_a_flaky_network_as_from_local_files(
        store: tuple[S3Server, Path], reach: object, tmp_path: Path) -> None:
    from alpajob.trainer_image.local_run import run

    server, local = store

    def job(train: str) -> object:
        return parse_job({"apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "s3"},
                          "spec": {"model": {"zoo": "gpt", "config": "tiny"}, "cluster": {"gpu": "cpu"},
                                   "training": {"globalBatchSize": 8, "learningRate": 3e-3},
                                   "data": {"train": train, "format": "tokens",
                                            "cache": {"size": "1Mi", "path": str(tmp_path / "cache")}}}})

    here = run(job(str(local)), TrainOptions(steps=4, serial=True))
    proxy = FlakyProxy(server.port, low=8 * 1024, high=200 * 1024, seed=3)
    try:
        reach(endpoint=proxy.url)  # type: ignore[operator]
        there = run(job("s3://corpus/prepared"), TrainOptions(steps=4, serial=True))
    finally:
        proxy.close()
    assert there.losses == here.losses and there.data == here.data
    assert list((tmp_path / "cache").glob("*/*.blk"))  # the cache kept what it fetched


def test_a_missing_bucket_and_refused_credentials_are_one_line_naming_the_field(
        store: tuple[S3Server, Path], reach: object, tmp_path: Path) -> None:
    reach()  # type: ignore[operator]
    cache = BlockCache(tmp_path / "cache", "0")
    with pytest.raises(ManifestError, match="the bucket 'no-such-bucket' does not exist") as info:
        corpus_at("s3://no-such-bucket/shards/*.bin", cache)
    assert info.value.field == "spec.data.train"
    reach(secret="not-the-secret")  # type: ignore[operator]
    with pytest.raises(ManifestError, match="refused the credentials") as info:
        corpus_at("s3://corpus/prepared", cache)
    assert info.value.field == "spec.data.train" and "\n" not in str(info.value)
