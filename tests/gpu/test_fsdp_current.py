"""FSDP2 with FP8 all-gather under ``quant.recipe=fp8_current`` on two GPUs (NCCL, the CUDA
kernels): the checks of ``tests/distributed/test_fsdp_current.py`` against CUDA runs. On the GPU
the unsharded run's weight scale comes from the ``quantize_fp8_current`` kernel (the scale
derived on the device), the sharded run's from ``Fp8Current.gather_scales`` (the reference
formula on the all-reduced amaxes): the bitwise checks compare the two.

Written without a GPU at hand (issue 28): not yet run. Run: ``python -m pytest -q
tests/gpu/test_fsdp_current.py -m gpu`` on a machine with two GPUs (skipped with a reason
otherwise).
"""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from tests.distributed.test_fsdp_current import run_pair
from tests.distributed.test_fsdp_current import (
    test_each_shard_is_encoded_at_the_full_weights_scale_not_its_own as test_cuda_full_weight_scale,
)
from tests.distributed.test_fsdp_current import (
    test_recompute_reads_the_forward_bytes_and_the_rules_hold as test_cuda_recompute_and_rules,
)
from tests.distributed.test_fsdp_current import (
    test_sharded_fp8_gather_trains_bitwise_as_the_unsharded_run as test_cuda_sharded_equals_unsharded,
)
from tests.distributed.test_fsdp_current import (
    test_the_all_gather_is_fp8_and_the_scales_take_one_all_reduce_per_event as test_cuda_fp8_bytes_one_all_reduce,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA GPUs (FSDP2 over NCCL)",
    ),
]

__all__ = [  # the shared checks, collected here against the CUDA runs below
    "test_cuda_full_weight_scale",
    "test_cuda_fp8_bytes_one_all_reduce",
    "test_cuda_recompute_and_rules",
    "test_cuda_sharded_equals_unsharded",
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    assert f8s.ops.cuda.ensure_loaded(), f8s.ops.cuda.extension_info()  # build once, before the workers
    return run_pair(tmp_path_factory.mktemp("fsdp_current_cuda"), "cuda", timeout=600)
