"""The scalar FP4 rules of the CUDA source (E2M1 rounding, block exponents, order keys),
compiled for the host and checked exhaustively where it matters (every float32 in [2^-7, 16]).

Needs ``nvcc`` (no GPU): skipped with a reason where it is missing. The kernels themselves are
checked against the reference on the GPU by ``test_cuda_fp4.py``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CHECK = Path(__file__).with_name("fp4_math_host_check.cu")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (host-only compile of csrc/fp4_ops.cu)")
def test_fp4_scalar_rules_on_the_host(tmp_path):
    exe = tmp_path / "fp4_math_host_check"
    from lightning_fp8state.ops.cuda import source_dir  # the csrc/ of the imported package

    flags = [
        "-std=c++17",
        "-O2",
        "-DFP8STATE_FP4_MATH_ONLY",
        "-Xcompiler",
        "-ffp-contract=off",
        "-I",
        str(source_dir()),
    ]
    subprocess.run(["nvcc", *flags, "-o", str(exe), str(CHECK)], check=True, capture_output=True, timeout=300)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all host checks passed" in run.stdout
