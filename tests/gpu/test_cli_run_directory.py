"""``fp8state train gpt_350m_h200x2_deepspeed`` on two GPUs leaves exactly one run directory
(issue 16: rank 1 once made ``gpt_350m_h200x2_deepspeed-2`` with its own config.yaml), and its
DeepSpeed checkpoint directories resume (validated, each step once in the telemetry)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lightning_fp8state.telemetry.sinks import read_telemetry
from tests.lightning.launch import ROOT, launch_env

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA GPUs (the recipe runs DeepSpeed ZeRO-2 on two ranks)",
    ),
]

RECIPE = "gpt_350m_h200x2_deepspeed"
SHRINK = [  # the recipe's strategy, precision and world size; a model and run small enough for a test
    "model.n_layers=2",
    "model.seq_len=256",
    "data.num_samples=4000",
    "data.num_workers=0",
    "telemetry.wandb=disabled",
    "telemetry.log_every_n_steps=2",
    "trainer.checkpoint_every_n_steps=5",
]


def fp8state(*args: str, cwd) -> subprocess.CompletedProcess:
    env = launch_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "lightning_fp8state", "train", *args]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done


def test_two_gpu_deepspeed_run_leaves_one_directory_and_resumes(tmp_path):
    fp8state(RECIPE, *SHRINK, "trainer.max_steps=10", "out_dir=runs", cwd=tmp_path)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [RECIPE]
    run = tmp_path / "runs" / RECIPE
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["last.ckpt", "step=10.ckpt", "step=5.ckpt"], ckpts  # DeepSpeed: directories
    fp8state("--resume", str(run), "trainer.max_steps=15", cwd=tmp_path)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [RECIPE]
    assert [r["step"] for r in read_telemetry(run / "telemetry.jsonl").rows] == list(range(1, 16))
    done = subprocess.run(
        [sys.executable, "-m", "lightning_fp8state", "train", "--resume", str(run), "trainer.max_steps=15"],
        cwd=tmp_path,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "already complete at step 15" in done.stdout, done.stderr[-3000:]
