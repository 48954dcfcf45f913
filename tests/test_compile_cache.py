"""JAX's persistent compilation cache under ``alpajob run``
(:mod:`alpajob.trainer_image.compile_cache`): an executable compiled in one run is read
back, not compiled, in the next."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from alpajob.cli.main import main
from alpajob.trainer_image.compile_cache import compile_cache, default_compile_cache_dir

EXAMPLES = Path(__file__).resolve().parents[1] / "manifests" / "examples"


def test_the_default_folder_is_jax_s_own_else_the_user_cache():
    assert default_compile_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/alpajob/xla")
    assert default_compile_cache_dir({"XDG_CACHE_HOME": "/x", "JAX_COMPILATION_CACHE_DIR": "/j"}) == Path("/j")


def _step(x):
    return jnp.tanh(x @ x.T).sum() * 3.0 + 1.0


def test_an_executable_compiled_once_is_read_back_after_jax_forgets_it(tmp_path):
    events: list[str] = []

    def listen(event: str, **_kwargs) -> None:
        events.append(event)

    x = jnp.ones((16, 16))
    with compile_cache(str(tmp_path), print) as used:
        assert used
        first = jax.jit(_step)(x)
    entries = {p.name for p in tmp_path.iterdir() if not p.name.startswith(".")}
    assert entries, "nothing was written to the cache"
    jax.clear_caches()  # what a new process would have: no executable in memory
    jax.monitoring.register_event_listener(listen)
    try:
        with compile_cache(str(tmp_path), print):
            again = jax.jit(_step)(x)
    finally:
        jax.monitoring.unregister_event_listener(listen)
    assert "/jax/compilation_cache/cache_hits" in events
    assert float(again) == float(first)
    assert {p.name for p in tmp_path.iterdir() if not p.name.startswith(".")} == entries
    assert jax.config.jax_compilation_cache_dir is None  # JAX's setting restored after the run
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0


def test_a_cache_that_cannot_be_written_costs_a_warning_not_the_run(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    warnings: list[str] = []
    with compile_cache(str(blocked / "xla"), warnings.append) as used:
        assert not used
        assert float(jax.jit(_step)(jnp.ones((4, 4)))) > 0
    assert len(warnings) == 1 and warnings[0].startswith("compile cache: ") and "--no-compile-cache" in warnings[0]


@pytest.mark.parametrize("flags, named", [
    (["--compile-cache", "DIR", "--no-compile-cache"], "--compile-cache"),
    (["--compile-cache", "FILE"], "--compile-cache"),
])
def test_bad_compile_cache_flags_are_one_line_naming_the_flag(tmp_path, capsys, flags, named):
    (tmp_path / "FILE").write_text("x")
    flags = [str(tmp_path / f) if f in ("DIR", "FILE") else f for f in flags]
    code = main(["run", str(EXAMPLES / "local-gpt.yaml"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and named in err and "Traceback" not in err


def test_a_process_started_with_the_cache_s_environment_reads_back_what_another_compiled(tmp_path):
    """What a mesh pod's Ray workers get (:func:`compile_cache_env`): JAX reads it from
    the environment at import, so a second process loads the first one's executable."""
    import os
    import subprocess
    import sys

    from alpajob.trainer_image.compile_cache import compile_cache_env

    program = (
        "import jax, jax.numpy as jnp\n"
        "hits = []\n"
        "jax.monitoring.register_event_listener(lambda e, **k: hits.append(e))\n"
        "print(float(jax.jit(lambda x: jnp.tanh(x @ x.T).sum() * 5.0)(jnp.ones((16, 16)))))\n"
        "print('/jax/compilation_cache/cache_hits' in hits)\n")
    env = {**os.environ, **compile_cache_env(str(tmp_path / "xla"), print), "JAX_PLATFORMS": "cpu"}
    first = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, check=True)
    second = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, check=True)
    assert first.stdout.split()[1] == "False" and second.stdout.split()[1] == "True", (first.stdout, second.stdout)
    assert first.stdout.split()[0] == second.stdout.split()[0]
