"""Trainer(accelerator="cpu", devices=2, strategy="fp8state_fsdp"): FSDP2 with FP8 all-gather (gloo).

One plan of fits runs in one pair of processes (``tests/lightning/scenarios.py``); each rank
records what it saw. The model is the BoringModel with checkpointed blocks: the strategy makes
each block an FSDP2 unit (and the root one more), converts nothing itself (the callback does)
and gathers every converted weight in FP8. Rank 1's data is 8x louder than rank 0's.
"""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state.lightning.callback import check_resume_world_size
from tests.lightning.launch import run_plan
from tests.lightning.test_ddp import bitwise, ranks

BATCHES_PER_EPOCH = 8  # 32 samples, batch 2, 2 ranks
EPOCHS = 2
N_OWNERS = 6 * 3  # inp, 2 blocks x (fc1, fc2), head; x (input, weight, grad_output)
FSDP = {"strategy": "fp8state_fsdp", "accumulate": 1, "max_epochs": EPOCHS}

PLAN = [
    {**FSDP, "name": "fsdp"},
    {**FSDP, "name": "fsdp_interrupted", "save_at": [[0, 4, "fsdp_step.ckpt"]], "stop_after_save": True},
    {**FSDP, "name": "fsdp_resumed", "resume_from": "fsdp_step.ckpt"},
    {**FSDP, "name": "fsdp_bf16_gather", "strategy_kwargs": {"fp8_all_gather": False}, "max_epochs": 1},
    {**FSDP, "name": "fsdp_current", "config": {"recipe": "fp8_current"}, "max_epochs": 1},
    # fused AdamW: its step on the local shards (the default) against DTensor's dispatch
    {**FSDP, "name": "fsdp_adamw", "optimizer": "adamw", "max_epochs": 1},
    {
        **FSDP,
        "name": "fsdp_adamw_dtensor",
        "optimizer": "adamw",
        "max_epochs": 1,
        "strategy_kwargs": {"local_optimizer_step": False},
    },
]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("fsdp")
    run_plan(PLAN, path, timeout=420)
    return path


@pytest.mark.parametrize("name", ["fsdp", "fsdp_bf16_gather"])
def test_recompute_bit_identical_one_commit_per_owner_per_event(out, name):
    epochs = EPOCHS if name == "fsdp" else 1
    for r, d in enumerate(ranks(out, name)):
        assert d["rank"] == r and d["world_size"] == 2 and d["strategy"] == "Fp8StateFSDPStrategy"
        assert d["audit_ok"] and d["audit_recomputed"] > 0, f"rank {r}:\n{d['audit_table']}"
        assert d["owner_ranks"] == [r] and len(d["owners"]) == N_OWNERS  # per layer x role x rank
        assert d["events"] == [(s, 0) for s in range(BATCHES_PER_EPOCH * epochs)]
        for event, rows in d["per_event"].items():
            assert len(rows) == N_OWNERS and all(c == 1 for c, _, _ in rows.values()), event
        assert d["violations"] == 0
        assert len(d["fp8_gathered"]) == (6 if name == "fsdp" else 0)
        assert d["collectives"] == BATCHES_PER_EPOCH * epochs  # one amax all-reduce per event


@pytest.mark.parametrize("name", ["fsdp", "fsdp_bf16_gather"])
def test_weight_scales_identical_on_both_ranks_input_scales_not(out, name):
    a, b = ranks(out, name)
    weights = [k for k in a["scales"] if k.endswith(".weight")]
    assert len(weights) == 6
    assert all(a["scales"][k] == b["scales"][k] for k in weights)
    assert a["scales"]["inp#0.input"] != b["scales"]["inp#0.input"]  # rank 1's data is louder, not reduced


def test_resume_from_a_sharded_checkpoint_continues_bit_identically(out):
    for whole, resumed in zip(ranks(out, "fsdp"), ranks(out, "fsdp_resumed"), strict=True):
        assert resumed["global_step"] == whole["global_step"] == BATCHES_PER_EPOCH * EPOCHS
        assert whole["params"].keys() == resumed["params"].keys()
        for k, v in whole["params"].items():
            assert bitwise(v, resumed["params"][k]), k
        assert len(whole["momentum"]) == len(resumed["momentum"]) > 0
        assert all(bitwise(a, b) for a, b in zip(whole["momentum"], resumed["momentum"], strict=True))
        for k in ("amax_history", "scale", "descale"):
            assert bitwise(whole["bank"][k], resumed["bank"][k]), k
        assert whole["bank"]["owners"] == resumed["bank"]["owners"]
        assert whole["clock_last"] == resumed["clock_last"]


def test_checkpoint_is_sharded_and_holds_every_ranks_quantizer_state(out):
    path = out / "fsdp_step.ckpt"
    assert path.is_dir() and (path / ".metadata").is_file()
    shards = sorted(p.name for p in path.glob("*.distcp"))
    assert len(shards) == 2, shards  # one file per rank
    meta = torch.load(path / "meta.pt", weights_only=True)  # plain tensors and numbers only
    entry = meta["fp8state"]
    assert entry["world_size"] == 2 and sorted(entry["ranks"]) == [0, 1]
    for r, sd in entry["ranks"].items():
        assert sd["rank"] == r and {o[2] for o in sd["bank"]["owners"]} == {r}
    # the interrupted run was stopped after 5 optimizer steps: the histories hold those
    assert meta["global_step"] == 5


def test_a_resume_on_another_world_size_is_checked_against_the_merge_rule_before_loading(out):
    entry = torch.load(out / "fsdp_step.ckpt" / "meta.pt", weights_only=True)["fp8state"]
    with pytest.raises(f8s.StateLoadError, match=r"2 rank\(s\) cannot be mapped onto 1: .*differ per rank"):
        check_resume_world_size(entry, 1, True, "refuse")
    report = check_resume_world_size(entry, 1, True, "max")
    assert (report.saved_world, report.world) == (2, 1) and report.merged
    assert {n.rsplit(".", 1)[1] for n in report.copied} == {"weight"}  # MAX-reduced over the shard group
    assert check_resume_world_size(entry, 1, False, "refuse") is None  # evaluation reads rank r mod 2
    assert check_resume_world_size(entry, 2, True, "refuse") is None


def test_a_one_rank_resume_the_merge_rule_forbids_is_refused_before_loading(out, tmp_path):
    """The real path: ``Trainer(devices=1, strategy="fp8state_fsdp").fit(ckpt_path=<the two-rank
    sharded checkpoint>)`` with ``world_size_merge="refuse"`` stops in the strategy's
    load_checkpoint, before the weights are loaded (with ``max`` it trains on:
    tests/cli/test_resume_world_size_fsdp.py)."""
    plan = [
        {
            **FSDP,
            "name": "one_rank",
            "devices": 1,
            "resume_from": str(out / "fsdp_step.ckpt"),
            "config": {"world_size_merge": "refuse"},
        }
    ]
    done = run_plan(plan, tmp_path, check=False)
    assert done.returncode != 0
    assert "WorldSizeMergeError" in done.stderr and "2 rank(s) cannot be mapped onto 1" in done.stderr
    assert "lightning/fsdp.py" in done.stderr  # raised by the strategy, before the DCP load


def test_fp8_current_gathers_fp8_under_the_lightning_strategy(out):
    """quant.recipe=fp8_current through Trainer(strategy="fp8state_fsdp"): every converted weight
    all-gathered in FP8 at the full weight's scale (issue 28), recompute bitwise (audited), one
    ledger commit per owner per event, and both ranks end with the same weights."""
    a, b = ranks(out, "fsdp_current")
    for r, d in enumerate((a, b)):
        assert d["audit_ok"] and d["audit_recomputed"] > 0, f"rank {r}:\n{d['audit_table']}"
        assert d["owners"] == []  # stateless: nothing in the bank
        assert d["events"] == [(s, 0) for s in range(BATCHES_PER_EPOCH)]
        for event, rows in d["per_event"].items():
            assert len(rows) == N_OWNERS and all(c == 1 for c, _, _ in rows.values()), event
        assert d["violations"] == 0
        assert len(d["fp8_gathered"]) == 6
    assert all(bitwise(a["params"][k], b["params"][k]) for k in a["params"])


@pytest.mark.parametrize("name", ["fsdp", "fsdp_bf16_gather"])
def test_the_strategy_marks_every_converted_layer_sharded(out, name):
    """fp8state_fsdp marks each converted layer in an FSDP2 unit (every one: the root is a unit
    too), so no call holds its gathered weight's codes from the forward to the recompute."""
    for d in ranks(out, name):
        assert len(d["sharded_layers"]) == 6 and set(d["fp8_gathered"]) <= set(d["sharded_layers"])


def test_adamw_steps_on_the_local_shards_bitwise_the_dtensor_step(out):
    """The strategy makes AdamW step on each rank's local shards (no DTensor dispatch over every
    tensor: host time a step); weights and moments are bitwise those of the DTensor step."""
    local, dtensor = ranks(out, "fsdp_adamw"), ranks(out, "fsdp_adamw_dtensor")
    for a, b in zip(local, dtensor, strict=True):
        assert a["local_step"] is True and b["local_step"] is False
        assert a["global_step"] == b["global_step"] == BATCHES_PER_EPOCH
        assert len(a["adam_moments"]) == 2 * len([k for k in a["params"] if "frozen" not in k])
        for x, y in zip(a["adam_moments"], b["adam_moments"], strict=True):
            assert bitwise(x, y)
        assert a["params"].keys() == b["params"].keys()
        for k in a["params"]:
            assert bitwise(a["params"][k], b["params"][k]), k
