"""The layout: from the repository root nothing shadows the standard library, every
module is where its import path says, and both an editable and a regular install
import every package."""

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parent.parent
#: The design card's folders and the packages they are (alpajob/ links to them).
CARD = {"planner": "alpajob.planner", "operator": "alpajob.operator", "trainer_image": "alpajob.trainer_image"}
PACKAGES = ["alpajob", "alpajob.api", "alpajob.cli", "alpajob.planner", "alpajob.planner.graph",
            "alpajob.planner.cost", "alpajob.planner.intra_op", "alpajob.planner.inter_op",
            "alpajob.planner.plan", "alpajob.operator", "alpajob.trainer_image",
            "alpajob.trainer_image.zoo", "alpajob.trainer_image.runtime",
            "alpajob.trainer_image.distributed", "alpajob.cli.main"]
CHECK = (
    "import importlib, operator; "
    f"[importlib.import_module(p) for p in {PACKAGES!r}]; "
    "assert operator.add(1, 2) == 3; "
    "import alpajob.planner.cost.cluster as c; c.cluster_from_preset('v100-16gb', 1); print('ok')"
)


def test_no_top_level_folder_shadows_the_standard_library_from_the_root():
    """`python -m pip` and `python -m pytest` put the root first on sys.path: a folder
    named like a stdlib module must not be a regular package there."""
    for folder in ROOT.iterdir():
        if folder.is_dir() and folder.name in sys.stdlib_module_names:
            assert not (folder / "__init__.py").exists(), folder
    probe = ("import sys; sys.path.insert(0, ''); import collections, operator; "
             "assert operator.add(1, 2) == 3 and not str(operator.__spec__.origin).startswith(sys.argv[1]); "
             "print('ok')")
    out = subprocess.run([sys.executable, "-S", "-c", probe, str(ROOT)], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.stdout.strip() == "ok", out.stderr
    collect = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests/test_manifest.py"],
                             capture_output=True, text=True, cwd=ROOT)
    assert collect.returncode == 0, collect.stdout + collect.stderr


def test_the_card_folders_are_the_packages_the_namespace_links_to():
    for folder, package in CARD.items():
        link = ROOT / "alpajob" / folder
        assert link.is_symlink() and link.resolve() == (ROOT / folder).resolve(), link
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations is not None
        assert Path(next(iter(spec.submodule_search_locations))).resolve() == (ROOT / folder).resolve()


def test_every_module_is_where_its_import_path_says():
    """``alpajob.a.b`` is ``alpajob/a/b.py`` (or ``alpajob/a/b/__init__.py``), links
    followed; nothing is importable under another name."""
    count = 0
    files = [Path(d) / f for d, _, names in os.walk(ROOT / "alpajob", followlinks=True)
             for f in names if f.endswith(".py")]
    for path in sorted(files):
        relative = path.relative_to(ROOT).with_suffix("")
        parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
        name = ".".join(parts)
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        assert Path(spec.origin).resolve() == path.resolve(), (name, spec.origin)
        count += 1
    assert count > 100


def test_editable_install_imports():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, cwd="/")
    assert out.stdout.strip() == "ok", out.stderr


def test_importing_the_python_api_imports_nothing_heavy():
    code = ("import sys, alpajob, alpajob.api.resource, alpajob.api.crd, alpajob.cli.main; "
            "print(sorted(m for m in ('jax', 'ray', 'kopf', 'pulp', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.stdout.strip() == "[]", out.stderr


def test_regular_install_imports(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True,
    )
    (wheel,) = tmp_path.glob("alpajob-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "alpajob/operator/handlers.py" in names and "alpajob/operator/__init__.py" not in names
    assert "alpajob/planner/cost/data/presets.json" in names
    assert "alpajob/trainer_image/step.py" in names
    assert not any(n.startswith(("operator/", "planner/", "trainer_image/")) for n in names)
    assert not any("__pycache__" in n for n in names)
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
