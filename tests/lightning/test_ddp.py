"""Trainer(accelerator="cpu", devices=2, strategy="fp8state_ddp") with checkpointed blocks.

One plan of fits runs in one pair of processes (gloo); each rank records what it saw and
the tests compare ranks and runs. Rank 1's data is 8x louder than rank 0's.
"""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from tests.lightning.launch import load_ranks, run_plan

BATCHES_PER_EPOCH = 8  # 32 samples, batch 2, 2 ranks
ACCUMULATE = 3
EPOCHS = 2
N_OWNERS = 6 * 3  # inp, 2 blocks x (fc1, fc2), head; x (input, weight, grad_output)

PLAN = [
    {"name": "uninterrupted"},  # default config: weights reduced across ranks
    {
        "name": "interrupted",
        "save_at": [
            [0, 2, "step.ckpt"],  # mid-epoch, right after an optimizer step
            [1, 4, "midacc.ckpt"],  # mid-epoch, inside an accumulation window (batches 3, 4 of 3..5)
            [1, 4, "midacc_nograds.ckpt", False],  # the same, without the accumulated gradients
        ],
        "stop_after_save": True,
    },
    {"name": "resume_step", "resume_from": "step.ckpt"},
    {"name": "resume_midacc", "resume_from": "midacc.ckpt"},
    {"name": "resume_midacc_nograds", "resume_from": "midacc_nograds.ckpt"},
    {"name": "reduce_all", "config": {"amax_reduction": "data_parallel"}, "frozen": True, "max_epochs": 1},
    {"name": "reduce_none", "config": {"amax_reduction": "none"}, "frozen": True, "max_epochs": 1},
    {"name": "deepspeed_ckpt", "ckpt": "plain_deepspeed", "precision": "bf16-mixed", "max_epochs": 1},
]


def expected_events(batches: int, accumulate: int, epochs: int) -> list[tuple[int, int]]:
    """Lightning's schedule: an optimizer step after every ``accumulate`` batches and after an
    epoch's last batch; an event is (optimizer steps so far, index in the window)."""
    events, step = [], 0
    for _ in range(epochs):
        for b in range(batches):
            events.append((step, b % accumulate))
            if (b + 1) % accumulate == 0 or b == batches - 1:
                step += 1
    return events


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("ddp")
    run_plan(PLAN, path, timeout=420)
    return path


def ranks(out, name):
    return load_ranks(out, name, 2)


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def by_role(scales: dict, role: str) -> dict:
    return {k: v for k, v in scales.items() if k.endswith("." + role)}


# -- protocol on each rank ----------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "recomputed_per_event"),
    [("uninterrupted", 4), ("reduce_all", 4), ("deepspeed_ckpt", 4)],
)
def test_forward_and_recompute_bit_identical_on_each_rank(out, name, recomputed_per_event):
    for r, d in enumerate(ranks(out, name)):
        assert d["rank"] == r and d["world_size"] == 2 and d["strategy"] == "Fp8StateDDPStrategy"
        assert d["audit_ok"], f"rank {r}:\n{d['audit_table']}"
        # every Linear's recompute is compared: under torch's non-reentrant early stop fc2's output
        # is never rebuilt, its quantized operands are (compared at the quantize)
        assert d["audit_recomputed"] == recomputed_per_event * len(d["events"])
        assert d["audit_mismatches"] == 0 and d["violations"] == 0


@pytest.mark.parametrize("name", ["uninterrupted", "deepspeed_ckpt"])
def test_exactly_one_commit_per_owner_per_event_per_rank(out, name):
    epochs = EPOCHS if name == "uninterrupted" else 1
    events = expected_events(BATCHES_PER_EPOCH, ACCUMULATE, epochs)
    for r, d in enumerate(ranks(out, name)):
        assert d["events"] == events, f"rank {r}"
        assert d["owner_ranks"] == [r]  # the rank is part of every owner key
        assert len(d["owners"]) == N_OWNERS
        for event in events:
            per_owner = d["per_event"][event]
            assert len(per_owner) == N_OWNERS, (r, event)
            for owner, (commits, observations, recompute_records) in per_owner.items():
                assert (commits, observations, recompute_records) == (1, 1, 0), (r, event, owner)
        assert set(d["total_commits"].values()) == {len(events)}


# -- amax reduction -----------------------------------------------------------------
def test_reduction_on_gives_identical_scales_on_every_rank(out):
    a, b = ranks(out, "reduce_all")
    assert a["scales"] == b["scales"]
    assert "frozen#0.weight" in a["scales"]
    # one collective per commit point: commit_forward and the event's end
    assert a["collectives"] == b["collectives"] == 2 * len(a["events"])


def test_reduction_off_leaves_each_rank_its_own_scales(out):
    a, b = ranks(out, "reduce_none")
    assert a["collectives"] is None and b["collectives"] is None
    # the frozen layer's weight differs per rank (perturbed after DDP's broadcast)
    assert a["scales"]["frozen#0.weight"] != b["scales"]["frozen#0.weight"]
    ia, ib = by_role(a["scales"], "input"), by_role(b["scales"], "input")
    assert all(ia[k] != ib[k] for k in ia)  # rank 1's data is 8x louder
    ga, gb = by_role(a["scales"], "grad_output"), by_role(b["scales"], "grad_output")
    assert any(ga[k] != gb[k] for k in ga)


def test_default_reduces_weights_only(out):
    a, b = ranks(out, "uninterrupted")
    assert by_role(a["scales"], "weight") == by_role(b["scales"], "weight")
    ia, ib = by_role(a["scales"], "input"), by_role(b["scales"], "input")
    assert all(ia[k] != ib[k] for k in ia)
    assert a["collectives"] == len(a["events"])  # weights are forward roles: one per event


# -- checkpoints and resume ---------------------------------------------------------
def assert_same_run(u: dict, d: dict, what: str) -> None:
    for k in u["params"]:
        assert bitwise(u["params"][k], d["params"][k]), f"{what}: parameter {k} differs"
    assert len(u["momentum"]) == len(d["momentum"]) > 0
    for i, (a, b) in enumerate(zip(u["momentum"], d["momentum"], strict=True)):
        assert bitwise(a, b), f"{what}: momentum buffer {i} differs"
    for k in ("amax_history", "scale", "descale", "amax_pending", "nonfinite_count"):
        assert bitwise(u["bank"][k], d["bank"][k]), f"{what}: bank {k} differs"
    assert u["bank"]["owners"] == d["bank"]["owners"]
    assert u["total_commits"] == d["total_commits"]
    assert u["clock_last"] == d["clock_last"] and u["global_step"] == d["global_step"]


@pytest.mark.parametrize("name", ["resume_step", "resume_midacc"])
def test_resume_mid_epoch_is_bit_identical_to_an_uninterrupted_run(out, name):
    for r, (u, d) in enumerate(zip(ranks(out, "uninterrupted"), ranks(out, name), strict=True)):
        assert_same_run(u, d, f"{name} rank {r}")
        assert d["audit_ok"] and d["violations"] == 0


def test_resume_continues_the_logical_clock_inside_the_accumulation_window(out):
    events = expected_events(BATCHES_PER_EPOCH, ACCUMULATE, EPOCHS)
    midacc = ranks(out, "resume_midacc")[0]["events"]
    # saved after epoch 1 batch 4 (window 3..5): the first resumed event is microbatch 2 of its step
    assert midacc == events[BATCHES_PER_EPOCH + 5 :]
    assert midacc[0][1] == 2
    step = ranks(out, "resume_step")[0]["events"]
    assert step == events[3:]


def test_resume_mid_accumulation_without_the_accumulated_grads_is_not_exact(out):
    """The control: Lightning alone drops the window's gradients; so would we without them."""
    for u, d in zip(ranks(out, "uninterrupted"), ranks(out, "resume_midacc_nograds"), strict=True):
        assert any(not bitwise(u["params"][k], d["params"][k]) for k in u["params"])


def test_interrupted_run_really_stopped_where_it_saved(out):
    d = ranks(out, "interrupted")[0]
    events = expected_events(BATCHES_PER_EPOCH, ACCUMULATE, EPOCHS)
    assert d["events"] == events[: BATCHES_PER_EPOCH + 5]


def test_checkpoint_holds_every_ranks_state_keyed_by_rank(out):
    ckpt = torch.load(out / "midacc.ckpt", weights_only=False)
    entry = ckpt["fp8state"]
    assert entry["world_size"] == 2 and sorted(entry["ranks"]) == [0, 1]
    for r in (0, 1):
        sd = entry["ranks"][r]
        assert sd["rank"] == r
        assert {o[2] for o in sd["bank"]["owners"]} == {r}
    # the two ranks' input histories differ (different data): both were really kept
    assert not torch.equal(entry["ranks"][0]["bank"]["amax_history"], entry["ranks"][1]["bank"]["amax_history"])
    # inside the window each rank's local (not yet all-reduced) gradients are kept, and differ
    grads = entry["accumulated_grads"]
    assert sorted(grads) == [0, 1]
    assert not torch.equal(grads[0]["inp.weight"], grads[1]["inp.weight"])
    assert torch.load(out / "step.ckpt", weights_only=False)["fp8state"]["accumulated_grads"] is None
    assert torch.load(out / "midacc_nograds.ckpt", weights_only=False)["fp8state"]["accumulated_grads"] is None


def test_quantizer_checkpoint_entry_loads_with_weights_only(out, tmp_path):
    entry = torch.load(out / "midacc.ckpt", weights_only=False)["fp8state"]
    torch.save(entry, tmp_path / "entry.pt")
    again = torch.load(tmp_path / "entry.pt", weights_only=True)
    assert again["ranks"][1]["clock"] == entry["ranks"][1]["clock"]


# -- another world size -------------------------------------------------------------
def _single_device_trainer(cb, **kw):
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        accumulate_grad_batches=ACCUMULATE,
        callbacks=[cb],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        **kw,
    )


def _model():
    from lightning_fp8state.models import ResumableLoader
    from tests.lightning.models import CheckpointedBoring, ScaledDataset

    model = CheckpointedBoring()
    model.train_dataloader = lambda: ResumableLoader(ScaledDataset(16), batch_size=2)
    model.val_dataloader = lambda: ResumableLoader(ScaledDataset(8), batch_size=2)
    return model


def test_resuming_with_another_world_size_maps_the_state_or_refuses_as_configured(out):
    """Training on from the two-rank checkpoint on one rank: the saved ranks' state mapped
    (state/reshard.py), the weight owners (all-reduced) copied, the others merged; with
    ``world_size_merge="refuse"`` the same resume is refused, naming the owners."""
    cb = f8s.lightning.Fp8StateCallback(config=f8s.QuantConfig(world_size_merge="refuse"))
    with pytest.raises(f8s.StateLoadError, match=r"2 rank\(s\) cannot be mapped onto 1: 12 owner\(s\) differ"):
        _single_device_trainer(cb).fit(_model(), ckpt_path=out / "step.ckpt")
    assert cb.state.event is None
    cb = f8s.lightning.Fp8StateCallback()
    _single_device_trainer(cb).fit(_model(), ckpt_path=out / "step.ckpt")
    report = cb.reshard_report
    assert (report.saved_world, report.world, len(report.copied), len(report.merged)) == (2, 1, 6, 12)
    assert {n.rsplit(".", 1)[1] for n in report.copied} == {"weight"}


def test_a_checkpoint_with_accumulated_gradients_is_not_mapped_onto_another_world_size(out):
    cb = f8s.lightning.Fp8StateCallback()
    with pytest.raises(f8s.StateLoadError, match=r"inside a gradient-accumulation window.*cannot be mapped onto 1"):
        _single_device_trainer(cb).fit(_model(), ckpt_path=out / "midacc.ckpt")


def test_evaluating_a_checkpoint_of_another_world_size_reads_rank_zeros_state(out):
    cb = f8s.lightning.Fp8StateCallback()
    trainer = _single_device_trainer(cb, limit_val_batches=2)
    trainer.validate(_model(), ckpt_path=out / "step.ckpt", verbose=False)
    saved = torch.load(out / "step.ckpt", weights_only=False)["fp8state"]["ranks"][0]["bank"]
    assert bitwise(cb.state.bank.scale.cpu(), saved["scale"])
    assert {o.rank for o in cb.state.bank.owners} == {0}
