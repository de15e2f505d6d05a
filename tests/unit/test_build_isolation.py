"""What the CUDA extension's loader trusts (issue 41): the child that checks a first load runs
isolated (a ``torch.py`` in the working directory is not imported), the cache folder must be this
user's and writable by nobody else, and a library is loaded only when its SHA-256 matches the one
recorded at its build. CPU: nothing here compiles or loads a library."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from lightning_fp8state.ops import cuda


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("FP8STATE_CACHE_DIR", str(root))
    return root


def test_the_load_check_child_does_not_import_a_torch_py_from_the_working_directory(tmp_path, monkeypatch, cache):
    work = tmp_path / "work"
    work.mkdir()
    marker = tmp_path / "MARKER"
    (work / "torch.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nraise SystemExit(0)\n")
    monkeypatch.chdir(work)
    # the real command, with the build swapped for an import of torch: the planted torch.py would run
    code = cuda._load_check_command()[-1].replace(
        "from lightning_fp8state.ops import cuda; cuda.build()", "import torch"
    )
    done = subprocess.run([*cuda._load_check_command()[:-1], code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not marker.exists(), "the child imported torch.py from the working directory"


def test_a_cache_folder_others_may_write_is_refused(cache):
    cache.mkdir(mode=0o777)
    os.chmod(cache, 0o777)
    with pytest.raises(RuntimeError, match="may be written by group or others .*FP8STATE_CACHE_DIR"):
        cuda._build_dir()


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root (CI runs as root)")
def test_a_cache_folder_of_another_user_is_refused(cache):
    cache.mkdir(mode=0o700)
    os.chown(cache, 65534, 65534)
    with pytest.raises(RuntimeError, match="belongs to user id 65534"):
        cuda._build_dir()


def test_a_new_cache_folder_is_private(cache):
    build_dir = cuda._build_dir()
    for folder in (cache, build_dir):
        assert folder.stat().st_mode & 0o777 == 0o700


def test_a_library_is_loaded_only_if_it_matches_its_recorded_hash(cache):
    build_dir = cuda._build_dir()
    library = build_dir / "fp8state_cuda.so"
    library.write_bytes(b"\x7fELF the library as built")
    cuda._record_library(build_dir)
    cuda._check_library(build_dir)  # as recorded: loads
    library.write_bytes(b"\x7fELF a library put there afterwards")
    with pytest.raises(RuntimeError, match="does not match the SHA-256 recorded at its build"):
        cuda._check_library(build_dir)


def test_a_library_without_a_record_is_built_afresh_not_loaded(cache):
    build_dir = cuda._build_dir()
    library = build_dir / "fp8state_cuda.so"
    library.write_bytes(b"\x7fELF of an earlier version, or planted")
    cuda._check_library(build_dir)
    assert not library.exists()  # the build that follows makes (and records) it anew


def test_a_rebuild_over_a_recorded_library_records_the_new_one(cache, monkeypatch):
    """A warm machine's cache: the package copied afresh (same sources, newer times) makes the
    build tool relink the library in the same folder; the next process must load it, not refuse
    it as changed after its build."""
    from torch.utils import cpp_extension

    build_dir = cuda._build_dir()
    library = build_dir / "fp8state_cuda.so"
    library.write_bytes(b"\x7fELF the first build")
    cuda._record_library(build_dir)

    def relink(name, sources, build_directory, **kw):
        (Path(build_directory) / f"{name}.so").write_bytes(b"\x7fELF relinked: other bytes")

    monkeypatch.setattr(cpp_extension, "load", relink)
    monkeypatch.setattr(cuda, "SOURCES", [])
    monkeypatch.setattr(cuda, "HEADERS", [])
    assert cuda.build() == library
    cuda._check_library(build_dir)  # the next process's check: the record is the relinked library's
    assert library.read_bytes() == b"\x7fELF relinked: other bytes"


def test_a_build_that_leaves_the_checked_library_alone_keeps_its_record(cache, monkeypatch):
    from torch.utils import cpp_extension

    build_dir = cuda._build_dir()
    library = build_dir / "fp8state_cuda.so"
    library.write_bytes(b"\x7fELF as built")
    cuda._record_library(build_dir)
    record = (build_dir / "fp8state_cuda.so.sha256").read_text()
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: None)
    monkeypatch.setattr(cuda, "SOURCES", [])
    monkeypatch.setattr(cuda, "HEADERS", [])
    cuda.build()
    assert (build_dir / "fp8state_cuda.so.sha256").read_text() == record
