"""Faults a run directory must survive (issue 16): corrupt checkpoints, refused resumes,
concurrent runs, interrupts, torn telemetry, a full disk, and the first-use mistakes.

Each test injects the fault for real (a truncated file, a signal to the training process, a
sink whose writes raise ``OSError``) and checks what the user sees: exit code 2 and one
message without a traceback for bad input, and a run directory left exactly as it was.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state.cli.main import main
from lightning_fp8state.telemetry import TrainingTelemetry, write_report
from lightning_fp8state.telemetry.sinks import FanOut, JsonlSink, read_jsonl, read_telemetry
from tests.conftest import event_inputs, make_stack, run_events
from tests.lightning.launch import ROOT, launch_env

SMALL = ["model.d_model=32", "model.n_layers=2", "model.seq_len=16", "data.batch_size=4", "data.num_samples=400"]
COMMON = [*SMALL, "telemetry.wandb=disabled", "telemetry.log_every_n_steps=2", "trainer.checkpoint_every_n_steps=10"]


@pytest.fixture
def run_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def train(*args: str) -> int:
    return main(["train", *args])


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` with its bytes: a directory that did not change compares equal."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def weights(ckpt_path: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt_path, weights_only=False, map_location="cpu")["state_dict"]


def assert_one_clean_error(err: str, *needles: str) -> None:
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.startswith("fp8state: error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture(scope="module")
def finished_template(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished")
    assert train(*COMMON, "trainer.max_steps=20", f"out_dir={out}") == 0
    return out / "tiny_gpt_cpu"


@pytest.fixture
def finished_run(run_root, finished_template):
    """A 20-step run with checkpoints at steps 10 and 20 (a copy: each test may damage its own)."""
    run = run_root / "runs" / "tiny_gpt_cpu"
    shutil.copytree(finished_template, run)
    return run


# -- checkpoints ---------------------------------------------------------------------------
def test_checkpoints_are_kept_and_a_truncated_last_one_falls_back_to_the_previous_good_one(finished_run, capsys):
    ckpts = finished_run / "checkpoints"
    assert {p.name for p in ckpts.iterdir()} == {"last.ckpt", "step=10.ckpt", "step=20.ckpt"}
    data = (ckpts / "last.ckpt").read_bytes()
    (ckpts / "last.ckpt").write_bytes(data[: len(data) // 2])
    (ckpts / "step=20.ckpt").write_bytes(data[: len(data) // 3])
    capsys.readouterr()
    assert train("--resume", str(finished_run), "trainer.max_steps=30") == 0
    out, err = capsys.readouterr()
    assert "Epoch 0" in out and "30/30" in out  # the bar of a resumed run counts to its end, not "30/19"
    assert "last.ckpt is not a readable checkpoint" in err and "step=20.ckpt is not a readable checkpoint" in err
    assert "previous good checkpoint" in err and "step=10.ckpt (step 10)" in err
    assert "Traceback" not in err
    assert torch.load(ckpts / "last.ckpt", weights_only=False)["global_step"] == 30
    prov = json.loads((finished_run / "provenance.json").read_text())
    assert prov["resumed_from"] == {"checkpoint": str(ckpts / "step=10.ckpt"), "step": 10}
    assert set(prov["started_as"]) == {"version", "git_commit", "torch", "gpu", "command"}
    log = read_telemetry(finished_run / "telemetry.jsonl")
    assert [r["step"] for r in log.rows] == list(range(1, 31)) and log.superseded == 10  # 11..20 re-run


@pytest.mark.parametrize("fault", ["truncated", "random_bytes", "empty"])
def test_an_unreadable_checkpoint_is_refused_with_exit_2_and_the_run_is_untouched(finished_run, capsys, fault):
    rng = torch.Generator().manual_seed(0)
    for ckpt in (finished_run / "checkpoints").iterdir():
        data = ckpt.read_bytes()
        if fault == "truncated":
            ckpt.write_bytes(data[: len(data) - 100])
        elif fault == "random_bytes":
            ckpt.write_bytes(bytes(torch.randint(0, 256, (len(data),), generator=rng, dtype=torch.uint8).tolist()))
        else:
            ckpt.write_bytes(b"")
    before = snapshot(finished_run)
    capsys.readouterr()
    assert train("--resume", str(finished_run), "trainer.max_steps=30") == 2
    err = capsys.readouterr().err
    assert_one_clean_error(err, "no readable checkpoint", "last.ckpt", "step=10.ckpt", "start a new run")
    assert "PyTorch" not in err and "issue" not in err.lower()
    assert snapshot(finished_run) == before


def test_a_checkpoint_save_is_atomic(tmp_path, monkeypatch):
    """A save that fails half way (a full disk) leaves the previous checkpoint whole."""
    from lightning_fp8state.lightning import AtomicCheckpointIO

    io = AtomicCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1, "w": torch.ones(1000)}, target)

    def full_disk(obj, f, *a, **k):
        f.write(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"global_step": 2, "w": torch.zeros(1000)}, target)
    monkeypatch.undo()
    assert torch.load(target, weights_only=True)["global_step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary left behind


# -- refused resumes leave the run as it was ----------------------------------------------
@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("quant.history_len=4", ["quant.history_len=4", "quant.history_len=16", "trainer.max_steps"]),
        ("model.d_model=48", ["model.d_model=48", "model.d_model=32"]),
        ("trainer.max_stepz=30", ["trainer.max_stepz", "unknown key"]),
        ("trainer.max_steps=abc", ["trainer.max_steps", "abc"]),
        ("trainer.lr=nan", ["trainer.lr"]),
    ],
)
def test_a_refused_resume_exits_2_and_changes_nothing(finished_run, capsys, override, needles):
    (finished_run / "config.yaml").read_text()
    before = snapshot(finished_run)
    capsys.readouterr()
    assert train("--resume", str(finished_run), override) == 2
    assert_one_clean_error(capsys.readouterr().err, *needles)
    assert snapshot(finished_run) == before
    # and the run still resumes as it was configured
    assert train("--resume", str(finished_run), "trainer.max_steps=24") == 0


def test_a_checkpoint_made_with_another_configuration_is_refused(finished_run, capsys):
    """config.yaml edited by hand: the checkpoint itself says what it was made with."""
    cfg = finished_run / "config.yaml"
    cfg.write_text(cfg.read_text().replace("history_len: 16", "history_len: 8"))
    before = snapshot(finished_run)
    capsys.readouterr()
    assert train("--resume", str(finished_run), "trainer.max_steps=30") == 2
    assert_one_clean_error(capsys.readouterr().err, "last.ckpt", "quant.history_len: checkpoint 16, config 8")
    assert snapshot(finished_run) == before


def test_resume_with_a_recipe_is_refused_and_a_finished_run_says_so(finished_run, capsys):
    before = snapshot(finished_run)
    capsys.readouterr()
    assert train("gpt_124m_h200", "--resume", str(finished_run)) == 2
    assert_one_clean_error(capsys.readouterr().err, "gpt_124m_h200", "cannot be given")
    assert train("--resume", str(finished_run)) == 0
    out = capsys.readouterr().out
    assert "already complete at step 20" in out and out.strip()
    assert snapshot(finished_run) == before


def test_a_run_in_use_is_not_resumed_by_a_second_process(finished_run, capsys):
    from lightning_fp8state.cli.rundir import lock_run_dir

    held = lock_run_dir(finished_run)  # what the running process holds (flock: per open file)
    try:
        before = snapshot(finished_run)
        capsys.readouterr()
        assert train("--resume", str(finished_run), "trainer.max_steps=30") == 2
        assert_one_clean_error(capsys.readouterr().err, "in use by a running fp8state process", f"pid {os.getpid()}")
        assert snapshot(finished_run) == before
    finally:
        held.close()
    assert train("--resume", str(finished_run), "trainer.max_steps=22") == 0  # free again


# -- run directories -------------------------------------------------------------------------
def _cli(*args: str, cwd: Path) -> subprocess.Popen:
    env = launch_env()
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "lightning_fp8state", "train", *args]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_concurrent_runs_with_the_same_name_never_share_a_directory(run_root):
    procs = [_cli(*COMMON, "trainer.max_steps=6", "out_dir=runs", cwd=run_root) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-3000:] for o in outs]
    runs = sorted(p.name for p in (run_root / "runs").iterdir())
    assert runs == ["tiny_gpt_cpu", "tiny_gpt_cpu-2"]
    for name in runs:
        assert [r["step"] for r in read_jsonl(run_root / "runs" / name / "telemetry.jsonl")] == list(range(1, 7))
    assert {f"run directory: runs/{name}" for name in runs} == {o[0].strip().splitlines()[-2] for o in outs}
    # the rich progress bar no longer reads "Epoch 0/-2" when max_steps bounds the run
    assert all("Epoch 0" in o[0] and "/-2" not in o[0] for o in outs)


def test_a_two_rank_run_leaves_exactly_one_run_directory(run_root):
    """Two CPU ranks (fp8state_ddp over gloo): rank 0 alone claims and writes the directory,
    rank 1 receives its path (it once made ``tiny_gpt_cpu-2`` with its own config.yaml)."""
    ddp = ["strategy.name=fp8state_ddp", "trainer.devices=2", "trainer.max_steps=4", "out_dir=runs"]
    proc = _cli(*COMMON, *ddp, cwd=run_root)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    assert [p.name for p in (run_root / "runs").iterdir()] == ["tiny_gpt_cpu"]
    run = run_root / "runs" / "tiny_gpt_cpu"
    assert [r["step"] for r in read_jsonl(run / "telemetry.jsonl")] == [1, 2, 3, 4]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["fp8state"]["world_size"] == 2
    assert not (run_root / "lightning_logs").exists()


# -- interrupts --------------------------------------------------------------------------
STOP_AT = """
import os, signal, sys
# Ctrl-C as at a terminal, even where this child was started with SIGINT ignored (a shell's
# background job): Python keeps an inherited SIG_IGN
signal.signal(signal.SIGINT, signal.default_int_handler)
from lightning_fp8state.lightning import telemetry_callback as tc
step_hook = tc.TelemetryCallback.on_train_batch_end
def stop(self, trainer, *args):
    step_hook(self, trainer, *args)
    if trainer.global_step == {step}:
        os.kill(os.getpid(), signal.{signal})
tc.TelemetryCallback.on_train_batch_end = stop
from lightning_fp8state.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    assert train(*COMMON, "trainer.max_steps=30", f"out_dir={out}") == 0
    return out / "tiny_gpt_cpu"


@pytest.mark.parametrize("sig", ["SIGINT", "SIGKILL", "SIGTERM", "SIGHUP"])
def test_interrupt_then_resume_counts_each_step_once_and_ends_bitwise_equal(run_root, uninterrupted, sig):
    """A real signal at step 15 (the last periodic checkpoint is step 10, telemetry is written up
    to step 14 or 15). After SIGINT or SIGKILL the resume re-runs 11..15: the report counts 30
    steps, not 35. A preemption (SIGTERM, or SIGHUP handled as SIGTERM) checkpoints at the step
    boundary it arrived in, so nothing is re-run. Either way the weights equal those of one
    uninterrupted run of 30 steps, bit for bit."""
    preempted = sig in ("SIGTERM", "SIGHUP")
    env = launch_env()
    env.update(WANDB_SILENT="true", OMP_NUM_THREADS=str(torch.get_num_threads()))  # the same sums as in here
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    code = STOP_AT.format(step=15, signal=sig)
    cmd = [sys.executable, "-c", code, "train", *COMMON, "trainer.max_steps=30", "trainer.schedule_steps=30"]
    done = subprocess.run([*cmd, "out_dir=runs"], cwd=run_root, env=env, capture_output=True, text=True, timeout=300)
    run = run_root / "runs" / "tiny_gpt_cpu"
    if sig == "SIGKILL":
        assert done.returncode == -signal.SIGKILL
    else:
        assert done.returncode == 130, done.stderr[-3000:]
        assert f"fp8state train --resume {Path('runs') / 'tiny_gpt_cpu'}" in done.stderr
        assert ("stopped by a signal" in done.stderr) == preempted and "Traceback" not in done.stderr
    raw = [r["step"] for r in read_jsonl(run / "telemetry.jsonl")]
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]
    assert max(raw) >= 14 and saved == (15 if preempted else 10)
    if preempted:
        assert (run / "checkpoints" / "step=15.ckpt").is_file() and "step=15.ckpt" in done.stderr
    assert train("--resume", str(run), "trainer.max_steps=30") == 0
    raw = [r["step"] for r in read_jsonl(run / "telemetry.jsonl")]
    if preempted:
        assert raw == list(range(1, 31))  # every step once: none re-run
    else:
        assert len(raw) > 30  # steps 11..14 were written twice ...
    report = write_report(run, show=False)
    assert report.rows == 30 and report.superseded == len(raw) - 30  # ... and count once
    assert report.summary["steps attempted"] == 30
    assert [r["step"] for r in read_telemetry(run / "telemetry.jsonl").rows] == list(range(1, 31))
    a, b = weights(uninterrupted / "checkpoints" / "last.ckpt"), weights(run / "checkpoints" / "last.ckpt")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_a_resume_continues_the_same_wandb_run(run_root):
    common = [*SMALL, "telemetry.log_every_n_steps=2", "trainer.checkpoint_every_n_steps=4", "out_dir=runs"]
    assert train(*common, "trainer.max_steps=4") == 0
    run = run_root / "runs" / "tiny_gpt_cpu"
    assert train("--resume", str(run), "trainer.max_steps=6") == 0
    offline = sorted(p.name for p in (run / "wandb").glob("offline-run-*"))
    assert len(offline) == 2
    run_id = (run / "wandb_run_id").read_text().strip()
    # offline-run-<date>_<time>-<id>, and W&B appends -1 when both runs started in one second
    ids = [re.fullmatch(r"offline-run-\d{8}_\d{6}-(\w+?)(-\d+)?", name) for name in offline]
    assert all(m is not None and m.group(1) == run_id for m in ids), (offline, run_id)


# -- telemetry ---------------------------------------------------------------------------
def _rows(steps, owners: int = 0) -> list[dict]:
    rows = []
    for s in steps:
        row = {"step": s, "train/loss": 3.0 - 0.01 * s, "train/grad_norm": 1.0, "train/steps_attempted": s}
        if s % 5 == 0:
            row.update(
                {"train/window_seconds": 1.0, "train/tokens_per_s": 1000.0, "train/effective_tokens_per_s": 900.0}
            )
            for i in range(owners):
                for k, role in enumerate(("input", "weight", "grad_output")):
                    row[f"fp8state/scale/blocks.{i}.fc.{role}"] = 10.0 ** (k * 2) * (1 + i + s / 100)
                    row[f"fp8state/amax/blocks.{i}.fc.{role}"] = 448.0 / row[f"fp8state/scale/blocks.{i}.fc.{role}"]
        rows.append(row)
    return rows


def _write(path: Path, rows: list[dict]) -> None:
    sink = JsonlSink(path)
    sink.write(rows)
    sink.close()


def test_report_skips_torn_and_garbage_lines_and_names_them(tmp_path, capsys):
    jsonl = tmp_path / "telemetry.jsonl"
    _write(jsonl, _rows(range(1, 6)))
    with open(jsonl, "ab") as f:
        f.write(b"\x00\xffgarbage \xfe\n")  # line 6
        f.write(b"[1, 2, 3]\n")  # line 7: JSON, but not a row
    _write(jsonl, _rows(range(6, 11)))
    with open(jsonl, "ab") as f:
        f.write(b'{"step": 11, "train/loss": 2.8')  # line 13: a torn last line
    assert main(["report", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "line 6: not UTF-8 text (garbage)" in err
    assert "line 7: not a row" in err
    assert "line 13: a torn row" in err
    assert "Traceback" not in err
    assert write_report(tmp_path, show=False).rows == 10


def test_a_full_disk_is_reported_at_every_failure_and_at_the_end(tmp_path):
    """The JSONL sink's writes raise ENOSPC for steps 5..12: each failed window warns, the end
    summary names the lost steps, and the rows after the disk has room again are readable."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(tmp_path, model=model, log_every=2)
    jsonl = tel.sink.sinks[0]

    class FullDisk:
        """The JSONL's file while steps 5..12 are written: 20 bytes of each write land, then ENOSPC."""

        def __init__(self, file):
            self.file = file

        def write(self, data):
            if 5 <= tel.attempted <= 12:
                self.file.write(bytes(data[:20]))
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.file.write(data)

        def close(self):
            self.file.close()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(16):
            model(torch.randn(2, 4)).sum().backward()
            tel.before_optimizer_step(opt)
            opt.step()
            opt.zero_grad()
            tel.after_optimizer_step()
            if tel.attempted == 2:
                jsonl._file = FullDisk(jsonl._file)
        tel.close()
    messages = [str(w.message) for w in caught if "JsonlSink" in str(w.message)]
    failures = [m for m in messages if "failed to write" in m]
    assert len(failures) == 4, messages  # windows 5-6, 7-8, 9-10, 11-12
    assert "steps 11..12" in failures[-1] and "failure 4" in failures[-1]
    end = [m for m in messages if m.startswith("end of run")]
    assert len(end) == 1 and "failed 4 time(s)" in end[0] and "lost 8 row(s)" in end[0] and "steps 5..12" in end[0]
    log = read_telemetry(tmp_path / "telemetry.jsonl")
    assert [r["step"] for r in log.rows] == [1, 2, 3, 4, 13, 14, 15, 16]
    assert len(log.bad_lines) == 4  # one torn line per failure, each on its own line


def test_the_cli_reports_a_failing_telemetry_sink_at_the_end(run_root, capsys, monkeypatch):
    write = JsonlSink.write

    def full_disk(self, rows):
        if any(3 <= r["step"] <= 6 for r in rows):
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, rows)

    monkeypatch.setattr(JsonlSink, "write", full_disk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train(*COMMON, "trainer.max_steps=8", "out_dir=runs") == 0
    assert sum("failed to write" in str(w.message) for w in caught) == 2
    captured = capsys.readouterr()
    assert "telemetry sink JsonlSink failed 2 time(s) and lost 4 row(s) (steps 3..6)" in captured.err
    assert "telemetry sink failures: 1 sink(s)" in captured.out
    assert [r["step"] for r in read_jsonl(run_root / "runs" / "tiny_gpt_cpu" / "telemetry.jsonl")] == [1, 2, 7, 8]


def test_the_fanout_still_feeds_the_other_sinks(tmp_path):
    class Broken:
        def write(self, rows):
            raise OSError(errno.EIO, "gone")

        def close(self):
            pass

    class Keep(list):
        def write(self, rows):
            self.extend(rows)

        def close(self):
            pass

    keep = Keep()
    fan = FanOut([Broken(), keep])
    with pytest.warns(RuntimeWarning, match="Broken failed to write steps 1..2"):
        fan.write(_rows([1, 2]))
    with pytest.warns(RuntimeWarning, match="Broken failed to write steps 3..3 .* failure 2"):
        fan.write(_rows([3]))
    assert [r["step"] for r in keep] == [1, 2, 3]
    assert fan.failure_report() == [
        "telemetry sink Broken failed 2 time(s) and lost 3 row(s) (steps 1..3); last error: OSError(5, 'gone')"
    ]


# -- plots -------------------------------------------------------------------------------
def test_plots_group_owners_by_role_and_legends_do_not_cover_data(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {}
    close = plt.close

    def keep(fig=None):
        if fig is not None and fig.axes:
            figures[fig.axes[0].get_title() or str(len(figures))] = fig
        else:
            close(fig)

    monkeypatch.setattr(plt, "close", keep)
    _write(tmp_path / "telemetry.jsonl", _rows(range(1, 41), owners=16))  # 48 owners
    report = write_report(tmp_path, show=False)
    assert set(report.plots) == {"loss", "grad_norm", "scales", "throughput"}
    scales = next(f for t, f in figures.items() if t.startswith("Delayed scales of 48 owners"))
    for ax in scales.axes:
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert [label.split(" ")[0] for label in labels] == ["grad_output", "input", "weight"]
        named = {t.get_text() for t in ax.texts}
        assert len(named) == 2  # the smallest and the largest owner are named
    for fig in figures.values():
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            legend = ax.get_legend()
            if legend is not None:
                box, area = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
                assert not box.overlaps(area), f"the legend of {ax.get_title()!r} covers its axes"
    for fig in figures.values():
        close(fig)


# -- first use -----------------------------------------------------------------------------
def test_bare_fp8state_prints_the_usage(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "usage: fp8state" in err and "train" in err and "audit" in err and "report" in err


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["trainer.lr=nan"], ["trainer.lr=nan", "finite"]),
        (["trainer.gradient_clip_val=inf"], ["trainer.gradient_clip_val=inf", "finite"]),
        (["gpt_124m_h200"], ["gpt_124m_h200", "trainer.accelerator='gpu'", "needs a CUDA GPU", "tiny_gpt_cpu"]),
        (["gpt_350m_h200x2_deepspeed"], ["gpt_350m_h200x2_deepspeed", "needs a CUDA GPU"]),
        (["gpt_1b_h200x2_fsdp"], ["gpt_1b_h200x2_fsdp", "needs a CUDA GPU"]),
        (["multinode_template"], ["multinode_template", "needs a CUDA GPU"]),
    ],
)
def test_bad_input_exits_2_and_leaves_no_directory(run_root, capsys, monkeypatch, args, needles):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without a GPU
    assert train(*args, "out_dir=runs") == 2
    assert_one_clean_error(capsys.readouterr().err, *needles)
    assert not (run_root / "runs").exists() or not any((run_root / "runs").iterdir())
    assert not (run_root / "lightning_logs").exists()


def test_audit_refuses_a_non_finite_number_too(capsys):
    assert main(["audit", "trainer.lr=nan", "--steps", "1"]) == 2
    assert_one_clean_error(capsys.readouterr().err, "trainer.lr=nan", "finite")


def test_an_out_dir_that_cannot_be_created_exits_2(run_root, capsys):
    (run_root / "taken").write_text("a file, not a directory")
    assert train(*SMALL, "out_dir=taken/runs") == 2
    assert_one_clean_error(capsys.readouterr().err, "out_dir='taken/runs'", "cannot create the run directory")
    assert train(*SMALL, "out_dir=taken") == 2
    assert_one_clean_error(capsys.readouterr().err, "out_dir='taken' is a file")


def test_a_yaml_syntax_error_exits_2_naming_the_file_and_line(run_root, capsys):
    recipe = run_root / "mine.yaml"
    recipe.write_text(
        textwrap.dedent("""\
        base: [quant/fp8_delayed]
        name: mine
        model: {d_model: [32, 64
        """)
    )
    assert train(str(recipe)) == 2
    assert_one_clean_error(capsys.readouterr().err, str(recipe), "line 4", "not valid YAML")
    assert not (run_root / "runs").exists()


def test_the_example_exits_1_when_its_audit_fails(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("train_tiny_gpt", ROOT / "examples" / "train_tiny_gpt.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(sys, "argv", ["train_tiny_gpt.py", "--mode", "naive", "--steps", "2"])
    with pytest.raises(SystemExit) as exit_:
        example.main()
    assert exit_.value.code == 1
    assert "mismatch" in capsys.readouterr().out.lower()


def test_a_fresh_state_refuses_the_state_of_another_model():
    state_a = f8s.Fp8State(f8s.QuantConfig())
    run_events(state_a, state_a.convert(make_stack(n=4)), event_inputs(2))
    saved = state_a.state_dict()
    # loaded before convert(): the conversion finds that the model lacks the saved layers
    state_b = f8s.Fp8State(f8s.QuantConfig())
    state_b.load_state_dict(saved)
    other = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    with pytest.raises(f8s.StateLoadError, match=r"different model: .*layers \['blocks.0.fc1'"):
        state_b.convert(other)
    assert len(state_b.bank) == 0 and state_b.clock.last is None  # the loaded state was discarded
    # converted first (no step run yet, so no owner is registered): refused before any change
    state_c = f8s.Fp8State(f8s.QuantConfig())
    state_c.convert(torch.nn.Sequential(torch.nn.Linear(16, 16)))
    with pytest.raises(f8s.StateLoadError, match="different model"):
        state_c.load_state_dict(saved)
    assert len(state_c.bank) == 0
    # the model it was saved from still loads, either way round
    state_d = f8s.Fp8State(f8s.QuantConfig())
    state_d.load_state_dict(saved)
    model_d = state_d.convert(make_stack(n=4))
    run_events(state_d, model_d, event_inputs(3)[2:], step0=2)


# -- untrusted checkpoints (issue 30) -----------------------------------------------------
class PlantedCall:
    """Pickles as a call of ``os.system`` that creates ``marker``: what a hostile run directory
    would plant in a checkpoint. Loading it with pickle runs the command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(run: Path, kind: str, marker: Path) -> Path:
    """Replace the run's checkpoints by one of ``kind`` whose file ``planted`` carries the call;
    config.yaml names the strategy that writes that kind (on a GPU, refused here after it)."""
    ckpts = run / "checkpoints"
    saved = torch.load(ckpts / "last.ckpt", weights_only=True)
    shutil.rmtree(ckpts)
    ckpts.mkdir()
    if kind == "lightning":
        target = ckpts / "last.ckpt"
        torch.save({**saved, "callbacks": {**saved["callbacks"], "x": PlantedCall(marker)}}, target)
        return target
    cfg = run / "config.yaml"
    strategy = "fp8state_deepspeed" if kind.startswith("deepspeed") else "fp8state_fsdp"
    text = cfg.read_text().replace("name: auto", f"name: {strategy}").replace("accelerator: cpu", "accelerator: gpu")
    cfg.write_text(text)
    last = ckpts / "last.ckpt"
    if kind.startswith("deepspeed"):  # a directory of shards: DeepSpeed's engine unpickles each
        shard_dir = last / "checkpoint"
        shard_dir.mkdir(parents=True)
        model = {**saved, "module": saved.pop("state_dict"), "ds_version": "0.19"}
        optim = {"optimizer_state_dict": {"loss_scaler": 1.0}, "ds_version": "0.19"}
        planted = "optim" if kind == "deepspeed_optim" else "model"
        (model if planted == "model" else optim)["x"] = PlantedCall(marker)
        torch.save(model, shard_dir / "mp_rank_00_model_states.pt")
        torch.save(optim, shard_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        return (
            shard_dir / f"{'mp_rank_00_model' if planted == 'model' else 'zero_pp_rank_0_mp_rank_00_optim'}_states.pt"
        )
    # FSDP2: torch distributed checkpoint's shards, .metadata (plain pickle) and Lightning's meta.pt
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"state_dict": saved.pop("state_dict")}, checkpoint_id=str(last))
    if kind == "fsdp_meta":
        saved["x"] = PlantedCall(marker)
    torch.save(saved, last / "meta.pt")
    if kind == "fsdp_dcp_metadata":
        import pickle

        (last / ".metadata").write_bytes(pickle.dumps(PlantedCall(marker)))
    return last / ("meta.pt" if kind == "fsdp_meta" else ".metadata")


@pytest.mark.parametrize("kind", ["lightning", "deepspeed", "deepspeed_optim", "fsdp_meta", "fsdp_dcp_metadata"])
def test_a_checkpoint_carrying_a_pickled_call_is_refused_before_it_runs(finished_run, capsys, monkeypatch, kind):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    marker = finished_run.parent / "MARKER"
    planted = _plant(finished_run, kind, marker)
    before = snapshot(finished_run)
    capsys.readouterr()
    assert train("--resume", str(finished_run), "trainer.max_steps=30") == 2
    assert not marker.exists(), "the planted call ran"
    assert_one_clean_error(capsys.readouterr().err, str(planted), "refused to load", "posix.system")
    assert snapshot(finished_run) == before


def test_the_library_loaders_refuse_a_pickled_call_too(finished_run, tmp_path):
    """AtomicCheckpointIO (Trainer.fit(ckpt_path=...)) and the FSDP2/DeepSpeed pre-check."""
    from lightning_fp8state.lightning import AtomicCheckpointIO
    from lightning_fp8state.state.checkpoint_files import check_checkpoint

    marker = tmp_path / "MARKER"
    good = AtomicCheckpointIO().load_checkpoint(finished_run / "checkpoints" / "step=10.ckpt")
    assert good["global_step"] == 10
    planted = _plant(finished_run, "lightning", marker)
    with pytest.raises(f8s.UntrustedCheckpointError, match="posix.system"):
        AtomicCheckpointIO().load_checkpoint(planted)
    for kind in ("deepspeed_optim", "fsdp_dcp_metadata"):
        run = tmp_path / kind
        shutil.copytree(finished_run.parent / "tiny_gpt_cpu", run)
        (run / "checkpoints" / "last.ckpt").unlink()
        torch.save({"global_step": 1, "state_dict": {}, "callbacks": {}}, run / "checkpoints" / "last.ckpt")
        planted = _plant(run, kind, marker)
        with pytest.raises(f8s.UntrustedCheckpointError, match=re.escape(str(planted))):
            check_checkpoint(run / "checkpoints" / "last.ckpt")
    assert not marker.exists()


# -- a hand-edited config.yaml, a load that fails (issue 30) ------------------------------
@pytest.mark.parametrize(
    ("edit", "needles"),
    [
        (("n_layers: 2", "n_layers: 1"), ["last.ckpt", "extra ['model.blocks.1.", "model.* settings"]),
        (("- '*head'", "- '*head'\n  - '*.fc'"), ["last.ckpt", "quantizer state of rank 0", "blocks.0.fc"]),
    ],
)
def test_a_hand_edited_config_is_refused_against_the_checkpoint_exactly(finished_run, capsys, edit, needles):
    cfg = finished_run / "config.yaml"
    assert edit[0] in cfg.read_text()
    cfg.write_text(cfg.read_text().replace(*edit))
    before = snapshot(finished_run)
    capsys.readouterr()
    assert train("--resume", str(finished_run), "trainer.max_steps=30") == 2
    assert_one_clean_error(capsys.readouterr().err, *needles)
    assert snapshot(finished_run) == before


def test_the_run_files_are_rewritten_only_once_the_checkpoint_has_loaded(finished_run, capsys, monkeypatch):
    from lightning_fp8state.lightning import Fp8StateCallback

    def refuse(self, trainer, pl_module, checkpoint):
        raise f8s.StateLoadError("the quantizer state is refused (injected)")

    monkeypatch.setattr(Fp8StateCallback, "on_load_checkpoint", refuse)
    before = snapshot(finished_run)
    capsys.readouterr()
    assert train("--resume", str(finished_run), "trainer.max_steps=30") == 2
    assert_one_clean_error(capsys.readouterr().err, "refused (injected)")
    after = snapshot(finished_run)
    for name in ("config.yaml", "conversion.json", "provenance.json", "telemetry.jsonl"):
        assert after[name] == before[name], name
    assert {k for k in after if k.startswith("checkpoints")} == {k for k in before if k.startswith("checkpoints")}


# -- a full disk (issue 30) ----------------------------------------------------------------
def test_a_full_disk_at_a_checkpoint_save_is_one_line_and_keeps_the_last_good_checkpoint(run_root, capsys, monkeypatch):
    """From step 15 on every write fails with ENOSPC (the telemetry's and every atomic write:
    the step-20 checkpoint, the run files): exit 3, one line naming the file and the space it
    needs, no traceback, and the step-10 checkpoint intact; the run resumes from it."""
    full = {"since": None}
    write, fsync = JsonlSink.write, os.fsync

    def sink_write(self, rows):
        if any(r["step"] >= 15 for r in rows) and "room" not in full:
            full["since"] = full["since"] or rows[0]["step"]
        if full["since"] is not None:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, rows)

    def disk_fsync(fd):
        if full["since"] is not None:
            raise OSError(errno.ENOSPC, "No space left on device")
        fsync(fd)

    monkeypatch.setattr(JsonlSink, "write", sink_write)
    monkeypatch.setattr(os, "fsync", disk_fsync)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sink's failure warnings are tested above
        code = train(*COMMON, "trainer.max_steps=20", "out_dir=runs")
    err = capsys.readouterr().err
    run = Path("runs") / "tiny_gpt_cpu"
    assert code == 3, err[-3000:]
    assert_one_clean_error(err, str(run / "checkpoints" / "step=20.ckpt"), "no space left", "needs about")
    assert re.search(r"needs about \d+\.\d (KiB|MiB), .* free there", err)  # a unit that fits the size
    assert f"then continue: fp8state train --resume {run}" in err
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step=10.ckpt"]  # no temporary left
    assert torch.load(ckpts / "last.ckpt", weights_only=True)["global_step"] == 10
    full["since"] = None
    full["room"] = True
    assert train("--resume", str(run), "trainer.max_steps=12") == 0  # room again: it continues


def test_a_resume_after_a_torn_last_line_starts_on_a_new_line(tmp_path):
    """A kill mid-write leaves a torn last row; the next sink (the resumed run) must not glue its
    first row onto it, or that row is lost too and the report counts 49 of 50 steps."""
    jsonl = tmp_path / "telemetry.jsonl"
    _write(jsonl, _rows(range(1, 6)))
    with open(jsonl, "ab") as f:
        f.write(b'{"step": 6, "train/loss": 2.9')  # torn by a kill
    _write(jsonl, _rows(range(6, 11)))  # the resumed run
    log = read_telemetry(jsonl)
    assert [r["step"] for r in log.rows] == list(range(1, 11))
    assert [b.line for b in log.bad_lines] == [6]
    assert write_report(tmp_path, show=False).rows == 10


# -- the schedule on resume (issue 30) -------------------------------------------------------
def _lrs(run: Path) -> dict[int, float]:
    return {r["step"]: r["train/lr"] for r in read_telemetry(run / "telemetry.jsonl").rows}


def test_a_longer_resume_keeps_the_lr_curve_unless_asked_to_restretch_it(finished_run, capsys):
    """20 steps on their cosine, then --resume with trainer.max_steps=30: no LR jump larger than
    one step's change on the run's own curve; trainer.schedule_steps= re-stretches, and says so."""
    lr = _lrs(finished_run)
    one_step = max(abs(lr[s + 1] - lr[s]) for s in range(1, 20))
    capsys.readouterr()
    assert train("--resume", str(finished_run), "trainer.max_steps=30", "telemetry.log_every_n_steps=1") == 0
    out = capsys.readouterr().out
    lr = _lrs(finished_run)
    assert sorted(lr) == list(range(1, 31))
    assert max(abs(lr[s + 1] - lr[s]) for s in range(19, 30)) <= one_step * (1 + 1e-6)
    assert re.search(r"learning rate at step 21: \S+, on the run's schedule of 20 steps", out), out
    # asked for: the schedule is re-stretched, and the resume says from what to what
    assert train("--resume", str(finished_run), "trainer.max_steps=32", "trainer.schedule_steps=60") == 0
    out = capsys.readouterr().out
    m = re.search(
        r"learning rate at step 31: (\S+) on the run's schedule, (\S+) on the schedule of "
        r"trainer.schedule_steps=60",
        out,
    )
    assert m is not None, out
    lr = _lrs(finished_run)
    assert abs(float(m.group(1)) - lr[30]) < 1e-3 * lr[30]  # the floor the run's curve had reached
    assert lr[32] - lr[31] > 2 * one_step  # re-stretched: the jump the user asked for


# -- pruning under another spelling of the run directory (issue 30) ------------------------
def test_pruning_keeps_two_checkpoints_through_an_absolute_path_and_in_a_copied_run(run_root, finished_run):
    # a copied run directory (finished_run was trained elsewhere), resumed by its relative path
    resume = ["--resume", str(finished_run.relative_to(run_root)), "trainer.checkpoint_every_n_steps=5"]
    assert train(*resume, "trainer.max_steps=30") == 0
    assert {p.name for p in (finished_run / "checkpoints").iterdir()} == {"last.ckpt", "step=25.ckpt", "step=30.ckpt"}
    # a run started with a relative out_dir, resumed through its absolute path
    every2 = [*SMALL, "telemetry.wandb=disabled", "trainer.checkpoint_every_n_steps=2", "out_dir=fresh"]
    assert train(*every2, "trainer.max_steps=4") == 0
    run = (run_root / "fresh" / "tiny_gpt_cpu").resolve()
    assert train("--resume", str(run), "trainer.max_steps=8") == 0
    assert {p.name for p in (run / "checkpoints").iterdir()} == {"last.ckpt", "step=6.ckpt", "step=8.ckpt"}


# -- bad inputs that slipped through or misled (issue 30) ------------------------------------
@pytest.mark.parametrize(
    ("args", "files", "needles"),
    [
        (["empty.yaml"], {"empty.yaml": ""}, ["empty.yaml", "the recipe is empty", "name:"]),
        (["name=../x", "out_dir=runs"], {}, ["name='../x'", "single path component", "out_dir="]),
        (["name=a/b", "out_dir=runs"], {}, ["name='a/b'", "single path component"]),
        (["trainer.max_stepz=3"], {}, ["trainer.max_stepz", "nearest: 'trainer.max_steps'", "trainer.lr"]),
        (["typo.yaml"], {"typo.yaml": "name: t\ntrainer: {max_stepz: 3}\n"}, ["nearest: 'trainer.max_steps'"]),
        (["trainer.max_steps=3", "--resume", "nowhere", "trainer.lr=1"], {}, ["--resume 'nowhere'", "config.yaml"]),
    ],
    ids=["empty-recipe", "name-dotdot", "name-slash", "unknown-key", "unknown-key-in-yaml", "both-sides-of-resume"],
)
def test_bad_input_that_once_slipped_through_exits_2_naming_the_key(run_root, capsys, args, files, needles):
    for name, text in files.items():
        (run_root / name).write_text(text)
    assert train(*args) == 2
    assert_one_clean_error(capsys.readouterr().err, *needles)
    assert sorted(p.name for p in run_root.iterdir()) == sorted(files)  # nothing created, here or above


def test_report_of_a_file_that_is_not_telemetry_exits_2_and_creates_nothing(tmp_path, capsys):
    other = tmp_path / "notes.txt"
    other.write_text("hello\nworld\n")
    assert main(["report", str(other)]) == 2
    assert_one_clean_error(capsys.readouterr().err, str(other), "not a telemetry file", "telemetry.jsonl")
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


# -- threads (issue 30) ----------------------------------------------------------------------
def test_the_cli_takes_its_threads_from_the_cores_it_may_use(monkeypatch):
    from lightning_fp8state.cli.train import set_cpu_threads

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the machine's count: not what this process may use
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    try:
        assert set_cpu_threads() == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_trainer_cpu_threads_is_used_for_the_run_and_the_callers_count_comes_back(run_root, monkeypatch):
    """The tiny recipe runs on one thread (``trainer.cpu_threads: 1``: its GEMMs are too small to
    gain from more, and beside another run on the same cores extra threads cost most of its
    speed); ``0`` takes the cores this process may use. An in-process caller gets its own count
    back when the run ends. A negative count is refused by key."""
    import lightning.pytorch as pl

    from lightning_fp8state.cli import train as cli_train

    seen = []
    monkeypatch.setattr(pl.Trainer, "fit", lambda self, *a, **k: seen.append(torch.get_num_threads()))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cli_train.run_training(None, [*SMALL, "trainer.max_steps=1", "out_dir=a", "telemetry.wandb=disabled"])
        cli_train.run_training(None, [*SMALL, "trainer.cpu_threads=0", "out_dir=b", "telemetry.wandb=disabled"])
        assert seen == [1, 3] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert main(["train", "trainer.cpu_threads=-1"]) == 2


# -- quiet runs (issue 30) -------------------------------------------------------------------
def test_a_run_prints_none_of_the_three_noises(run_root, capfd, caplog):
    """Lightning's litlogger tip, W&B's "anonymous setting has no effect", torch's LeafSpec
    deprecation via Lightning: each silenced where it comes from (W&B offline, as by default)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train(*SMALL, "trainer.max_steps=2", "out_dir=runs") == 0
    out, err = capfd.readouterr()
    text = out + err + caplog.text + "\n".join(str(w.message) for w in caught)
    for noise in ("litlogger", "anonymous setting", "LeafSpec"):
        assert noise not in text, noise
    assert "run directory:" in out  # the run's own output is still there


def test_skips_are_summed_up_by_reason_not_listed_one_by_one():
    from types import SimpleNamespace

    import tests.conftest as conftest

    def skip(reason):
        return SimpleNamespace(longrepr=("test_x.py", 1, f"Skipped: {reason}"))

    lines, sections = [], []
    reporter = SimpleNamespace(
        stats={"skipped": [skip("needs a CUDA GPU")] * 3 + [skip("needs 2 GPUs")]},
        section=lambda title, sep="=": sections.append(title),
        line=lines.append,
    )
    conftest.pytest_terminal_summary(reporter, 0, None)
    assert sections == ["4 skipped, by reason"]
    assert [line.split() for line in lines] == [["3", "needs", "a", "CUDA", "GPU"], ["1", "needs", "2", "GPUs"]]
    import tomllib

    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    report_chars = addopts.split("-r", 1)[1].split()[0]
    assert not set(report_chars) & set("saA")  # no SKIPPED line per test (-ra listed ~112 of them)
