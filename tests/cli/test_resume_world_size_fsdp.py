"""``fp8state train --resume DIR trainer.devices=1`` of a two-rank ``fp8state_fsdp`` run (FSDP2 over
gloo on the CPU): the weights and the optimizer state resharded by torch distributed checkpoint,
the quantizer state mapped from the same checkpoint folder (its ``meta.pt``, no side file). The
reference is the same checkpoint with its quantizer state and loader position mapped by hand,
resumed on one rank as a one-rank run: the two must match bit for bit."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lightning_fp8state.cli.main import main
from lightning_fp8state.telemetry.sinks import read_jsonl
from tests.cli.test_resume_world_size import Fp8Rank0, hand_mapped, ok, saved_run, train
from tests.conftest import bitwise_equal

SAVED_STEPS, STEPS = 4, 6


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """A two-rank fp8state_fsdp run (``two``) of SAVED_STEPS steps under a folder its resumed
    copies sit beside."""
    root = tmp_path_factory.mktemp("fsdp")
    ok(
        train(
            root, *saved_run(root, "fp8state_fsdp", 2, "trainer.deterministic=true", f"trainer.schedule_steps={STEPS}")
        )
    )
    return root


def logged(run):
    rows = read_jsonl(run / "telemetry.jsonl")
    return [(r["step"], r["train/loss"], r["train/grad_norm"]) for r in rows if r["step"] > SAVED_STEPS]


def test_a_two_rank_fsdp_run_resumed_on_one_is_bitwise_the_hand_mapped_reference(two, capsys, monkeypatch):
    tmp_path = two
    saved = tmp_path / "two" / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in saved.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "meta.pt",
    ]  # no side file
    resumed, ref = tmp_path / "on_one", tmp_path / "reference"
    shutil.copytree(tmp_path / "two", resumed)
    shutil.copytree(tmp_path / "two", ref)

    # a mapping the config forbids: one line, exit 2, the checkpoint as it was
    monkeypatch.chdir(tmp_path)
    listing = sorted(p.name for p in saved.iterdir())
    refused = ["train", "--resume", str(tmp_path / "two"), "trainer.devices=1", "quant.world_size_merge=refuse"]
    assert main(refused) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "quant.world_size_merge=refuse forbids merging them" in err, err
    assert sorted(p.name for p in saved.iterdir()) == listing

    audit = "telemetry.audit=true"  # every recomputed call of the resumed run compared with its forward
    out = ok(train(tmp_path, "--resume", str(resumed), f"trainer.max_steps={STEPS}", "trainer.devices=1", audit))
    assert "resuming the quantizer state of 2 rank(s) on 1: 8 owner(s) copied bitwise" in out
    audited = [r for r in read_jsonl(resumed / "telemetry.jsonl") if "fp8state/recompute_mismatches" in r]
    assert audited and all(r["fp8state/recompute_mismatches"] == 0 for r in audited)
    assert "the data continues at sample 32 (none repeated or skipped)" in out
    prov = json.loads((resumed / "provenance.json").read_text())["resumed_from"]["world_size"]
    assert (prov["saved_world_size"], prov["world_size"], len(prov["copied"]), len(prov["merged"])) == (2, 1, 8, 16)

    meta_path = ref / "checkpoints" / "last.ckpt" / "meta.pt"
    meta = torch.load(meta_path, weights_only=True)
    mapped = Fp8Rank0(hand_mapped(meta["fp8state"]["ranks"]))
    meta["fp8state"] = dict(meta["fp8state"], world_size=1, ranks={0: mapped})
    meta["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["consumed"] *= 2
    torch.save(meta, meta_path)
    ok(train(tmp_path, "--resume", str(ref), f"trainer.max_steps={STEPS}", "trainer.devices=1"))

    assert [s for s, *_ in logged(resumed)] == list(range(SAVED_STEPS + 1, STEPS + 1))
    assert logged(resumed) == logged(ref)
    a = torch.load(resumed / "checkpoints" / "last.ckpt" / "meta.pt", weights_only=True)["fp8state"]
    b = torch.load(ref / "checkpoints" / "last.ckpt" / "meta.pt", weights_only=True)["fp8state"]
    assert a["world_size"] == 1 and a["ranks"][0]["clock"]["last"] == [STEPS - 1, 0]
    assert all(bitwise_equal(a["ranks"][0]["bank"][k], b["ranks"][0]["bank"][k]) for k in ("amax_history", "scale"))


def test_a_resume_on_three_ranks_that_cannot_split_the_fp8_gathered_weights_is_refused_before_the_restore(two):
    """FP8 all-gather at one scale per weight gathers even shards only: the run's 32-row weights
    over 3 ranks are refused when the strategy shards the model, naming the layers and what to do,
    before the checkpoint is restored (it was the first forward's error, after the restore)."""
    run = two / "on_three"
    shutil.copytree(two / "two", run)
    before = {p: p.stat().st_mtime_ns for p in (run / "checkpoints").rglob("*")}
    refused = train(two, "--resume", str(run), "trainer.max_steps=5", "trainer.devices=3")
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "Restoring states" not in refused.stdout + refused.stderr
    assert "with fp8_all_gather=True over 3 ranks: the weights of layers ['model.blocks.0." in refused.stderr
    assert "Run on a world size that divides them, start the run with strategy.fp8_all_gather=false" in refused.stderr
    assert {p: p.stat().st_mtime_ns for p in (run / "checkpoints").rglob("*")} == before
