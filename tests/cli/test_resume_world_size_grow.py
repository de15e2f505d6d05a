"""``fp8state train --resume DIR trainer.devices=2`` of a one-rank ``fp8state_ddp`` run: every owner is
copied (one saved rank holds one state), each new rank under its own rank; the data continues at
the same sample. The reference is the same checkpoint mapped by hand onto two ranks."""

from __future__ import annotations

import json
import shutil

import torch

from lightning_fp8state.telemetry.sinks import read_jsonl
from tests.cli.test_resume_world_size import SMALL, ok, train
from tests.conftest import bitwise_equal

SAVED_STEPS, STEPS = 4, 6


def rekeyed(sd: dict, rank: int) -> dict:
    out = dict(sd, rank=rank)
    for part in ("bank", "ledger"):
        out[part] = dict(sd[part], owners=[[o[0], o[1], rank, *o[3:]] for o in sd[part]["owners"]])
    return out


def test_a_one_rank_run_resumed_on_two_copies_every_owner_and_matches_the_hand_mapped_reference(tmp_path):
    ok(
        train(
            tmp_path,
            *SMALL,
            "strategy.name=fp8state_ddp",
            "trainer.devices=1",
            "trainer.deterministic=true",
            f"trainer.max_steps={SAVED_STEPS}",
            f"trainer.schedule_steps={STEPS}",
            f"trainer.checkpoint_every_n_steps={SAVED_STEPS}",
            "telemetry.wandb=disabled",
            "telemetry.log_every_n_steps=1",
            "quant.strict=true",
            f"out_dir={tmp_path}",
            "name=one",
        )
    )
    resumed, ref = tmp_path / "on_two", tmp_path / "reference"
    shutil.copytree(tmp_path / "one", resumed)
    shutil.copytree(tmp_path / "one", ref)
    out = ok(train(tmp_path, "--resume", str(resumed), f"trainer.max_steps={STEPS}", "trainer.devices=2"))
    assert "resuming the quantizer state of 1 rank(s) on 2: 24 owner(s) copied bitwise" in out
    assert "none merged" in out and "the data continues at sample 16 (none repeated or skipped)" in out
    prov = json.loads((resumed / "provenance.json").read_text())["resumed_from"]["world_size"]
    assert (prov["saved_world_size"], prov["world_size"], prov["merged"]) == (1, 2, [])

    path = ref / "checkpoints" / "last.ckpt"
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
    a = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)
    b = torch.load(ref / "checkpoints" / "last.ckpt", weights_only=True)
    assert all(bitwise_equal(a["state_dict"][k], b["state_dict"][k]) for k in b["state_dict"])
    for r in (0, 1):
        bank_a, bank_b = a["fp8state"]["ranks"][r]["bank"], b["fp8state"]["ranks"][r]["bank"]
        assert bank_a["owners"] == bank_b["owners"] and {o[2] for o in bank_a["owners"]} == {r}
        assert all(bitwise_equal(bank_a[k], bank_b[k]) for k in ("amax_history", "scale", "descale"))
