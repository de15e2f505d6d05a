"""The allowlist of checkpoint files (state/checkpoint_files.py) admits what DeepSpeed and torch
distributed checkpoint really write: refusing a real shard would break every resume of those
strategies. DeepSpeed's objects are built here on the CPU as its engine builds them."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_fp8state.errors import UntrustedCheckpointError
from lightning_fp8state.state.checkpoint_files import check_checkpoint, load_checkpoint_file


def test_a_deepspeed_shard_with_its_config_loads_and_only_with_the_allowlist(tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    ds_config = DeepSpeedConfig(
        {
            "train_micro_batch_size_per_gpu": 4,
            "zero_optimization": {"stage": 2, "overlap_comm": True},
            "bf16": {"enabled": True},
            "activation_checkpointing": {"partition_activations": False},
        }
    )
    shard = tmp_path / "last.ckpt" / "checkpoint"
    shard.mkdir(parents=True)
    torch.save(
        {"module": {"w": torch.ones(2)}, "ds_config": ds_config, "param_shapes": [{"w": torch.Size([2])}]},
        shard / "mp_rank_00_model_states.pt",
    )
    optim = {
        "loss_scaler": CreateLossScaler(torch.bfloat16, 1.0, False, None),
        "zero_stage": ZeroStageEnum.gradients,
        "param_slice_mappings": [{"w": fragment_address(numel=2, start=0)}],
    }
    torch.save(
        {"optimizer_state_dict": optim, "ds_config": ds_config}, shard / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    )
    check_checkpoint(tmp_path / "last.ckpt")  # a DeepSpeed directory: its types are allowed
    with pytest.raises(UntrustedCheckpointError, match="deepspeed.runtime.config.DeepSpeedConfig"):
        load_checkpoint_file(shard / "mp_rank_00_model_states.pt")  # not without the allowlist


def test_a_distributed_checkpoint_metadata_file_loads(tmp_path):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"state_dict": {"w": torch.randn(3, 2)}, "opt": {"betas": (0.9, 0.99)}}, checkpoint_id=str(tmp_path))
    torch.save({"global_step": 3}, tmp_path / "meta.pt")
    check_checkpoint(tmp_path)
