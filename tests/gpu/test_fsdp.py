"""FSDP2 with FP8 all-gather at the delayed scale on two GPUs (written for two H200s): NCCL,
``torch._scaled_mm`` and the CUDA kernels.

The same scenarios and checks as on the CPU (gloo), run on CUDA:

- ``tests/distributed/test_fsdp.py`` (plain ``fully_shard``, no Lightning): the gathered FP8
  weight is bitwise the full weight quantized at the frozen scale and bitwise the unsharded
  run's (which runs on GPU 0 of rank 0's process), the backward re-gather gives the forward's
  bytes, one byte an element on the wire, one all-reduce per steady event, the same weight scale
  on both ranks, one commit per owner per event, the refusals. Events 2 and 3 of each FSDP run
  (forward, backward, optimizer step) run under ``torch.cuda.set_sync_debug_mode("error")``: a
  host sync anywhere in them raises in the worker and fails the run.
- ``tests/lightning/test_fsdp.py`` (``Trainer(strategy="fp8state_fsdp")``, bf16-mixed): audit,
  commits, scales, sharded checkpoint, resume bit-identical.

Run: ``python -m pytest -q tests/gpu/test_fsdp.py -m gpu`` on a machine with two GPUs (skipped
with a reason otherwise). The first run builds the CUDA extension (minutes).
"""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from tests.distributed.test_fsdp import N_EVENTS, run_pair
from tests.distributed.test_fsdp import (
    test_all_gather_sends_one_byte_per_weight_element as test_cuda_all_gather_sends_one_byte_per_weight_element,
)
from tests.distributed.test_fsdp import (
    test_backward_regather_gives_the_forward_bytes as test_cuda_backward_regather_gives_the_forward_bytes,
)
from tests.distributed.test_fsdp import (
    test_gathered_fp8_weight_is_the_full_weight_quantized_at_the_frozen_scale as test_cuda_gathered_fp8_weight_is_exact,
)
from tests.distributed.test_fsdp import (
    test_one_all_reduce_per_event_and_the_same_weight_scale_on_every_rank as test_cuda_one_all_reduce_per_event,
)
from tests.distributed.test_fsdp import (
    test_ownership_per_rank_and_one_commit_per_owner_per_event as test_cuda_ownership_and_commits,
)
from tests.distributed.test_fsdp import (
    test_sharded_run_equals_the_unsharded_run_bitwise as test_cuda_sharded_run_equals_the_unsharded_run_bitwise,
)
from tests.distributed.test_fsdp import test_unsupported_uses_fail_closed as test_cuda_unsupported_uses_fail_closed
from tests.lightning.launch import run_plan
from tests.lightning.test_fsdp import PLAN
from tests.lightning.test_fsdp import (
    test_checkpoint_is_sharded_and_holds_every_ranks_quantizer_state as test_cuda_lightning_checkpoint_is_sharded,
)
from tests.lightning.test_fsdp import (
    test_recompute_bit_identical_one_commit_per_owner_per_event as test_cuda_lightning_recompute_and_commits,
)
from tests.lightning.test_fsdp import (
    test_resume_from_a_sharded_checkpoint_continues_bit_identically as test_cuda_lightning_resume_bit_identical,
)
from tests.lightning.test_fsdp import (
    test_weight_scales_identical_on_both_ranks_input_scales_not as test_cuda_lightning_weight_scales,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA GPUs (FSDP2 over NCCL; written for two H200s)",
    ),
]

__all__ = [  # the shared checks, collected here against the CUDA runs below
    "test_cuda_all_gather_sends_one_byte_per_weight_element",
    "test_cuda_backward_regather_gives_the_forward_bytes",
    "test_cuda_gathered_fp8_weight_is_exact",
    "test_cuda_lightning_checkpoint_is_sharded",
    "test_cuda_lightning_recompute_and_commits",
    "test_cuda_lightning_resume_bit_identical",
    "test_cuda_lightning_weight_scales",
    "test_cuda_one_all_reduce_per_event",
    "test_cuda_ownership_and_commits",
    "test_cuda_sharded_run_equals_the_unsharded_run_bitwise",
    "test_cuda_unsupported_uses_fail_closed",
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    assert f8s.ops.cuda.ensure_loaded(), f8s.ops.cuda.extension_info()  # build once, before the workers
    return run_pair(tmp_path_factory.mktemp("fsdp_cuda"), "cuda", timeout=600)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("fsdp_lightning_cuda")
    run_plan([{**spec, "accelerator": "cuda", "precision": "bf16-mixed"} for spec in PLAN], path, timeout=600)
    return path


def test_the_runs_used_cuda_the_kernels_scaled_mm_and_no_host_sync(ranks):
    """The quantizer state lived on each rank's GPU, the CUDA extension served the ops, the
    GEMMs could use _scaled_mm, and the sync-checked events ran (a sync would have raised)."""
    for r, d in enumerate(ranks):
        assert d["cuda_kernels"], f"rank {r}: the CUDA extension was not loaded"
        for name in ("same", "loud"):
            assert d[name]["bank_device"] == f"cuda:{r}", (name, d[name]["bank_device"])
            assert d[name]["sync_checked"] == N_EVENTS - 2
    assert f8s.nn.scaled_mm_available(torch.device("cuda", 0)), "no FP8 _scaled_mm on this GPU (needs sm_89+)"
