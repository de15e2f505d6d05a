"""fp8state_deepspeed on one and two GPUs (written for H200s): ZeRO-2, activation
checkpointing routed through lightning_fp8state.checkpoint, bf16-mixed.

The same checks as the CPU DDP tests: forward vs recompute bit-identical on each rank, one
commit per owner per event per rank, amax reduction on/off (two GPUs), mid-epoch resume
bit-identical at an optimizer-step boundary and inside an accumulation window (the strategy
saves each rank's ZeRO-2 gradient partition and the engine's micro-step counter; with bf16
and with fp32 gradient accumulation), the control without that window differing. Plus a
ZeRO-1 and a ZeRO-3 smoke run on one GPU.

Run: ``python -m pytest -q tests/gpu -m gpu`` (skipped with a reason without CUDA).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_fp8state.lightning.deepspeed_accumulation import ACCUMULATION_KEY, rank_file
from tests.lightning.launch import load_ranks, run_plan
from tests.lightning.test_ddp import ACCUMULATE, N_OWNERS, bitwise, by_role, expected_events

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (written for H200s)"),
]

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

# ZeRO-2 with DeepSpeed's activation checkpointing features on: the blocks call
# lightning_fp8state.checkpoint(block, x) without an engine, and the strategy routes it to
# deepspeed.checkpointing.checkpoint (partitioned activations, CPU checkpointing).
ZERO2 = {
    "accelerator": "cuda",
    "strategy": "fp8state_deepspeed",
    "strategy_kwargs": {"stage": 2, "partition_activations": True, "cpu_checkpointing": True},
    "precision": "bf16-mixed",
    "ckpt": "f8s_default",
    # 24 samples: 12 batches per epoch on one GPU, 6 on two; both multiples of the 3
    # accumulated batches. (With DeepSpeed, Lightning does not step on an epoch's short last
    # window and DeepSpeed counts its own accumulation boundaries across epochs.)
    "samples": 24,
}
SAMPLES = 24


def plan(devices: int) -> list[dict]:
    runs = [
        {**ZERO2, "devices": devices, "name": "uninterrupted"},
        {
            **ZERO2,
            "devices": devices,
            "name": "interrupted",
            "save_at": [[0, 2, "step.ckpt"], [1, 2, "step1.ckpt"]],
            "stop_after_save": True,
        },
        {**ZERO2, "devices": devices, "name": "resume_step", "resume_from": "step.ckpt"},
        {**ZERO2, "devices": devices, "name": "resume_step1", "resume_from": "step1.ckpt"},
    ]
    if devices == 2:
        runs += [
            {
                **ZERO2,
                "devices": 2,
                "name": "reduce_all",
                "config": {"amax_reduction": "data_parallel"},
                "frozen": True,
            },
            {**ZERO2, "devices": 2, "name": "reduce_none", "config": {"amax_reduction": "none"}, "frozen": True},
        ]
    else:
        for stage in (1, 3):
            kwargs = {"stage": stage, "partition_activations": True, "cpu_checkpointing": True}
            runs.append({**ZERO2, "devices": 1, "name": f"stage{stage}", "strategy_kwargs": kwargs, "max_epochs": 1})
    return runs


@pytest.fixture(scope="module", params=[1, pytest.param(2, marks=two_gpus)], ids=["1gpu", "2gpu"])
def world(request, tmp_path_factory):
    devices = request.param
    if torch.cuda.device_count() < devices:
        pytest.skip(f"needs {devices} CUDA GPUs")
    out = tmp_path_factory.mktemp(f"deepspeed{devices}")
    run_plan(plan(devices), out, timeout=900)
    return devices, out


def test_forward_and_recompute_bit_identical_on_each_rank(world):
    devices, out = world
    for r, d in enumerate(load_ranks(out, "uninterrupted", devices)):
        assert d["strategy"] == "Fp8StateDeepSpeedStrategy" and d["device"].startswith("cuda")
        assert d["world_size"] == devices and d["rank"] == r
        assert d["audit_ok"], f"rank {r}:\n{d['audit_table']}"
        # routed to DeepSpeed's engine (reentrant, no early stop): fc1 and fc2 of both blocks re-run
        assert d["audit_recomputed"] == 4 * len(d["events"])
        assert d["violations"] == 0


def test_exactly_one_commit_per_owner_per_event_per_rank(world):
    devices, out = world
    batches = SAMPLES // (2 * devices)
    events = expected_events(batches, ACCUMULATE, 2)
    for r, d in enumerate(load_ranks(out, "uninterrupted", devices)):
        assert d["events"] == events
        assert d["owner_ranks"] == [r] and len(d["owners"]) == N_OWNERS
        for event in events:
            per_owner = d["per_event"][event]
            assert len(per_owner) == N_OWNERS
            assert set(per_owner.values()) == {(1, 1, 0)}, (r, event)


@pytest.mark.parametrize("name", ["resume_step", "resume_step1"])
def test_resume_mid_epoch_at_a_step_boundary_is_bit_identical(world, name):
    devices, out = world
    for r, (u, d) in enumerate(
        zip(load_ranks(out, "uninterrupted", devices), load_ranks(out, name, devices), strict=True)
    ):
        # DeepSpeed keeps its optimizer state to itself: compare parameters and quantizer state
        for k in u["params"]:
            assert bitwise(u["params"][k], d["params"][k]), f"{name} rank {r}: {k}"
        for k in ("amax_history", "scale", "descale"):
            assert bitwise(u["bank"][k], d["bank"][k]), f"{name} rank {r}: bank {k}"
        assert u["total_commits"] == d["total_commits"] and u["clock_last"] == d["clock_last"]


def test_reduction_on_and_off_across_two_gpus(world):
    devices, out = world
    if devices != 2:
        pytest.skip("reduction needs two ranks")
    a, b = load_ranks(out, "reduce_all", 2)
    assert a["scales"] == b["scales"]
    assert a["collectives"] == b["collectives"] == 2 * len(a["events"])
    a, b = load_ranks(out, "reduce_none", 2)
    assert a["scales"]["frozen#0.weight"] != b["scales"]["frozen#0.weight"]
    ia, ib = by_role(a["scales"], "input"), by_role(b["scales"], "input")
    assert all(ia[k] != ib[k] for k in ia)


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_stage_smoke_on_one_gpu(world, stage):
    devices, out = world
    if devices != 1:
        pytest.skip("one-GPU smoke run")
    (d,) = load_ranks(out, f"stage{stage}", 1)
    assert d["audit_ok"], d["audit_table"]
    assert d["audit_recomputed"] == 4 * len(d["events"])
    assert all(set(per.values()) == {(1, 1, 0)} for per in d["per_event"].values())


# -- resume inside a gradient-accumulation window (issue #5) -------------------------------
# accumulate_grad_batches=4 and 32 samples: 16 batches per epoch on one GPU, 8 on two, both
# multiples of 4, so Lightning's windows and DeepSpeed's micro-step boundaries coincide.
# Checkpoints are written after microbatch 2 of a window: batch 5 of epoch 0 (the second
# window, after one optimizer step) and batch 1 of epoch 1; "lost" is written at the same
# point with save_accumulated_grads=False (the control: the window's gradients are dropped).
MID_ACCUMULATE = 4
MID = {**ZERO2, "accumulate": MID_ACCUMULATE, "samples": 32}
# The same, with the window accumulated in fp32 beside bf16 parameters (DeepSpeed's compact
# fp32 gradient partition instead of per-parameter bf16 tensors). A DeepSpeed config replaces
# Lightning's defaults, so its ZeRO-2 settings are Lightning's defaults written out.
FP32_ACCUMULATION = {
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {
        "stage": 2,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "allgather_partitions": True,
        "reduce_scatter": True,
        "allgather_bucket_size": 200_000_000,
        "reduce_bucket_size": 200_000_000,
    },
    "data_types": {"grad_accum_dtype": "fp32"},
    "activation_checkpointing": {
        "partition_activations": True,
        "cpu_checkpointing": True,
        "contiguous_memory_optimization": False,
        "synchronize_checkpoint_boundary": False,
    },
}
GRAD_ACCUMULATION = {
    "bf16": {},
    "fp32": {"strategy_kwargs": {"config": FP32_ACCUMULATION}},
}


def mid_window_plan(devices: int, accumulation: str) -> list[dict]:
    base = {**MID, **GRAD_ACCUMULATION[accumulation], "devices": devices}
    return [
        {**base, "name": "uninterrupted"},
        {
            **base,
            "name": "interrupted",
            "save_at": [[0, 5, "mid.ckpt"], [1, 1, "mid1.ckpt"], [1, 1, "lost.ckpt", False]],
            "stop_after_save": True,
        },
        {**base, "name": "resume_mid", "resume_from": "mid.ckpt"},
        {**base, "name": "resume_mid1", "resume_from": "mid1.ckpt"},
        {**base, "name": "resume_lost", "resume_from": "lost.ckpt"},
    ]


@pytest.fixture(
    scope="module",
    params=[
        (1, "bf16"),
        (1, "fp32"),
        pytest.param((2, "bf16"), marks=two_gpus),
        pytest.param((2, "fp32"), marks=two_gpus),
    ],
    ids=["1gpu-bf16acc", "1gpu-fp32acc", "2gpu-bf16acc", "2gpu-fp32acc"],
)
def mid_window(request, tmp_path_factory):
    devices, accumulation = request.param
    if torch.cuda.device_count() < devices:
        pytest.skip(f"needs {devices} CUDA GPUs")
    out = tmp_path_factory.mktemp(f"deepspeed_mid{devices}_{accumulation}")
    run_plan(mid_window_plan(devices, accumulation), out, timeout=900)
    return devices, out


def client_state(ckpt: Path) -> dict:
    """The Lightning checkpoint dict DeepSpeed wrote as client state (rank 0's model states file)."""
    return torch.load(ckpt / "checkpoint" / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)


@pytest.mark.parametrize("name", ["mid.ckpt", "mid1.ckpt", "lost.ckpt"])
def test_a_mid_window_checkpoint_records_the_engine_window(mid_window, name):
    devices, out = mid_window
    entry = client_state(out / name)[ACCUMULATION_KEY]
    assert entry["mid_window"] and entry["micro_steps"] % MID_ACCUMULATE == 2
    assert entry["gradient_accumulation_steps"] == MID_ACCUMULATE and entry["world_size"] == devices
    assert entry["unsupported"] is None
    saved = name != "lost.ckpt"
    assert entry["grads"] == ("saved" if saved else "lost")
    for r in range(devices):
        assert Path(rank_file(str(out / name), r)).is_file() == saved, (name, r)
    # the callback leaves the window to the strategy: nothing of its own is marked lost
    assert client_state(out / name)["fp8state"]["accumulation_lost"] is False


@pytest.mark.parametrize("name", ["resume_mid", "resume_mid1"])
def test_resume_inside_an_accumulation_window_is_bit_identical(mid_window, name):
    devices, out = mid_window
    for r, (u, d) in enumerate(
        zip(load_ranks(out, "uninterrupted", devices), load_ranks(out, name, devices), strict=True)
    ):
        assert u["global_step"] == d["global_step"] == 2 * (32 // (2 * devices)) // MID_ACCUMULATE
        assert u["engine_micro_steps"] == d["engine_micro_steps"], f"{name} rank {r}"
        for k in u["params"]:
            assert bitwise(u["params"][k], d["params"][k]), f"{name} rank {r}: {k}"
        for k in ("amax_history", "scale", "descale"):
            assert bitwise(u["bank"][k], d["bank"][k]), f"{name} rank {r}: bank {k}"
        assert u["total_commits"] == d["total_commits"] and u["clock_last"] == d["clock_last"]
        assert d["violations"] == 0


def test_resume_without_the_window_is_not_exact(mid_window):
    """The control: the same resume without the saved gradients ends elsewhere, so the test
    above can fail. The engine's micro-step counter is restored all the same."""
    devices, out = mid_window
    for r, (u, d) in enumerate(
        zip(load_ranks(out, "uninterrupted", devices), load_ranks(out, "resume_lost", devices), strict=True)
    ):
        assert u["global_step"] == d["global_step"] and u["engine_micro_steps"] == d["engine_micro_steps"]
        assert not all(bitwise(u["params"][k], d["params"][k]) for k in u["params"]), f"rank {r}"
