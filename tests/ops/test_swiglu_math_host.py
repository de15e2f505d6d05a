"""The SwiGLU kernels' float32 math (``csrc/swiglu_math.cuh``: the exponential, ``silu(g) * u``
and its gradients), compiled for the host, against the CPU reference
(``ops/reference_swiglu.py``) bit for bit, on float32 values of every binade (a stride through
all bit patterns), the edges of the exponential's range and the special values.

Needs ``nvcc`` (no GPU): skipped with a reason where it is missing. The kernels themselves are
checked against the reference on the GPU by ``test_cuda_rms_swiglu.py``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_fp8state.ops import reference_swiglu as ref

CHECK = Path(__file__).with_name("swiglu_math_host_check.cu")

EDGES = [
    0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-45, 1.17549435e-38, -1.17549435e-38,
    88.72283, 88.72284, 88.7, 89.0, 89.5, -88.72283, -87.33654, -87.33655, -100.0, -103.27893, -103.97208,
    -103.97209, -104.0, -104.5, 0.34657359, -0.34657359, 1.0397208, 0.5, -0.5, 1.0, -1.0, 20.0, -20.0,
]  # fmt: skip


def gate_values() -> torch.Tensor:
    """Every 4093rd float32 bit pattern (all binades, both signs, NaNs and infinities among
    them), the edges above and a dense sweep of the range where silu changes shape."""
    stride = np.arange(0, 2**32, 4093, dtype=np.uint64).astype(np.uint32).view(np.float32)
    sweep = np.linspace(-110.0, 95.0, 200_001, dtype=np.float32)
    return torch.from_numpy(np.concatenate([stride, sweep, np.array(EDGES, dtype=np.float32)]))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal bits, any NaN equal to any NaN."""
    both_nan = torch.isnan(a) & torch.isnan(b)
    return both_nan | (a.view(torch.int32) == b.view(torch.int32))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (host-only compile of csrc/swiglu_math.cuh)")
def test_swiglu_math_on_the_host_is_the_reference_bitwise(tmp_path):
    from lightning_fp8state.ops.cuda import source_dir  # the csrc/ of the imported package

    exe = tmp_path / "swiglu_math_host_check"
    flags = ["-std=c++17", "-O2", "-Xcompiler", "-ffp-contract=off", "-I", str(source_dir())]
    subprocess.run(["nvcc", *flags, "-o", str(exe), str(CHECK)], check=True, capture_output=True, timeout=300)
    g = gate_values()
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(g.shape, generator=gen) * torch.exp2(torch.randint(-20, 20, g.shape, generator=gen).float())
    dy = torch.randn(g.shape, generator=gen)
    records = torch.stack([g, u, dy], dim=-1).contiguous()
    (tmp_path / "in.bin").write_bytes(records.numpy().tobytes())
    run = subprocess.run(
        [str(exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    out = torch.from_numpy(np.fromfile(tmp_path / "out.bin", dtype=np.float32).reshape(-1, 5))
    h = torch.stack([g, u], dim=-1)
    grads = ref.swiglu_backward_reference(dy[:, None], h)
    want = {
        "exp(g)": ref.exp_f32(g),
        "silu(g) * u": ref.swiglu_f32(h)[:, 0],
        "dg": grads[:, 0],
        "du": grads[:, 1],
        "exp(-g)": ref.exp_f32(-g),
    }
    for column, (name, expected) in enumerate(want.items()):
        ok = same_bits(out[:, column], expected)
        bad = (~ok).nonzero().flatten()[:5].tolist()
        assert ok.all(), f"{name}: {int((~ok).sum())} of {len(g)} differ, e.g. g={[g[i].item() for i in bad]}"
