"""FSDP2 with FP8 all-gather under ``quant.recipe=fp8_blockwise`` on two GPUs (NCCL, the CUDA
block kernels, the block-scaled ``torch._scaled_mm``): the checks of
``tests/distributed/test_fsdp_blockwise.py`` against CUDA runs. Each rank's shard is encoded by
the block kernel on its own rows; the single-process run encodes the full weight: the bitwise
checks compare the two, and the input gradient's GEMM on the gathered codes (row-major) with
the one on the transposed encode (column-major).

Written without a GPU at hand (issue 45): not yet run. Run: ``python -m pytest -q
tests/gpu/test_fsdp_blockwise.py -m gpu`` on a machine with two GPUs (skipped with a reason
otherwise).
"""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from tests.distributed.test_fsdp_blockwise import run_pair
from tests.distributed.test_fsdp_blockwise import (
    test_aligned_shards_send_fp8_codes_with_their_block_scales as test_cuda_aligned_shards_send_fp8_blocks,
)
from tests.distributed.test_fsdp_blockwise import (
    test_sharded_run_trains_bitwise_as_the_single_process as test_cuda_sharded_equals_single_process,
)
from tests.distributed.test_fsdp_blockwise import (
    test_unaligned_shards_gather_in_high_precision_and_say_so_once as test_cuda_unaligned_shards_high_precision,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA GPUs (FSDP2 over NCCL)",
    ),
]

__all__ = [  # the shared checks, collected here against the CUDA runs below
    "test_cuda_aligned_shards_send_fp8_blocks",
    "test_cuda_sharded_equals_single_process",
    "test_cuda_unaligned_shards_high_precision",
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    assert f8s.ops.cuda.ensure_loaded(), f8s.ops.cuda.extension_info()  # build once, before the workers
    return run_pair(tmp_path_factory.mktemp("fsdp_blockwise_cuda"), "cuda", timeout=600)


def test_cuda_the_runs_used_the_kernels_and_the_block_scaled_gemm(ranks):
    """Both ranks ran the CUDA extension, and this torch has the block-scaled GEMM the recipe
    uses for fc1 (else the bitwise checks compared emulations only)."""
    from lightning_fp8state.quant_recipes.blockwise import _cuda_blockwise

    assert all(d["cuda_kernels"] for d in ranks), "the CUDA extension did not load in the workers"
    assert _cuda_blockwise(), f"torch {torch.__version__} (CUDA {torch.version.cuda}) lacks the block-scaled GEMM"
