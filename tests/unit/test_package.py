"""Packaging: the CUDA sources ship inside the package, and the CPU fallback is clean."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import lightning_fp8state as f8s

ROOT = Path(__file__).resolve().parents[2]


def test_public_contract_names_are_exported():
    for name in (
        "QuantConfig",
        "Fp8State",
        "checkpoint",
        "StateTransitionError",
        "ConcurrentEntryError",
        "StaleSnapshotError",
        "AmbiguousRecomputeError",
        "ConfigError",
    ):
        assert hasattr(f8s, name), name
        assert name in f8s.__all__


@pytest.mark.slow
def test_wheel_ships_the_cuda_sources(tmp_path, monkeypatch):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    wheel = zipfile.ZipFile(next(tmp_path.glob("lightning_fp8state-*.whl")))
    names = wheel.namelist()
    csrc = f8s.ops.cuda.source_dir()
    expected = [*f8s.ops.cuda.SOURCES, *f8s.ops.cuda.HEADERS]
    assert "fp8state_common.cuh" in expected
    # every source and header the lazy build needs, byte for byte as in the tree
    for name in expected:
        assert f"lightning_fp8state/csrc/{name}" in names, name
        assert wheel.read(f"lightning_fp8state/csrc/{name}") == (csrc / name).read_bytes(), name
    # so an installed copy builds into the same cache directory as the tree it came from
    unpacked = tmp_path / "unpacked"
    wheel.extractall(unpacked, [n for n in names if n.startswith("lightning_fp8state/csrc/")])
    monkeypatch.setattr(f8s.ops.cuda, "source_dir", lambda: unpacked / "lightning_fp8state" / "csrc")
    installed_hash = f8s.ops.cuda.source_hash()
    monkeypatch.undo()
    assert installed_hash == f8s.ops.cuda.source_hash()


def test_without_cuda_the_kernels_are_not_loaded_and_ops_still_work(monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this checks the CPU-only path")
    assert not f8s.ops.cuda.is_loaded()
    q = f8s.ops.quantize_fp8(torch.randn(16), torch.tensor([1.0]), torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn
