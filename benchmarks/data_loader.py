"""Benchmark: training data at pretraining scale, side by side with what users already have.

Three measurements, each printed as a Markdown table with the machine and date:

1. **Memory against corpus size.** Token corpora of ``--sizes`` tokens (uint16 shards
   of 128M tokens, the Python standard library's bytes tiled, made once under
   ``--corpus-dir``) each trained on by ``alpajob run`` (the README job's byte-level
   GPT, ``--steps`` steps) in a fresh process; the peak resident memory of the whole
   process tree (polled from /proc), and, in a second process, the seconds from
   opening the data to the first batch. ``--baseline PATH`` runs a checkout of an
   earlier AlpaJob (its ``alpajob`` package on ``PYTHONPATH``) the same way, for the
   before/after table.
2. **Loader throughput.** Global batches of GPT-1.3B's shape (``--batch`` rows of
   1024 + 1 ids) read from the 100M-token corpus by our reader and by a plain
   ``np.memmap`` loader as nanoGPT writes it (``get_batch``: a new memmap per batch,
   random offsets, ``astype(int64)`` per row), alternating ``--repeat`` times, in
   tokens per second of one host; beside the tokens per second the calibrated H100
   preset predicts GPT-1.3B trains at on one 8-GPU node (the planner's plan), the bar
   a host's loader must clear.
3. **prepare.** ``alpajob data prepare`` of ``--prepare-mb`` MB of jsonl text (the
   standard library's sources, one file per line, tiled), with 1 and 2 workers: ids
   per second and the peak memory of its process tree.

    python benchmarks/data_loader.py --sizes 10M,100M,1B --steps 30
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SHARD_TOKENS = 128 * 2**20


def tokens_of(text: str) -> int:
    value, unit = float(text[:-1]) if text[-1] in "KMGB" else float(text), text[-1]
    return int(value * {"K": 1e3, "M": 1e6, "G": 1e9, "B": 1e9}.get(unit, 1))


def stdlib_bytes() -> np.ndarray:
    """The standard library's sources, one byte one id, as real text to tile."""
    parts = [p.read_bytes() for p in sorted(Path(sysconfig.get_path("stdlib")).glob("*.py"))]
    return np.frombuffer(b"\0".join(parts), np.uint8).astype(np.uint16)


def make_corpus(folder: Path, tokens: int) -> Path:
    """``folder``/``tokens``: raw uint16 shards of SHARD_TOKENS (made once)."""
    out = folder / f"{tokens}"
    done = out / "complete"
    if done.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    text = stdlib_bytes()
    left, index = tokens, 0
    while left:
        n = min(left, SHARD_TOKENS)
        offset = (index * SHARD_TOKENS) % len(text)
        np.resize(np.roll(text, -offset), n).tofile(out / f"shard-{index:05d}.bin")
        left -= n
        index += 1
    done.write_text("")
    return out


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and every process below it."""
    from alpajob.trainer_image.distributed.loopback import descendants

    total = 0
    for member in {pid} | descendants([pid]):
        try:
            stat = Path(f"/proc/{member}/stat").read_text()
        except OSError:
            continue
        total += int(stat.rsplit(")", 1)[1].split()[21]) * os.sysconf("SC_PAGE_SIZE")
    return total


def peak_rss(command: list[str], env: dict[str, str], cwd: Path) -> tuple[int, float, int]:
    """(peak tree RSS, wall seconds, exit code) of ``command``, polled every 0.1 s, run in
    ``cwd`` (not the repository: ``python -c`` would import the checkout there)."""
    began = time.perf_counter()
    process = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    while process.poll() is None:
        peak = max(peak, tree_rss(process.pid))
        time.sleep(0.1)
    if process.returncode:
        sys.stderr.write(process.stderr.read().decode()[-2000:] if process.stderr else "")
    return peak, time.perf_counter() - began, process.returncode


def manifest(corpus: Path, folder: Path) -> Path:
    document = {
        "apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "data-bench"},
        "spec": {"model": {"zoo": "gpt", "config": {"hidden": 128, "layers": 4, "heads": 4, "seqLen": 128,
                                                      "vocab": 256}},
                 "data": {"train": str(corpus / "*.bin"), "format": "tokens", "tokenizer": "bytes"},
                 "training": {"globalBatchSize": 32, "steps": 300, "learningRate": 3e-3},
                 "cluster": {"gpu": "cpu", "nodes": 1, "gpusPerNode": 8}}}
    path = folder / f"job-{corpus.name}.yaml"
    path.write_text(json.dumps(document))
    return path


FIRST_BATCH = """
import sys, time, resource
from alpajob.api.resource import load_job
from alpajob.trainer_image.data.feed import open_feed
from alpajob.trainer_image.entrypoint import load_model
job = load_job(sys.argv[1])
model = load_model(job.spec.model, job.spec.training.dtype)
began = time.perf_counter()
feed = open_feed(job, model, prefetch=0)
opened = time.perf_counter()
feed.batch(0)
first = time.perf_counter()
print(opened - began, first - opened)
"""


def memory_table(args: argparse.Namespace, folder: Path) -> None:
    runs = [("this commit", None)] + ([("baseline", args.baseline)] if args.baseline else [])
    print("| code | corpus tokens | shards | peak RSS, alpajob run (MB) | wall (s) | data opened (s) | "
          "first batch after (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, path in runs:
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
        if path:
            env["PYTHONPATH"] = str(path)
        for size in args.sizes.split(","):
            tokens = tokens_of(size)
            if path and tokens > args.baseline_max:
                print(f"| {label} | {tokens:,} | | not run (would need ~{tokens * 10 / 1e9:.0f} GB) | | | |")
                continue
            corpus = make_corpus(Path(args.corpus_dir), tokens)
            job = manifest(corpus, folder)
            run = [sys.executable, "-c", "import sys; from alpajob.cli.main import main; sys.exit(main())",
                   "run", str(job), "--steps", str(args.steps), "--method", "data", "--no-plan-cache",
                   "--no-compile-cache"]
            peak, wall, code = peak_rss(run, env, folder)
            probe = subprocess.run([sys.executable, "-c", FIRST_BATCH, str(job)], env=env, capture_output=True,
                                   text=True, check=False, cwd=folder)
            opened, first = (float(x) for x in probe.stdout.split()) if probe.returncode == 0 else (float("nan"),) * 2
            shards = len(list(corpus.glob("*.bin")))
            status = "" if code == 0 else f" (exit {code})"
            print(f"| {label} | {tokens:,} | {shards} | {peak / 2**20:,.0f}{status} | {wall:.1f} | {opened:.2f} | "
                  f"{first:.3f} |", flush=True)


def nanogpt_batch(path: Path, rng: np.random.Generator, batch: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """nanoGPT's get_batch, in numpy: a new memmap per batch (its own fix for memory
    growth), random offsets, each row widened to int64."""
    data = np.memmap(path, dtype=np.uint16, mode="r")
    ix = rng.integers(0, len(data) - block, batch)
    x = np.stack([data[i:i + block].astype(np.int64) for i in ix])
    y = np.stack([data[i + 1:i + 1 + block].astype(np.int64) for i in ix])
    return x, y


def gpu_bar(seq: int) -> tuple[float, float, int]:
    """(predicted step seconds, tokens/s, global batch) of GPT-1.3B on one node of 8 H100s."""
    import alpajob
    from alpajob.api.resource import parse_job

    job = parse_job({"apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "bar"},
                     "spec": {"model": {"zoo": "gpt", "config": "1.3b"},
                              "training": {"globalBatchSize": 512, "dtype": "bfloat16"},
                              "cluster": {"gpu": "h100-80gb", "nodes": 1, "gpusPerNode": 8}}})
    plan = alpajob.plan(job, ilp_time_limit=5.0)
    tokens = plan.global_batch_size * seq
    return plan.predicted_step_seconds, tokens / plan.predicted_step_seconds, plan.global_batch_size


def throughput_table(args: argparse.Namespace) -> None:
    from alpajob.api.data import DataSpec
    from alpajob.trainer_image.data.corpus import open_train
    from alpajob.trainer_image.data.loader import train_reader
    from alpajob.trainer_image.data.remote import BlockCache
    from alpajob.trainer_image.data.shards import Opener
    from alpajob.trainer_image.data.tokenizer import ByteTokenizer

    seq, rows = 1024, args.batch
    corpus = make_corpus(Path(args.corpus_dir), tokens_of("100M"))
    single = corpus.parent / f"{corpus.name}-one-file.bin"  # nanoGPT's train.bin: the same ids, one file
    if not single.exists():
        with open(single, "wb") as out:
            for shard in sorted(corpus.glob("shard-*.bin")):
                out.write(shard.read_bytes())
    data = DataSpec(train=str(corpus / "shard-*.bin"), format="tokens")
    [source] = open_train(data, ByteTokenizer(), Opener("spec.data.train", data.token_dtype, BlockCache("/tmp", "0")))
    reader = train_reader([source], [1.0], seq, rows, seed=0, vocab=None)
    rng = np.random.default_rng(0)
    ours, theirs = [], []
    for r in range(args.repeat):
        began = time.perf_counter()
        for k in range(args.batches):
            reader.read(r * args.batches + k)
        ours.append(rows * seq * args.batches / (time.perf_counter() - began))
        began = time.perf_counter()
        for _ in range(args.batches):
            nanogpt_batch(single, rng, rows, seq)
        theirs.append(rows * seq * args.batches / (time.perf_counter() - began))
    step, bar, batch = gpu_bar(seq)
    ours_m, theirs_m = statistics.median(ours), statistics.median(theirs)
    print(f"\nGlobal batches of {rows} x {seq + 1} ids from the 100M-token corpus, {args.batches} batches a "
          f"run, medians of {args.repeat} alternating runs (one thread):\n")
    print("| loader | tokens/s (one host) | against nanoGPT's memmap | against the GPU bar |")
    print("| --- | --- | --- | --- |")
    print(f"| AlpaJob (shards, pread, global shuffle) | {ours_m:,.0f} | {ours_m / theirs_m:.2f}x | {ours_m / bar:,.0f}x |")
    print(f"| nanoGPT get_batch (np.memmap, random offsets) | {theirs_m:,.0f} | 1.00x | {theirs_m / bar:,.0f}x |")
    print(f"| the bar: GPT-1.3B on 8 H100 (calibrated preset, batch {batch}, predicted step {step:.3f} s) | "
          f"{bar:,.0f} | | 1x |")


def prepare_table(args: argparse.Namespace, folder: Path) -> None:
    text = [p.read_text(errors="replace") for p in sorted(Path(sysconfig.get_path("stdlib")).glob("*.py"))]
    lines = [(json.dumps({"text": t}) + "\n").encode() for t in text]
    source = folder / "corpus.jsonl"
    target = args.prepare_mb * 2**20
    with open(source, "wb") as out:  # whole lines, the sources over and over, to the size asked
        written = 0
        while written < target:
            for line in lines:
                out.write(line)
                written += len(line)
                if written >= target:
                    break
    job = folder / "prepare.yaml"
    job.write_text(json.dumps({"apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "p"},
                               "spec": {"model": {"zoo": "gpt", "config": "tiny"}, "cluster": {"gpu": "cpu"},
                                        "data": {"train": str(source), "format": "jsonl"}}}))
    print(f"\n`alpajob data prepare` of {args.prepare_mb} MB of jsonl (bytes tokenizer, 256 MiB shards):\n")
    print("| workers | wall (s) | ids | ids/s | input MB/s | peak RSS of the process tree (MB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for workers in (1, 2):
        out = folder / f"prepared-{workers}"
        command = [sys.executable, "-c", "import sys; from alpajob.cli.main import main; sys.exit(main())",
                   "data", "prepare", str(job), "--output", str(out), "--workers", str(workers)]
        peak, wall, code = peak_rss(command, dict(os.environ), folder)
        index = json.loads((out / "train" / "index.json").read_text()) if code == 0 else {"shards": []}
        ids = sum(s["tokens"] for s in index["shards"])
        print(f"| {workers} | {wall:.1f} | {ids:,} | {ids / wall:,.0f} | {written / 2**20 / wall:.1f} | "
              f"{peak / 2**20:,.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10M,100M,1B")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--corpus-dir", default=str(Path(tempfile.gettempdir()) / "alpajob-corpora"))
    parser.add_argument("--baseline", help="a checkout of an earlier AlpaJob to measure the same way")
    parser.add_argument("--baseline-max", type=lambda t: tokens_of(t), default=tokens_of("1B"),
                        help="the largest corpus to give the baseline (it reads the corpus whole)")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--prepare-mb", type=int, default=1024)
    parser.add_argument("--only", choices=["memory", "throughput", "prepare"], action="append")
    args = parser.parse_args()
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB; "
          f"{datetime.date.today().isoformat()}; python {platform.python_version()}\n")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if not args.only or "memory" in args.only:
            memory_table(args, folder)
        if not args.only or "throughput" in args.only:
            throughput_table(args)
        if not args.only or "prepare" in args.only:
            prepare_table(args, folder)


if __name__ == "__main__":
    main()
