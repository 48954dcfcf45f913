"""Token shards in the other stores: over http(s) from a real HTTP server on 127.0.0.1
(aiohttp's static files, which honour Range requests and list no folders; Python's own
http.server, which ignores ranges and is refused in one line), and in a Google Cloud
Storage bucket of gcp-storage-emulator's JSON API, through gcsfs."""

from __future__ import annotations

import asyncio
import http.server
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from alpajob.api.data import DataSpec, TokenDtype
from alpajob.api.errors import ManifestError
from alpajob.api.options import PrepareOptions
from alpajob.trainer_image.data.corpus import TokenCorpus, open_train
from alpajob.trainer_image.data.prepare import prepare
from alpajob.trainer_image.data.remote import BlockCache
from alpajob.trainer_image.data.shards import Opener
from alpajob.trainer_image.data.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parent.parent


def corpus_at(url: str, cache: BlockCache) -> TokenCorpus:
    [corpus] = open_train(DataSpec(train=url, format="tokens"), ByteTokenizer(),
                          Opener("spec.data.train", TokenDtype.UINT16, cache))
    return corpus


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The planner's sources prepared into shards, served by aiohttp on a free port."""
    from aiohttp import web

    root = tmp_path_factory.mktemp("site")
    prepare(DataSpec(train=str(ROOT / "planner" / "**" / "*.py")),
            PrepareOptions(output=str(root / "prepared"), shard_size=80_000, workers=1))
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_static("/", root)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", root / "prepared"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)


def test_a_prepared_folder_reads_over_http_by_ranges(served: tuple[str, Path], tmp_path: Path) -> None:
    url, local = served
    remote = corpus_at(f"{url}/prepared/train/index.json", BlockCache(tmp_path / "cache", "0"))
    here = corpus_at(str(local / "train"), BlockCache(tmp_path / "unused", "0"))
    assert remote.tokens == here.tokens and len(remote.shards) == len(here.shards) > 1
    for start in np.random.default_rng(0).integers(0, remote.tokens - 300, 20):
        got, nbytes = remote.read(int(start), int(start) + 257)
        np.testing.assert_array_equal(got, here.read(int(start), int(start) + 257)[0])
        assert nbytes == 2 * 257
    fetched = sum(s.reader.fetched for s in remote.shards)
    assert fetched == 20 * 2 * 257  # no cache: exactly the windows' bytes came over the wire
    [single] = corpus_at(f"{url}/prepared/train/shard-00000.bin", BlockCache(tmp_path / "c2", "0")).shards
    assert single.remote and single.tokens == 40_000


@pytest.mark.parametrize(("address", "said"), [
    ("{url}/prepared/train/missing.bin", "is not there (the server answered 404 Not Found)"),
    ("https://{host}/prepared/train/shard-00000.bin", "SSL"),  # an http server asked for https
    ("http://127.0.0.1:1/corpus.bin", "Cannot connect to host 127.0.0.1:1"),
])
def test_a_url_that_gives_nothing_says_why_in_one_line(served: tuple[str, Path], tmp_path: Path,
                                                        address: str, said: str) -> None:
    """Not a bucket: the URL kept whole in the message, with the server's own answer."""
    url, _ = served
    address = address.format(url=url, host=url.split("://", 1)[1])
    with pytest.raises(ManifestError) as info:
        corpus_at(address, BlockCache(tmp_path / "cache", "0"))
    message = str(info.value)
    assert info.value.field == "spec.data.train" and said in message and "\n" not in message
    assert address in message and "bucket" not in message


def test_a_server_that_ignores_ranges_is_refused_in_one_line(served: tuple[str, Path], tmp_path: Path) -> None:
    _, local = served
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(local))
    handler.log_message = lambda *args: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        corpus = corpus_at(f"http://127.0.0.1:{server.server_port}/train/shard-00000.bin",
                           BlockCache(tmp_path / "cache", "0"))
        with pytest.raises(ManifestError, match="honours Range requests") as info:
            corpus.read(100, 200)
        assert info.value.field == "spec.data" and "\n" not in str(info.value)
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def gcs(served: tuple[str, Path]) -> Iterator[str]:
    """A GCS emulator on a free port holding bucket ``corpus``, with the prepared shards."""
    import os
    import sys

    from gcp_storage_emulator.server import create_server

    from alpajob.trainer_image.distributed.loopback import free_port

    if "gcsfs" in sys.modules:
        pytest.skip("gcsfs was imported before the emulator's settings could be made")
    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket="corpus")
    server.start()
    saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")}
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    # gcsfs asks real GCS over gRPC what kind of bucket it is; an emulator has no gRPC.
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    import gcsfs

    fs = gcsfs.GCSFileSystem(token="anon", project="test")
    for path in (served[1] / "train").iterdir():
        fs.pipe(f"corpus/prepared/{path.name}", path.read_bytes())
    try:
        yield "gs://corpus/prepared"
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_a_gcs_bucket_reads_as_the_folder_it_was_copied_from(gcs: str, served: tuple[str, Path],
                                                             tmp_path: Path) -> None:
    remote = corpus_at(gcs, BlockCache(tmp_path / "cache", "64Mi"))
    here = corpus_at(str(served[1] / "train"), BlockCache(tmp_path / "unused", "0"))
    assert remote.tokens == here.tokens and all(s.remote for s in remote.shards)
    for start in np.random.default_rng(1).integers(0, remote.tokens - 300, 10):
        np.testing.assert_array_equal(remote.read(int(start), int(start) + 129)[0],
                                      here.read(int(start), int(start) + 129)[0])
    with pytest.raises(ManifestError, match="the bucket 'no-such-bucket' does not exist") as info:
        corpus_at("gs://no-such-bucket/x/*.bin", BlockCache(tmp_path / "c", "0"))
    assert info.value.field == "spec.data.train"
