"""Every install mode finds the folders shipped beside the code: ``csrc/``, ``configs/`` and
``recipes/`` live at the repository root and travel inside the package.

A wheel is built from this checkout and installed into fresh virtual environments (no pip,
no network: this process's pip installs into them with ``--python``, ``--no-deps``; a
``.pth`` file, written after the install, lends them this environment's site-packages for
torch, Lightning and the rest). The editable install is the one the test suite itself runs
under (``test_this_checkout_reads_the_root_folders``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import lightning_fp8state as f8s
from lightning_fp8state.shipped import SHIPPED, shipped_dir

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
# prints where the package, its shipped folders and the CUDA sources were found
PROBE = (
    "import lightning_fp8state as m, json; from lightning_fp8state.shipped import shipped_dir; "
    "from lightning_fp8state.ops import cuda; "
    "print(json.dumps({'package': m.__file__, 'source_dir': str(cuda.source_dir()), 'hash': cuda.source_hash(), "
    "**{n: sorted(str(p.relative_to(shipped_dir(n))) for p in shipped_dir(n).rglob('*') if p.is_file() "
    "and '__pycache__' not in p.parts) for n in ('csrc', 'configs', 'recipes')}}))"
)


def _pip(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", *args], check=True, capture_output=True
    )


def _outer_site_packages() -> list[str]:
    return [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]


def _fresh_venv(path: Path) -> Path:
    venv.create(path, with_pip=False)
    return path / "bin" / "python"


def _lend_site_packages(python: Path) -> Path:
    """Give the venv this environment's packages (torch...), after ours went in: its own
    site-packages stays first on sys.path, so its copy of lightning_fp8state is the one imported."""
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(purelib) / "_lent_site_packages.pth").write_text("\n".join(_outer_site_packages()) + "\n")
    return Path(purelib)


def _probe(python: Path | str, cwd: Path, env: dict | None = None) -> dict:
    import json

    out = subprocess.run(
        [str(python), "-c", PROBE], cwd=cwd, env=env, check=True, capture_output=True, text=True, timeout=300
    )
    return json.loads(out.stdout)


# what pyproject.toml ships of each folder
_SHIPPED_PATTERNS = {"csrc": ("*.cu", "*.cuh", "*.h"), "configs": ("*/*.yaml",), "recipes": ("*.yaml",)}


def _expected_files() -> dict:
    return {
        n: sorted(str(p.relative_to(ROOT / n)) for pattern in _SHIPPED_PATTERNS[n] for p in (ROOT / n).glob(pattern))
        for n in SHIPPED
    }


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory) -> Path:
    """A copy of the checkout without build outputs: setuptools packs whatever an earlier build
    left in ``build/lib`` (files since renamed or removed too) into the next wheel."""
    copy = tmp_path_factory.mktemp("source") / "lightning_fp8state"
    skip = shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", "runs", "wandb", ".venv*", ".*_cache", ".hypothesis"
    )
    shutil.copytree(ROOT, copy, ignore=skip)
    return copy


@pytest.fixture(scope="module")
def wheel(source_tree, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out), str(source_tree))
    return next(out.glob("lightning_fp8state-*.whl"))


def test_this_checkout_reads_the_root_folders():
    """A source checkout (the editable install, or the repository on sys.path)."""
    for name in SHIPPED:
        assert shipped_dir(name) == ROOT / name
    assert f8s.ops.cuda.source_dir() == ROOT / "csrc"
    assert not (ROOT / "lightning_fp8state" / "csrc").exists()


def test_a_wheel_in_a_fresh_venv_trains_the_default_recipe_and_lists_the_recipes(wheel, tmp_path):
    python = _fresh_venv(tmp_path / "venv")
    _pip("--python", str(python), "install", "--no-deps", "--no-index", str(wheel))
    site = _lend_site_packages(python)
    work = tmp_path / "work"
    work.mkdir()
    found = _probe(python, work)
    assert Path(found["package"]).is_relative_to(site / "lightning_fp8state"), found["package"]
    assert Path(found["source_dir"]) == site / "lightning_fp8state" / "csrc"
    assert found["hash"] == f8s.ops.cuda.source_hash()  # same sources, same build cache entry
    for name, files in _expected_files().items():
        assert found[name] == files, name

    fp8state = python.parent / "fp8state"  # the console script, run by the venv's python
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("PYTHONPATH", None)
    run = subprocess.run(
        [str(fp8state), "train", "tiny_gpt_cpu", "trainer.max_steps=2"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "steps: 2" in run.stdout
    assert (work / "runs" / "tiny_gpt_cpu" / "config.yaml").is_file()
    assert (work / "runs" / "tiny_gpt_cpu" / "telemetry.jsonl").is_file()

    listing = subprocess.run(
        [str(fp8state), "train", "no_such_recipe"], cwd=work, env=env, capture_output=True, text=True, timeout=300
    )
    assert listing.returncode == 2
    assert f"known: {RECIPES}" in listing.stderr, listing.stderr
    assert len(RECIPES) >= 4


def test_the_wheel_holds_every_module_of_the_tree(wheel):
    """pyproject.toml lists the packages by name (package-dir maps the shipped folders): a
    package missing from that list would be missing from every install."""
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "lightning_fp8state").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert modules and modules <= names, sorted(modules - names)


def test_a_target_install_finds_its_folders(wheel, tmp_path):
    target = tmp_path / "target"
    _pip("install", "--no-deps", "--no-index", "--target", str(target), str(wheel))
    env = {**os.environ, "PYTHONPATH": str(target)}
    found = _probe(sys.executable, tmp_path, env)
    assert Path(found["package"]).is_relative_to(target / "lightning_fp8state"), found["package"]
    assert Path(found["source_dir"]) == target / "lightning_fp8state" / "csrc"
    for name, files in _expected_files().items():
        assert found[name] == files, name


def test_a_plain_install_from_the_source_tree_finds_its_folders(source_tree, tmp_path):
    """``pip install <checkout>`` (not editable): pip builds from the tree itself, not from a
    wheel file (into a ``--target``: the build backend needs this environment's setuptools)."""
    target = tmp_path / "target"
    _pip("install", "--no-deps", "--no-build-isolation", "--no-index", "--target", str(target), str(source_tree))
    found = _probe(sys.executable, tmp_path, {**os.environ, "PYTHONPATH": str(target)})
    assert Path(found["package"]).is_relative_to(target / "lightning_fp8state"), found["package"]
    for name, files in _expected_files().items():
        assert found[name] == files, name
