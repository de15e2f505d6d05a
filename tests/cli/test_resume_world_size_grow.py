"""``fp8state train --resume DIR trainer.devices=2`` of a one-rank ``fp8state_ddp`` or ``fp8state_fsdp``
run: every owner is copied (one saved rank holds one state), each new rank under its own rank; the
data continues at the same sample. The reference is the same checkpoint mapped by hand onto two
ranks (FSDP2: its ``meta.pt``; the weights and optimizer state resharded by torch distributed
checkpoint in both runs)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_fp8state.telemetry.sinks import read_jsonl
from tests.cli.test_resume_world_size import ok, saved_run, train
from tests.conftest import bitwise_equal

SAVED_STEPS, STEPS = 4, 6


def rekeyed(sd: dict, rank: int) -> dict:
    out = dict(sd, rank=rank)
    for part in ("bank", "ledger"):
        out[part] = dict(sd[part], owners=[[o[0], o[1], rank, *o[3:]] for o in sd[part]["owners"]])
    return out


def lightning_state(run: Path) -> Path:
    """The file holding Lightning's state and the quantizer state: the checkpoint itself, or
    FSDP2's ``meta.pt`` beside its distributed-checkpoint shards."""
    last = run / "checkpoints" / "last.ckpt"
    return last / "meta.pt" if last.is_dir() else last


def weights(run: Path, tmp: Path) -> dict:
    last = run / "checkpoints" / "last.ckpt"
    if not last.is_dir():
        return torch.load(last, weights_only=True)["state_dict"]
    whole = tmp / f"{run.name}_weights.pt"
    dcp_to_torch_save(last, whole)  # FSDP2's shards, gathered into one state dict
    return torch.load(whole, weights_only=True)["state_dict"]


@pytest.mark.parametrize("strategy", ["fp8state_ddp", "fp8state_fsdp"])
def test_a_one_rank_run_resumed_on_two_copies_every_owner_and_matches_the_hand_mapped_reference(tmp_path, strategy):
    extra = ("trainer.deterministic=true", f"trainer.schedule_steps={STEPS}")
    ok(train(tmp_path, *saved_run(tmp_path, strategy, 1, *extra, name="one")))
    resumed, ref = tmp_path / "on_two", tmp_path / "reference"
    shutil.copytree(tmp_path / "one", resumed)
    shutil.copytree(tmp_path / "one", ref)
    out = ok(train(tmp_path, "--resume", str(resumed), f"trainer.max_steps={STEPS}", "trainer.devices=2"))
    assert "resuming the quantizer state of 1 rank(s) on 2: 24 owner(s) copied bitwise" in out
    assert "none merged" in out and "the data continues at sample 16 (none repeated or skipped)" in out
    prov = json.loads((resumed / "provenance.json").read_text())["resumed_from"]["world_size"]
    assert (prov["saved_world_size"], prov["world_size"], prov["merged"]) == (1, 2, [])

    path = lightning_state(ref)
    ckpt = torch.load(path, weights_only=True)
    saved = ckpt["fp8state"]["ranks"][0]
    ckpt["fp8state"] = dict(ckpt["fp8state"], world_size=2, ranks={0: saved, 1: rekeyed(saved, 1)})
    ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["consumed"] //= 2  # 4 batches of 1 rank = 2 of 2
    torch.save(ckpt, path)
    ok(train(tmp_path, "--resume", str(ref), f"trainer.max_steps={STEPS}", "trainer.devices=2"))

    def logged(run):
        rows = read_jsonl(run / "telemetry.jsonl")
        return [(r["step"], r["train/loss"], r["train/grad_norm"]) for r in rows if r["step"] > SAVED_STEPS]

    assert [s for s, *_ in logged(resumed)] == list(range(SAVED_STEPS + 1, STEPS + 1))
    assert logged(resumed) == logged(ref)
    wa, wb = weights(resumed, tmp_path), weights(ref, tmp_path)
    assert wa.keys() == wb.keys() and wa
    assert all(bitwise_equal(wa[k], wb[k]) for k in wb)
    a = torch.load(lightning_state(resumed), weights_only=True)
    b = torch.load(lightning_state(ref), weights_only=True)
    for r in (0, 1):
        bank_a, bank_b = a["fp8state"]["ranks"][r]["bank"], b["fp8state"]["ranks"][r]["bank"]
        assert bank_a["owners"] == bank_b["owners"] and {o[2] for o in bank_a["owners"]} == {r}
        assert all(bitwise_equal(bank_a[k], bank_b[k]) for k in ("amax_history", "scale", "descale"))
