"""``fp8state train --resume DIR trainer.devices=M`` under ``fp8state_ddp``: a run of 2 CPU ranks
(gloo) resumed on 1 and on 3.

The reference of an exact mapping is a run on M ranks from the same checkpoint whose quantizer
state and loader position were mapped by hand here (owners equal on both saved ranks copied,
the others merged: elementwise max of the histories, the smaller scale's scale and descale; the
loader skips the same samples): the resumed run must match it bit for bit.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from lightning_fp8state.cli.main import main
from lightning_fp8state.telemetry.sinks import read_jsonl
from tests.conftest import bitwise_equal

SMALL = ["model.d_model=32", "model.n_layers=2", "model.seq_len=16", "data.batch_size=4", "data.num_samples=400"]
SAVED_STEPS = 4  # the two-rank run stops (and saves) here
STEPS = 7  # the resumed runs train on to here


def train(root, *args, env: dict | None = None) -> subprocess.CompletedProcess:
    """``fp8state train ARGS`` in a process of its own (``env``: variables added to this one's)."""
    from tests.lightning.launch import launch_env  # noqa: PLC0415

    cmd = [sys.executable, "-m", "lightning_fp8state", "train", *args]
    return subprocess.run(
        cmd, cwd=root, env=dict(launch_env(), **(env or {})), capture_output=True, text=True, timeout=300
    )


def saved_run(root, strategy: str, devices: int, *extra: str, name: str = "two") -> list[str]:
    """The arguments of the run the world-size tests save and resume: SAVED_STEPS steps of the
    small model on ``devices`` ranks, a checkpoint at its end, telemetry every step, strict."""
    return [
        *SMALL,
        f"strategy.name={strategy}",
        f"trainer.devices={devices}",
        f"trainer.max_steps={SAVED_STEPS}",
        f"trainer.checkpoint_every_n_steps={SAVED_STEPS}",
        "telemetry.wandb=disabled",
        "telemetry.log_every_n_steps=1",
        "quant.strict=true",
        *extra,
        f"out_dir={root}",
        f"name={name}",
    ]


def ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run of SAVED_STEPS steps on two ranks, its last checkpoint at its end."""
    root = tmp_path_factory.mktemp("world")
    ok(
        train(
            root, *saved_run(root, "fp8state_ddp", 2, "trainer.deterministic=true", f"trainer.schedule_steps={STEPS}")
        )
    )
    return root


def copy_run(root, name):
    shutil.copytree(root / "two", root / name)
    return root / name


def hand_mapped(ranks: dict) -> dict:
    """Rank 0 of one: each owner's column copied where both ranks hold the same bytes, else the
    elementwise max of the histories with the scale and descale of the smaller scale."""
    a, b = ranks[0]["bank"], ranks[1]["bank"]
    assert [o[:2] for o in a["owners"]] == [o[:2] for o in b["owners"]]
    bank = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    for i in range(len(a["owners"])):
        same = all(
            bitwise_equal(
                a[k][..., i] if k == "amax_history" else a[k][i], b[k][..., i] if k == "amax_history" else b[k][i]
            )
            for k in ("amax_history", "scale", "descale", "amax_pending", "nonfinite_count")
        )
        if same:
            continue
        bank["amax_history"][:, i] = torch.maximum(a["amax_history"][:, i], b["amax_history"][:, i])
        src = a if a["scale"][i] <= b["scale"][i] else b
        bank["scale"][i], bank["descale"][i] = src["scale"][i], src["descale"][i]
    return dict(ranks[0], bank=bank)


def test_a_two_rank_run_resumed_on_one_is_bitwise_the_run_from_the_hand_mapped_checkpoint(saved):
    resumed = copy_run(saved, "on_one")
    out = ok(
        train(
            saved, "--resume", str(resumed), f"trainer.max_steps={STEPS}", "trainer.devices=1", "telemetry.audit=true"
        )
    )
    # the one line on the quantizer state and the one on the data
    line = next(x for x in out.splitlines() if "resuming the quantizer state" in x)
    assert "of 2 rank(s) on 1: 8 owner(s) copied bitwise" in line and "16 merged by quant.world_size_merge=max" in line
    assert "the data continues at sample 32 (none repeated or skipped)" in out  # 4 steps x 2 ranks x 4 samples
    prov = json.loads((resumed / "provenance.json").read_text())["resumed_from"]["world_size"]
    assert prov["saved_world_size"] == 2 and prov["world_size"] == 1
    assert sorted(n.rsplit(".", 1)[1] for n in prov["copied"]) == ["weight"] * 8  # all-reduced each event
    assert sorted({n.rsplit(".", 1)[1] for n in prov["merged"]}) == ["grad_output", "input"]

    # the reference: the same checkpoint mapped by hand, resumed on one rank as a one-rank run
    ref = copy_run(saved, "reference")
    path = ref / "checkpoints" / "last.ckpt"
    ckpt = torch.load(path, weights_only=True)
    mapped = hand_mapped(ckpt["fp8state"]["ranks"])
    ckpt["fp8state"] = dict(ckpt["fp8state"], world_size=1, ranks={0: Fp8Rank0(mapped)})
    ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["consumed"] *= 2  # 2 ranks' batches on one
    torch.save(ckpt, path)
    ok(train(saved, "--resume", str(ref), f"trainer.max_steps={STEPS}", "trainer.devices=1", "telemetry.audit=true"))

    def logged(run):
        return [
            (r["step"], r["train/loss"], r["train/grad_norm"])
            for r in read_jsonl(run / "telemetry.jsonl")
            if r["step"] > SAVED_STEPS
        ]

    assert [s for s, *_ in logged(resumed)] == list(range(SAVED_STEPS + 1, STEPS + 1))
    assert logged(resumed) == logged(ref)
    a = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)
    b = torch.load(ref / "checkpoints" / "last.ckpt", weights_only=True)
    assert a["global_step"] == b["global_step"] == STEPS
    assert all(bitwise_equal(a["state_dict"][k], b["state_dict"][k]) for k in b["state_dict"])
    bank_a, bank_b = a["fp8state"]["ranks"][0]["bank"], b["fp8state"]["ranks"][0]["bank"]
    assert all(bitwise_equal(bank_a[k], bank_b[k]) for k in ("amax_history", "scale", "descale"))
    # the clock and the ledger continued from the saved ones; the audit found nothing
    assert a["fp8state"]["ranks"][0]["clock"]["last"] == [STEPS - 1, 0]
    assert set(a["fp8state"]["ranks"][0]["ledger"]["commits"]) == {STEPS}
    rows = [r for r in read_jsonl(resumed / "telemetry.jsonl") if r["step"] > SAVED_STEPS]
    assert rows[-1]["train/steps_applied"] == STEPS and rows[-1]["train/steps_skipped"] == 0
    audited = [r for r in rows if "fp8state/recompute_mismatches" in r]
    assert audited and all(r["fp8state/recompute_mismatches"] == 0 for r in audited)


def Fp8Rank0(sd: dict, rank: int = 0) -> dict:  # noqa: N802  (the hand-mapped state, re-keyed to a rank by hand)
    out = dict(sd, rank=rank)
    for part in ("bank", "ledger"):
        out[part] = dict(sd[part], owners=[[o[0], o[1], rank, *o[3:]] for o in sd[part]["owners"]])
    return out


def test_a_two_rank_run_resumed_on_three_says_where_the_data_continues_and_is_the_hand_mapped_run(saved):
    resumed = copy_run(saved, "on_three")
    out = ok(train(saved, "--resume", str(resumed), "trainer.max_steps=5", "trainer.devices=3", "telemetry.audit=true"))
    assert "of 2 rank(s) on 3: 8 owner(s) copied bitwise" in out
    # 32 samples read on 2 ranks are not whole batches of 3 x 4: it goes back to sample 24 and says so
    assert "continues at sample 24, and 8 sample(s) are read again" in out
    a = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)
    entry = a["fp8state"]
    assert entry["world_size"] == 3 and sorted(entry["ranks"]) == [0, 1, 2]
    for r, sd in entry["ranks"].items():
        assert {o[2] for o in sd["bank"]["owners"]} == {r} and sd["clock"]["last"] == [4, 0]
    rows = [r for r in read_jsonl(resumed / "telemetry.jsonl") if r["step"] > SAVED_STEPS]
    assert [r["fp8state/recompute_mismatches"] for r in rows if "fp8state/recompute_mismatches" in r] == [0]

    # the reference: the checkpoint mapped by hand to three ranks (each the merged state, re-keyed
    # to its rank; the loader back at sample 24 = 2 batches of 3 ranks x 4), resumed as a 3-rank run
    ref = copy_run(saved, "three_reference")
    path = ref / "checkpoints" / "last.ckpt"
    ckpt = torch.load(path, weights_only=True)
    mapped = hand_mapped(ckpt["fp8state"]["ranks"])
    ckpt["fp8state"] = dict(ckpt["fp8state"], world_size=3, ranks={r: Fp8Rank0(mapped, r) for r in range(3)})
    loader = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert loader["consumed"] == SAVED_STEPS  # batches per rank
    loader["consumed"] = 2
    torch.save(ckpt, path)
    ok(train(saved, "--resume", str(ref), "trainer.max_steps=5", "trainer.devices=3", "telemetry.audit=true"))

    def logged(run):
        return [(r["step"], r["train/loss"]) for r in read_jsonl(run / "telemetry.jsonl") if r["step"] > SAVED_STEPS]

    assert logged(resumed) == logged(ref) and logged(ref)
    b = torch.load(ref / "checkpoints" / "last.ckpt", weights_only=True)
    assert all(bitwise_equal(a["state_dict"][k], b["state_dict"][k]) for k in b["state_dict"])
    for r in range(3):
        bank_a, bank_b = a["fp8state"]["ranks"][r]["bank"], b["fp8state"]["ranks"][r]["bank"]
        assert bank_a["owners"] == bank_b["owners"]
        assert all(bitwise_equal(bank_a[k], bank_b[k]) for k in ("amax_history", "scale", "descale"))


def test_a_mapping_the_config_forbids_exits_2_with_one_line(saved, capsys, monkeypatch):
    monkeypatch.chdir(saved)
    run = copy_run(saved, "refused")
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    code = main(
        ["train", "--resume", str(run), "trainer.devices=1", "quant.world_size_merge=refuse", "trainer.max_steps=8"]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "saved by 2 rank(s), this configuration runs 1" in err and "16 owner(s) differ per rank" in err
    assert "quant.world_size_merge=refuse forbids merging them" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


# DeepSpeed on another world size (through its universal checkpoint): tests/cli/test_deepspeed_cpu.py


def test_the_deepspeed_strategy_refuses_partitions_of_another_world_size_before_its_engine_reads_them(
    tmp_path, monkeypatch
):
    """A library resume (``Trainer(strategy="fp8state_deepspeed", devices=1).fit(ckpt_path=...)``)
    of ZeRO partitions saved by two ranks stops before DeepSpeed's engine opens one."""
    from types import SimpleNamespace  # noqa: PLC0415

    from lightning.pytorch.strategies import DeepSpeedStrategy  # noqa: PLC0415
    from lightning.pytorch.trainer.states import TrainerFn  # noqa: PLC0415

    from lightning_fp8state.errors import StateLoadError  # noqa: PLC0415
    from lightning_fp8state.lightning import Fp8StateDeepSpeedStrategy  # noqa: PLC0415
    from lightning_fp8state.state.checkpoint_files import zero_world_size  # noqa: PLC0415

    ckpt = tmp_path / "last.ckpt"
    (ckpt / "global_step4").mkdir(parents=True)
    (ckpt / "latest").write_text("global_step4")
    torch.save({"global_step": 4}, ckpt / "global_step4" / "mp_rank_00_model_states.pt")
    for r in (0, 1):
        torch.save({}, ckpt / "global_step4" / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    assert zero_world_size(ckpt) == 2
    strategy = Fp8StateDeepSpeedStrategy()
    trainer = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING))
    monkeypatch.setattr(
        Fp8StateDeepSpeedStrategy, "lightning_module", property(lambda s: SimpleNamespace(trainer=trainer))
    )
    monkeypatch.setattr(Fp8StateDeepSpeedStrategy, "world_size", property(lambda s: 1))
    monkeypatch.setattr(DeepSpeedStrategy, "load_checkpoint", lambda *a, **k: pytest.fail("the engine was reached"))
    with pytest.raises(StateLoadError, match=r"saved by 2 rank\(s\), this run has 1: .*universal checkpoint"):
        strategy.load_checkpoint(ckpt)
    # DeepSpeed's universal checkpoint reshards by itself: then the engine is left to load it
    universal = Fp8StateDeepSpeedStrategy(
        config={"checkpoint": {"load_universal": True}, "zero_optimization": {"stage": 2}}
    )
    monkeypatch.setattr(DeepSpeedStrategy, "load_checkpoint", lambda *a, **k: {"loaded": True})
    assert universal.load_checkpoint(ckpt) == {"loaded": True}
