"""``fp8state_deepspeed`` on CPU ranks (``DS_ACCELERATOR=cpu``: DeepSpeed's CPU accelerator on
gloo), and its resume on another world size through DeepSpeed's universal checkpoint (issue 46):
a ZeRO-2 run of 2 ranks resumed on 1 and then on 3, the quantizer state mapped by the rule
``quant.world_size_merge`` states, the data position carried, the audit clean; a save into a
checkpoint directory written by more ranks leaves none of their files behind.

Checked against a reference, as under DDP and FSDP2 (``test_resume_world_size*.py``): the same
checkpoint with its quantizer state and loader position mapped by hand in its client state
(``mp_rank_00_model_states.pt``), resumed on one rank. DeepSpeed reshards the weights and the
optimizer partitions in both (its universal checkpoint, which the partitions' own count selects),
so the two runs must match bit for bit: the losses, the gradient norms, the fp32 weights DeepSpeed
reassembles from the partitions, and the quantizer state. ZeRO stages 1, 2 and 3."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lightning_fp8state.cli.main import main
from lightning_fp8state.lightning.strategies import UNIVERSAL_TAG, _clear_stale_files
from lightning_fp8state.state.checkpoint_files import deepspeed_safe_globals, zero_world_size
from lightning_fp8state.telemetry.sinks import read_jsonl
from tests.cli.test_resume_world_size import SAVED_STEPS, Fp8Rank0, copy_run, hand_mapped, ok, saved_run
from tests.cli.test_resume_world_size import train as train_in_process
from tests.conftest import bitwise_equal


def train(root, *args):
    """``fp8state train`` with DeepSpeed's CPU accelerator chosen (one thread a rank: 2 cores)."""
    return train_in_process(root, *args, env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})


def train_two_ranks(root: Path, stage: int) -> Path:
    """A ZeRO run of SAVED_STEPS steps on two CPU ranks, its last checkpoint at its end."""
    ok(train(root, *saved_run(root, "fp8state_deepspeed", 2, f"strategy.zero_stage={stage}")))
    return root / "two"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A ZeRO-2 run of two ranks (``two``) under a folder the resumed copies sit beside."""
    root = tmp_path_factory.mktemp("ds")
    train_two_ranks(root, 2)
    return root


def client_state_file(run: Path) -> Path:
    """The checkpoint's client state (Lightning's, the quantizer state among it): rank 0's model
    states file in the folder ``latest`` names (ZeRO-3's is ``zero_pp_rank_0_mp_rank_00_...``)."""
    last = run / "checkpoints" / "last.ckpt"
    return next((last / (last / "latest").read_text().strip()).glob("*mp_rank_00_model_states.pt"))


def load_client_state(run: Path) -> dict:
    with torch.serialization.safe_globals(deepspeed_safe_globals()):
        return torch.load(client_state_file(run), weights_only=True)


def hand_mapped_reference(two: Path, ref: Path) -> None:
    """``two`` copied to ``ref`` with its quantizer state mapped to one rank by hand (the rule of
    ``hand_mapped``) and its loader position carried (two ranks' batches read on one)."""
    shutil.copytree(two, ref)
    path = client_state_file(ref)
    state = load_client_state(ref)
    state["fp8state"] = dict(
        state["fp8state"], world_size=1, ranks={0: Fp8Rank0(hand_mapped(state["fp8state"]["ranks"]))}
    )
    state["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["consumed"] *= 2
    torch.save(state, path)


def assert_bitwise_the_same_run(resumed: Path, ref: Path, steps: int, start: int = SAVED_STEPS, world: int = 1) -> None:
    """Two continuations of one checkpoint (at step ``start``) on ``world`` ranks: the same losses
    and gradient norms at every step, the same fp32 weights (reassembled from the ZeRO partitions)
    and quantizer state on every rank."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: PLC0415

    def logged(run):
        rows = read_jsonl(run / "telemetry.jsonl")
        return [(r["step"], r["train/loss"], r["train/grad_norm"]) for r in rows if r["step"] > start]

    assert [s for s, *_ in logged(resumed)] == list(range(start + 1, steps + 1))
    assert logged(resumed) == logged(ref)
    weights = [get_fp32_state_dict_from_zero_checkpoint(str(r / "checkpoints" / "last.ckpt")) for r in (resumed, ref)]
    assert weights[0].keys() == weights[1].keys() and weights[0]
    assert all(bitwise_equal(weights[0][k], weights[1][k]) for k in weights[1])
    a, b = (load_client_state(r)["fp8state"] for r in (resumed, ref))
    assert a["world_size"] == b["world_size"] == world and sorted(a["ranks"]) == list(range(world))
    for rank in range(world):
        assert a["ranks"][rank]["clock"]["last"] == [steps - 1, 0]
        bank_a, bank_b = a["ranks"][rank]["bank"], b["ranks"][rank]["bank"]
        assert bank_a["owners"] == bank_b["owners"] and {o[2] for o in bank_a["owners"]} == {rank}
        assert all(bitwise_equal(bank_a[k], bank_b[k]) for k in ("amax_history", "scale", "descale"))


def test_two_cpu_ranks_resume_on_one_and_then_on_three_through_the_universal_checkpoint(saved):
    run = saved / "on_one"
    shutil.copytree(saved / "two", run)
    last = run / "checkpoints" / "last.ckpt"
    assert zero_world_size(last) == 2
    out = ok(train(saved, "--resume", str(run), "trainer.max_steps=6", "trainer.devices=1", "telemetry.audit=true"))
    assert "to DeepSpeed's universal checkpoint" in out
    line = next(x for x in out.splitlines() if "resuming the quantizer state" in x)
    assert "of 2 rank(s) on 1" in line and "copied bitwise" in line and "quant.world_size_merge=max" in line
    assert "the data continues at sample 32 (none repeated or skipped)" in out  # 4 steps x 2 ranks x 4 samples
    prov = json.loads((run / "provenance.json").read_text())["resumed_from"]["world_size"]
    assert prov["saved_world_size"] == 2 and prov["world_size"] == 1 and prov["copied"] and prov["merged"]
    rows = [r for r in read_jsonl(run / "telemetry.jsonl") if r["step"] > SAVED_STEPS]
    assert [r["step"] for r in rows] == [5, 6]
    assert rows[-1]["train/steps_applied"] == 6 and rows[-1]["train/steps_skipped"] == 0
    audited = [r for r in rows if "fp8state/recompute_mismatches" in r]
    assert audited and all(r["fp8state/recompute_mismatches"] == 0 for r in audited)
    # the one-rank save rewrote the directory: no shard of rank 1 left, no stale universal form
    assert zero_world_size(last) == 1 and not (last / UNIVERSAL_TAG).exists()
    # bitwise the run from the checkpoint mapped by hand (its quantizer state already of one rank:
    # the partitions alone send it through the universal checkpoint)
    ref = saved / "reference"
    hand_mapped_reference(saved / "two", ref)
    out = ok(train(saved, "--resume", str(ref), "trainer.max_steps=6", "trainer.devices=1"))
    assert "to DeepSpeed's universal checkpoint" in out and "resuming the quantizer state" not in out
    assert_bitwise_the_same_run(run, ref, 6)
    # and on three ranks from the one-rank checkpoint, against it mapped by hand to three: every
    # owner copied, re-keyed to each rank; each rank's loader at the last whole batch of three
    ref3 = saved / "three_reference"
    shutil.copytree(run, ref3)
    out = ok(train(saved, "--resume", str(run), "trainer.max_steps=8", "trainer.devices=3"))
    assert "of 1 rank(s) on 3" in next(x for x in out.splitlines() if "resuming the quantizer state" in x)
    assert zero_world_size(last) == 3
    state = load_client_state(ref3)
    state["fp8state"] = dict(
        state["fp8state"], world_size=3, ranks={r: Fp8Rank0(state["fp8state"]["ranks"][0], r) for r in range(3)}
    )
    state["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["consumed"] //= 3
    torch.save(state, client_state_file(ref3))
    ok(train(saved, "--resume", str(ref3), "trainer.max_steps=8", "trainer.devices=3"))
    assert_bitwise_the_same_run(run, ref3, 8, start=6, world=3)


def test_a_save_removes_the_files_of_ranks_beyond_its_world_and_an_old_universal_form(tmp_path):
    tag = tmp_path / "checkpoint"
    tag.mkdir()
    names = [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt",
        "fp8state_accumulation_rank00000.pt",
        "fp8state_accumulation_rank00002.pt",
    ]
    for name in names:
        (tag / name).write_bytes(b"x")
    (tmp_path / UNIVERSAL_TAG).mkdir()
    (tmp_path / "latest_universal").write_text(UNIVERSAL_TAG)
    _clear_stale_files(tmp_path, world_size=2)
    assert sorted(p.name for p in tag.iterdir()) == sorted(
        [
            "mp_rank_00_model_states.pt",
            "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_1_mp_rank_00_optim_states.pt",
            "fp8state_accumulation_rank00000.pt",
        ]
    )
    assert not (tmp_path / UNIVERSAL_TAG).exists() and not (tmp_path / "latest_universal").exists()


def test_a_mapping_the_config_forbids_exits_2_before_any_conversion(saved, capsys, monkeypatch):
    """``quant.world_size_merge=refuse`` under DeepSpeed: one line, exit 2, and the checkpoint as it
    was: refused before DeepSpeed's universal conversion writes anything into it."""
    monkeypatch.chdir(saved)
    run = copy_run(saved, "refused")
    last = run / "checkpoints" / "last.ckpt"
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    code = main(
        ["train", "--resume", str(run), "trainer.devices=1", "quant.world_size_merge=refuse", "trainer.max_steps=6"]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "saved by 2 rank(s), this configuration runs 1" in err
    assert "quant.world_size_merge=refuse forbids merging them" in err
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
    assert not (last / UNIVERSAL_TAG).exists() and not (last / "latest_universal").exists()


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_1_and_3_runs_of_two_ranks_resume_on_one_bitwise_the_hand_mapped_reference(tmp_path, stage):
    two = train_two_ranks(tmp_path, stage)
    resumed, ref = tmp_path / "on_one", tmp_path / "reference"
    shutil.copytree(two, resumed)
    hand_mapped_reference(two, ref)
    out = ok(
        train(tmp_path, "--resume", str(resumed), "trainer.max_steps=6", "trainer.devices=1", "telemetry.audit=true")
    )
    assert "of 2 rank(s) on 1" in next(x for x in out.splitlines() if "resuming the quantizer state" in x)
    assert "the data continues at sample 32 (none repeated or skipped)" in out
    audited = [r for r in read_jsonl(resumed / "telemetry.jsonl") if "fp8state/recompute_mismatches" in r]
    assert audited and all(r["fp8state/recompute_mismatches"] == 0 for r in audited)
    ok(train(tmp_path, "--resume", str(ref), "trainer.max_steps=6", "trainer.devices=1"))
    assert_bitwise_the_same_run(resumed, ref, 6)
    assert zero_world_size(resumed / "checkpoints" / "last.ckpt") == 1


_KILLED_CONVERSION = """
import os, signal, sys
from pathlib import Path
from deepspeed.checkpoint import ds_to_universal
from lightning_fp8state.lightning.strategies import to_universal_checkpoint

def killed_halfway(args):  # DeepSpeed's converter, killed after its first files
    out = Path(args.output_folder)
    (out / "zero").mkdir(parents=True)
    (out / "mp_rank_00_model_states.pt").write_bytes(b"PK" + bytes(30))  # a truncated copy
    os.kill(os.getpid(), signal.SIGKILL)

ds_to_universal.main = killed_halfway
to_universal_checkpoint(sys.argv[1])
"""


def test_a_conversion_killed_halfway_leaves_the_checkpoint_readable_and_its_files_outside_it(saved):
    """kill -9 during the universal conversion (rank 0, before the fit): the checkpoint it
    converts stays readable, so the next resume does not fall back past it; the staging folder
    beside it is removed by the run's start (or the next conversion)."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from lightning_fp8state.cli.rundir import _remove_stale_temporaries  # noqa: PLC0415
    from lightning_fp8state.state.checkpoint_files import check_checkpoint  # noqa: PLC0415
    from tests.lightning.launch import launch_env  # noqa: PLC0415

    run = saved / "killed"
    shutil.copytree(saved / "two", run)
    last = run / "checkpoints" / "last.ckpt"
    env = dict(launch_env(), DS_ACCELERATOR="cpu")
    done = subprocess.run([sys.executable, "-c", _KILLED_CONVERSION, str(last)], env=env, capture_output=True)
    assert done.returncode == -9, done.stderr[-2000:]
    assert not (last / UNIVERSAL_TAG).exists() and not (last / "latest_universal").exists()
    check_checkpoint(last)  # readable: nothing half-written inside it
    leftovers = [p.name for p in last.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == [".last.ckpt.universal.tmp"]
    _remove_stale_temporaries(run)
    assert not [p for p in last.parent.iterdir() if p.name.startswith(".")]
