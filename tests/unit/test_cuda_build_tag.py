"""The CUDA build cache is keyed by the content of every file in csrc/, headers included (CPU)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension

from lightning_fp8state.ops import cuda

HEADER = "fp8state_common.cuh"


@pytest.fixture
def csrc(tmp_path, monkeypatch) -> Path:
    """A copy of the package's csrc/ that the build functions read instead of the real one."""
    copy = tmp_path / "csrc"
    shutil.copytree(cuda.source_dir(), copy)
    monkeypatch.setattr(cuda, "source_dir", lambda: copy)
    monkeypatch.setenv("FP8STATE_CACHE_DIR", str(tmp_path / "cache"))
    return copy


def _src_part(tag: str) -> str:
    return tag.rsplit("-src", 1)[1]


def test_the_shipped_header_and_sources_are_the_ones_declared():
    present = {p.name for p in cuda.source_dir().iterdir() if p.suffix in (".cu", ".cuh", ".h")}
    assert present == set(cuda.SOURCES) | set(cuda.HEADERS)
    for source in cuda.SOURCES:
        assert f'#include "{HEADER}"' in (cuda.source_dir() / source).read_text()


def test_tag_is_stable_and_depends_on_content_only(csrc):
    real = cuda.source_hash()  # the copy: same bytes as the package's csrc/
    tag = cuda.build_tag()
    assert len(real) == 16 and int(real, 16) >= 0
    assert _src_part(tag) == real
    assert cuda.build_tag() == tag  # stable across calls
    for f in csrc.iterdir():  # new timestamps and a different directory change nothing
        os.utime(f, (1, 1))
    assert cuda.build_tag() == tag
    (csrc / "notes.txt").write_text("not a source")  # files that are not compiled do not count
    (csrc / "scratch.o").write_bytes(b"\0" * 8)
    assert cuda.build_tag() == tag


def test_editing_the_header_changes_the_tag_and_reverting_restores_it(csrc):
    before = cuda.build_tag()
    header = csrc / HEADER
    original = header.read_bytes()
    header.write_bytes(original + b"// one more line\n")
    edited = cuda.build_tag()
    assert edited != before
    # only the source part moves: torch, CUDA and architectures are the same
    assert edited.rsplit("-src", 1)[0] == before.rsplit("-src", 1)[0]
    header.write_bytes(original)
    assert cuda.build_tag() == before


@pytest.mark.parametrize("change", ["edit_source", "add_header", "remove_header", "rename_header"])
def test_any_change_to_a_source_or_header_changes_the_tag(csrc, change):
    before = cuda.source_hash()
    if change == "edit_source":
        path = csrc / cuda.SOURCES[0]
        path.write_text(path.read_text().replace("namespace {", "namespace  {", 1))
    elif change == "add_header":
        (csrc / "extra.h").write_text("#pragma once\n")
    elif change == "remove_header":
        (csrc / HEADER).unlink()
    else:
        (csrc / HEADER).rename(csrc / "fp8state_common2.cuh")
    assert cuda.source_hash() != before


def test_a_header_edit_builds_into_a_fresh_directory(csrc, tmp_path, monkeypatch):
    """build() hands torch's JIT a build directory named by the tag; a header edit gives another."""
    calls = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: calls.append(kw))
    first = cuda.build()
    (csrc / HEADER).write_text((csrc / HEADER).read_text() + "\n// edited\n")
    second = cuda.build()
    assert [Path(c["build_directory"]) for c in calls] == [first.parent, second.parent]
    assert first.parent != second.parent
    assert first.parent.parent == second.parent.parent == tmp_path / "cache"
    assert second.parent.name == cuda.build_tag()
    # the header is not compiled on its own: the sources include it
    assert [Path(s).name for s in calls[0]["sources"]] == list(cuda.SOURCES)


def test_a_missing_header_is_named_before_any_compiler_runs(csrc, monkeypatch):
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: pytest.fail("must not build"))
    (csrc / HEADER).unlink()
    with pytest.raises(FileNotFoundError, match=f"{HEADER} is missing from the installed package"):
        cuda.build()


def test_extension_info_reports_the_source_hash():
    assert cuda.extension_info()["source_hash"] == cuda.source_hash()


# ---- the first load of a build happens in a child process (CPU: the child is stubbed) ----


def _child(monkeypatch, code: str) -> None:
    monkeypatch.setattr(cuda, "_load_check_command", lambda: [sys.executable, "-c", code])


def test_load_check_runs_the_child_once_per_build_and_schema(csrc, monkeypatch):
    _child(monkeypatch, "pass")
    marker = cuda.load_check()
    assert marker.is_file() and marker.parent.name == cuda.build_tag()
    _child(monkeypatch, "import os; os.abort()")  # would fail: the marker spares the child
    assert cuda.load_check() == marker
    monkeypatch.setattr(cuda, "_schema_hash", lambda: "another-schema")
    with pytest.raises(RuntimeError, match="exit status"):
        cuda.load_check()  # a new schema version is checked again


def test_a_child_that_dies_loading_is_reported_with_its_output(csrc, monkeypatch):
    _child(
        monkeypatch,
        "import sys, os; print('schema mismatch for fp8state::x', file=sys.stderr); sys.stderr.flush(); os.abort()",
    )
    with pytest.raises(RuntimeError, match=r"exit status -6(.|\n)*schema mismatch for fp8state::x"):
        cuda.load_check()
    assert not list((cuda._build_dir()).glob("load-ok-*"))


def test_ensure_loaded_falls_back_to_the_reference_when_the_child_dies(csrc, monkeypatch):
    """What the aborting registration did to the whole process now happens to the child: this
    process warns once, never loads the library, and the reference keeps serving."""
    _child(monkeypatch, "import os; os.abort()")
    monkeypatch.setattr(cuda, "_state", {"tried": False, "loaded": False, "error": None, "library": None})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("FP8STATE_DISABLE_CUDA", raising=False)
    built = []
    monkeypatch.setattr(cuda, "build", lambda *a, **k: built.append(1))
    with pytest.warns(RuntimeWarning, match="child process failed"):
        assert cuda.ensure_loaded() is False
    assert cuda.ensure_loaded() is False  # once: no second child, no second warning
    assert built == [] and "exit status" in cuda.extension_info()["error"]


def test_the_child_imports_from_this_process_sys_path(csrc, monkeypatch, tmp_path):
    """A script that put the package on sys.path itself (not on PYTHONPATH) still gets a child
    that finds it."""
    extra = tmp_path / "only_on_sys_path"
    extra.mkdir()
    (extra / "f8s_probe_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(extra))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    real = cuda._load_check_command()  # python -I: the path travels in the command itself
    assert real[1] == "-I" and str(extra) in real[-1]
    probe = real[-1].replace("from lightning_fp8state.ops import cuda; cuda.build()", "import f8s_probe_module")
    monkeypatch.setattr(cuda, "_load_check_command", lambda: [*real[:-1], probe])
    assert cuda.load_check().is_file()
