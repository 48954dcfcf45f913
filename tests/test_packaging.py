"""Both an editable and a regular install import every package, and never shadow the
standard library's `operator` module."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parent.parent
PACKAGES = ["alpajob", "alpajob.planner", "alpajob.operator", "alpajob.trainer",
            "alpajob.trainer.zoo", "alpajob.trainer.runtime", "alpajob.trainer.distributed",
            "alpajob.cli"]
CHECK = (
    "import importlib, operator; "
    f"[importlib.import_module(p) for p in {PACKAGES!r}]; "
    "assert operator.add(1, 2) == 3; "
    "import alpajob.planner.cluster as c; c.cluster_from_preset('v100-16gb', 1); print('ok')"
)


def test_editable_install_imports():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, cwd="/")
    assert out.stdout.strip() == "ok", out.stderr


def test_regular_install_imports(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True,
    )
    (wheel,) = tmp_path.glob("alpajob-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "alpajob/operator/__init__.py" in names
    assert "alpajob/planner/data/presets.json" in names
    assert not any(n.startswith("operator/") for n in names)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # A regular install is the wheel unpacked onto sys.path, ahead of the editable one.
    out = subprocess.run(
        [sys.executable, "-S", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); "
         "import site; site.main(); " + CHECK + "; import alpajob; "
         f"assert alpajob.__file__.startswith({str(site)!r}), alpajob.__file__"],
        capture_output=True, text=True, cwd="/",
    )
    assert out.stdout.strip() == "ok", out.stderr
