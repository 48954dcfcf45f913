"""SIGTERM (how Kubernetes stops a pod) and Ctrl-C: outside the training loop the
command stops its worker pool and children, says in one line what it was doing and
that nothing was saved; inside it, it saves the step it finished and names it. Either
way it exits 143 (130 for Ctrl-C), with no traceback and no leaked semaphore, whether
its output goes to a file or a pipe (a pod's log) or to a terminal (a progress bar)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from alpajob.api.progress import Progress

EXAMPLES = Path(__file__).parent.parent / "manifests" / "examples"
README_JOB = str(EXAMPLES / "text-gpt.yaml")


def _start(*args: str, cwd: Path, log: Path | None = None) -> subprocess.Popen[str]:
    """The command, its stderr a pipe, or the file ``log`` (as a pod's log is)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)  # the command makes its own forced devices
    # A shell starts a background job with Ctrl-C ignored, and a child inherits that:
    # this one gets Ctrl-C as a terminal's foreground command does.
    return subprocess.Popen([sys.executable, "-m", "alpajob", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=log.open("w") if log else subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for_line(process: subprocess.Popen[str], marker: str, timeout: float = 120.0) -> list[str]:
    """stderr's lines up to the first that contains ``marker``."""
    assert process.stderr is not None
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        seen.append(line)
        if marker in line:
            return seen
    raise AssertionError(f"no {marker!r} in {seen}")


def _stop(process: subprocess.Popen[str], signum: int) -> tuple[int, str]:
    """Send ``signum``; the exit status and the rest of stderr (no process may be left)."""
    family = psutil.Process(process.pid).children(recursive=True)
    process.send_signal(signum)
    _, err = process.communicate(timeout=60)
    gone, alive = psutil.wait_procs(family, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    return process.returncode, err


def _last_line(err: str) -> str:
    """The last line a reader sees: a terminal's progress bar draws with escape codes
    and carriage returns, which are taken out."""
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", err).strip()
    return re.split(r"[\r\n]", shown)[-1]


def _assert_one_line(err: str, during: str, signal_name: str) -> None:
    assert "Traceback" not in err and "leaked" not in err and "BrokenPipe" not in err, err
    last = _last_line(err)
    assert last.startswith(f"stopped by {signal_name} while {during}") and last.endswith("nothing was saved"), err


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143),
                                              pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)])
def test_alpajob_plan_stopped_while_planning(tmp_path: Path, signum: int, code: int) -> None:
    """SIGTERM with stderr a file, as a planner pod's log; Ctrl-C with it a pipe."""
    log = tmp_path / "planner.log" if signum == signal.SIGTERM else None
    process = _start("plan", README_JOB, "--no-plan-cache", cwd=tmp_path, log=log)
    parent = psutil.Process(process.pid)
    # The fork server starts while the model is traced; planning has begun once it has
    # forked the pool's workers (grandchildren of the command).
    while not any(p.ppid() != process.pid for p in parent.children(recursive=True)):
        assert process.poll() is None
        time.sleep(0.1)
    returned, err = _stop(process, signum)
    assert returned == code
    _assert_one_line(log.read_text() if log else err, "planning", signal.Signals(signum).name)


@pytest.mark.slow
def test_alpajob_run_stopped_while_choosing_its_forced_devices(tmp_path: Path) -> None:
    """An auto job on CPU plans itself for each forced device count in a child process
    (forced_count.py) before JAX starts: the child is stopped with the run."""
    if (os.cpu_count() or 1) >= 8:
        pytest.skip("the forced device count is chosen only on hosts with fewer than 8 cores")
    process = _start("run", README_JOB, "--no-plan-cache", cwd=tmp_path)
    while not psutil.Process(process.pid).children(recursive=True):
        assert process.poll() is None
        time.sleep(0.2)
    time.sleep(2.0)
    returned, err = _stop(process, signal.SIGTERM)
    assert returned == 143
    _assert_one_line(err, "choosing the forced device count", "SIGTERM")


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["tracing gpt", "planning for 8 local cpu devices", "initialising parameters"])
def test_alpajob_run_stopped_before_training(tmp_path: Path, phase: str) -> None:
    """Each phase before the first step takes seconds for the README job (tracing 2 s,
    planning 14 s, initialising 3 s on 2 cores): stopped as it starts, the run names it."""
    process = _start("run", README_JOB, "--devices", "8", "--no-plan-cache", "--keep-plan", cwd=tmp_path)
    _wait_for_line(process, phase)
    returned, err = _stop(process, signal.SIGTERM)
    assert returned == 143
    _assert_one_line(err, phase, "SIGTERM")


def _signal_at(monkeypatch: pytest.MonkeyPatch, owner: object, name: str, signum: int) -> None:
    """``owner.name`` sends this process ``signum`` as it starts: the phase it opens is
    interrupted by a real signal, at a known point, however short the phase is."""
    original = getattr(owner, name)

    def interrupted(*args: object, **kwargs: object) -> object:
        os.kill(os.getpid(), signum)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)


def _output(monkeypatch: pytest.MonkeyPatch, output: str) -> None:
    """``terminal``: the command's consoles act as a terminal's (a progress bar);
    ``file``: plain lines, as in a pod's log or a pipe."""
    if output == "terminal":
        monkeypatch.setenv("FORCE_COLOR", "1")  # rich: stdout and stderr are terminals
    else:
        monkeypatch.delenv("FORCE_COLOR", raising=False)


STOPS = [(signal.SIGTERM, 143, "file"), (signal.SIGINT, 130, "terminal"),
         pytest.param(signal.SIGTERM, 143, "terminal", marks=pytest.mark.slow),
         pytest.param(signal.SIGINT, 130, "file", marks=pytest.mark.slow)]


@pytest.mark.parametrize(("signum", "code", "output"), STOPS)
def test_alpajob_run_stopped_while_reading_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str], signum: int, code: int,
                                                output: str) -> None:
    from alpajob.cli.main import main
    from alpajob.trainer_image import local_run

    _signal_at(monkeypatch, local_run, "open_feed", signum)
    _output(monkeypatch, output)
    # Under a shell's background job (CI) Ctrl-C is ignored from the start: a terminal's
    # foreground command gets Python's own handler.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        returned = main(["run", README_JOB, "--method", "serial", "--steps", "1"])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert returned == code
    _assert_one_line(capsys.readouterr().err, "reading data", signal.Signals(signum).name)


def test_alpajob_run_stopped_while_restoring_keeps_the_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Stopped while it restores, the run says so, leaves the checkpoint as it was and
    its folder unlocked: the next --resume continues from it."""
    from alpajob.cli.main import main
    from alpajob.trainer_image.checkpoint.local import LocalCheckpoints

    run = ["run", str(EXAMPLES / "local-gpt.yaml"), "--method", "serial", "--checkpoint-dir", str(tmp_path)]
    assert main([*run, "--steps", "1"]) == 0
    capsys.readouterr()
    with monkeypatch.context() as patch:
        _signal_at(patch, LocalCheckpoints, "newest", signal.SIGTERM)
        assert main([*run, "--steps", "2", "--resume"]) == 143
    _assert_one_line(capsys.readouterr().err, "restoring step 1", "SIGTERM")
    assert main([*run, "--steps", "2", "--resume", "--log-every", "1"]) == 0
    assert "step 2/2" in capsys.readouterr().err


@pytest.mark.parametrize(("signum", "code", "output"), STOPS)
def test_alpajob_run_stopped_while_training_saves_the_step_it_finished(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        signum: int, code: int, output: str) -> None:
    """A stop during training lets the step in progress finish, saves it, says so in
    one line (whatever the folder's path length: a pod's log does not wrap it) and
    exits with the signal's status: 130 for Ctrl-C, as a shell reports it, not 143."""
    from alpajob.cli.main import main
    from alpajob.trainer_image import local_run

    original = local_run.run

    def run(*args: object, on_step: Callable[[Progress], None], **kwargs: object) -> object:
        def step(report: Progress) -> None:
            if report.step == 2:
                os.kill(os.getpid(), signum)
            on_step(report)

        return original(*args, on_step=step, **kwargs)

    monkeypatch.setattr(local_run, "run", run)
    _output(monkeypatch, output)
    folder = tmp_path / ("a-checkpoint-folder-with-a-long-name-" * 3)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        returned = main(["run", str(EXAMPLES / "local-gpt.yaml"), "--method", "serial", "--steps", "5",
                         "--checkpoint-dir", str(folder)])
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    assert returned == code, err
    assert "Traceback" not in err, err
    name = signal.Signals(signum).name
    assert _last_line(err) == f"stopped by {name} after step 2: checkpoint of step 2 in {folder}; continue with --resume"
    assert sorted(p.name for p in (folder / "local").iterdir() if p.name.isdigit()) == ["2"]


def test_a_stop_request_tells_its_hook_once_at_the_first_signal() -> None:
    """The driver's hook (it holds the mesh hosts for the checkpoint) runs at the first
    SIGTERM only; the flag names the signal."""
    from alpajob.trainer_image.stopping import StopRequest

    heard: list[str] = []
    with StopRequest(on_request=heard.append) as stop:
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs between two bytecodes of the main thread
    assert stop.requested == "SIGTERM" and heard == ["SIGTERM"]
