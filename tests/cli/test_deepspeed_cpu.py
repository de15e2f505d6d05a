"""``fp8state_deepspeed`` on CPU ranks (``DS_ACCELERATOR=cpu``: DeepSpeed's CPU accelerator on
gloo), and its resume on another world size through DeepSpeed's universal checkpoint (issue 46):
a ZeRO-2 run of 2 ranks resumed on 1 and then on 3, the quantizer state mapped by the rule
``quant.world_size_merge`` states, the data position carried, the audit clean; a save into a
checkpoint directory written by more ranks leaves none of their files behind."""

from __future__ import annotations

import json
import shutil

import pytest

from lightning_fp8state.lightning.strategies import UNIVERSAL_TAG, _clear_stale_files
from lightning_fp8state.state.checkpoint_files import zero_world_size
from lightning_fp8state.telemetry.sinks import read_jsonl
from tests.cli.test_resume_world_size import ok
from tests.cli.test_resume_world_size import train as train_in_process

SMALL = ["model.d_model=32", "model.n_layers=2", "model.seq_len=16", "data.batch_size=4", "data.num_samples=400"]
SAVED_STEPS = 4


def train(root, *args):
    """``fp8state train`` with DeepSpeed's CPU accelerator chosen (one thread a rank: 2 cores)."""
    return train_in_process(root, *args, env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A ZeRO-2 run of SAVED_STEPS steps on two CPU ranks, its last checkpoint at its end."""
    root = tmp_path_factory.mktemp("ds")
    ok(
        train(
            root,
            *SMALL,
            "strategy.name=fp8state_deepspeed",
            "trainer.devices=2",
            f"trainer.max_steps={SAVED_STEPS}",
            f"trainer.checkpoint_every_n_steps={SAVED_STEPS}",
            "telemetry.wandb=disabled",
            "telemetry.log_every_n_steps=1",
            f"out_dir={root}",
            "name=two",
        )
    )
    return root


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
    # and on three ranks from the one-rank checkpoint
    out = ok(train(saved, "--resume", str(run), "trainer.max_steps=8", "trainer.devices=3"))
    assert "of 1 rank(s) on 3" in next(x for x in out.splitlines() if "resuming the quantizer state" in x)
    assert [r["step"] for r in read_jsonl(run / "telemetry.jsonl") if r["step"] > 6] == [7, 8]
    assert zero_world_size(last) == 3


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
