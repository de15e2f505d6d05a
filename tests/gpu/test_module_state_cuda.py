"""tests/unit/test_module_state.py on the GPU (issue 27): BatchNorm's running statistics after N
checkpointed steps bitwise those of the plain run, with the CUDA kernels and torch._scaled_mm
under bf16 autocast, under torch non-reentrant, torch reentrant, DeepSpeed and SAC; the same
scenario and code path as the CPU test."""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from tests.conftest import bitwise_equal
from tests.unit.test_module_state import ENGINES, STEPS, assert_buffers_bitwise, train, wrapper

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def plain():
    assert f8s.ops.cuda.ensure_loaded(), f8s.ops.cuda.extension_info()
    return train(None, device="cuda", autocast=True)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_batchnorm_statistics_on_cuda_equal_the_uncheckpointed_run_bitwise(plain, engine):
    if engine == "deepspeed":
        pytest.importorskip("deepspeed", reason="deepspeed not installed on this machine")
    ref, ref_grads = plain
    got, grads = train(wrapper(**ENGINES[engine]), device="cuda", autocast=True)
    assert int(got.blocks[0].bn.num_batches_tracked) == STEPS
    assert_buffers_bitwise(ref, got)
    for step, (a, b) in enumerate(zip(ref_grads, grads, strict=True)):
        assert all(bitwise_equal(a[n], b[n]) for n in a), step


def test_restore_buffers_false_counts_twice_on_cuda(plain):
    got, _ = train(wrapper(restore_buffers=False, engine="torch", use_reentrant=False), device="cuda", autocast=True)
    assert int(got.blocks[0].bn.num_batches_tracked) == 2 * STEPS
