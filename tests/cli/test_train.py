"""``fp8state train`` end to end on the CPU: run directory, resume, report."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_fp8state.cli.checks import require_cuda_graphs_setup
from lightning_fp8state.cli.config import load_config
from lightning_fp8state.cli.main import main
from lightning_fp8state.cli.resume import last_checkpoint
from lightning_fp8state.errors import ConfigError
from lightning_fp8state.telemetry.sinks import read_jsonl

SMALL = ["model.d_model=32", "model.n_layers=2", "model.seq_len=16", "data.batch_size=4", "data.num_samples=400"]


@pytest.fixture
def run_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def test_train_writes_a_traceable_run_directory_and_the_loss_falls(run_root, capsys):
    code = main(
        [
            "train",
            *SMALL,
            "trainer.max_steps=40",
            "trainer.checkpoint_every_n_steps=20",
            "telemetry.log_every_n_steps=5",
            f"out_dir={run_root / 'runs'}",
        ]
    )
    assert code == 0
    run = run_root / "runs" / "tiny_gpt_cpu"
    assert (run / "config.yaml").is_file()
    prov = json.loads((run / "provenance.json").read_text())
    assert prov["package"] == "lightning_fp8state" and prov["torch"] == torch.__version__
    assert "git_commit" in prov and "cuda_extension" in prov
    conversion = json.loads((run / "conversion.json").read_text())  # the full report, every layer
    assert conversion["counts"]["converted"] == 2 * 4  # qkv, proj, fc, out per block
    assert {"name": "model.head", "status": "skipped", "reason": "matches an exclude pattern ['*head']"} in conversion[
        "entries"
    ]
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb")), "W&B offline files"
    rows = read_jsonl(run / "telemetry.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 41)) or len(rows) == 40
    losses = [r["train/loss"] for r in rows]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5  # it learns
    assert rows[-1]["train/steps_applied"] == 40 and rows[-1]["train/steps_skipped"] == 0
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert ckpt["fp8state"]["ranks"][0]["clock"]["last"][0] == 39  # the quantizer state is saved


def test_train_resume_continues_the_run(run_root):
    common = [*SMALL, "telemetry.wandb=disabled", f"out_dir={run_root / 'runs'}"]
    assert main(["train", *common, "trainer.max_steps=20", "trainer.checkpoint_every_n_steps=10"]) == 0
    run = run_root / "runs" / "tiny_gpt_cpu"
    assert main(["train", "--resume", str(run), "trainer.max_steps=30"]) == 0
    rows = read_jsonl(run / "telemetry.jsonl")
    assert rows[-1]["step"] == 30 and rows[-1]["train/steps_attempted"] == 30
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert ckpt["global_step"] == 30
    assert ckpt["fp8state"]["ranks"][0]["clock"]["last"][0] == 29


def test_resume_of_a_non_run_directory_exits_2(run_root, capsys):
    assert main(["train", "--resume", str(run_root)]) == 2
    assert "config.yaml" in capsys.readouterr().err


def test_resume_finds_a_deepspeed_checkpoint_directory(tmp_path):
    """DeepSpeed saves ``last.ckpt`` as a directory of shards: resume accepts it (the check
    once asked for a file and refused every DeepSpeed run); nothing there is an error."""
    with pytest.raises(ConfigError, match="no checkpoints/last.ckpt"):
        last_checkpoint(tmp_path)
    shards = tmp_path / "checkpoints" / "last.ckpt" / "checkpoint"
    shards.mkdir(parents=True)
    (shards / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert last_checkpoint(tmp_path) == tmp_path / "checkpoints" / "last.ckpt"


def test_report_writes_pngs_and_a_summary(run_root, capsys):
    assert (
        main(
            [
                "train",
                *SMALL,
                "trainer.max_steps=12",
                "telemetry.wandb=disabled",
                "telemetry.log_every_n_steps=4",
                f"out_dir={run_root / 'runs'}",
            ]
        )
        == 0
    )
    run = run_root / "runs" / "tiny_gpt_cpu"
    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "steps" in out
    pngs = sorted((run / "report").glob("*.png"))
    assert {p.stem for p in pngs} >= {"loss", "grad_norm", "throughput", "scales"}
    assert all(p.stat().st_size > 1000 for p in pngs)


def test_report_of_a_missing_run_exits_2(run_root, capsys):
    assert main(["report", str(run_root / "nothing")]) == 2
    assert "nothing" in capsys.readouterr().err


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_is_bit_identical_to_an_uninterrupted_run(run_root, workers):
    """Stop at step 20 of an epoch, resume to 30: the weights and the quantizer state equal,
    bit for bit, those of one run of 30 steps (the loader resumes on the next batch, with or
    without worker processes)."""
    common = [
        *SMALL,
        "telemetry.wandb=disabled",
        "trainer.checkpoint_every_n_steps=10",
        "trainer.schedule_steps=30",
        f"data.num_workers={workers}",
    ]
    assert main(["train", *common, "trainer.max_steps=30", f"out_dir={run_root / 'whole'}"]) == 0
    assert main(["train", *common, "trainer.max_steps=20", f"out_dir={run_root / 'split'}"]) == 0
    split = run_root / "split" / "tiny_gpt_cpu"
    assert main(["train", "--resume", str(split), "trainer.max_steps=30"]) == 0

    def final(run):
        return torch.load(run / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")

    a, b = final(run_root / "whole" / "tiny_gpt_cpu"), final(split)
    assert a["global_step"] == b["global_step"] == 30
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k
    bank_a, bank_b = a["fp8state"]["ranks"][0]["bank"], b["fp8state"]["ranks"][0]["bank"]
    for k in ("scale", "amax_history"):
        assert torch.equal(bank_a[k], bank_b[k]), k
    # 400 samples / batch 4 = 100 batches an epoch: all 30 steps lie in epoch 0
    assert read_jsonl(split / "telemetry.jsonl")[-1]["step"] == 30


def _two_rank_resume_tails(run_root, strategy: str, total: int, log_every: int) -> tuple[dict, dict]:
    """Two CPU ranks launched by ``fp8state train`` with ``strategy``: one run of ``total`` steps,
    and one stopped at ``total / 2`` and resumed to ``total``; each run's logged (loss, gradient
    norm) per step after the split."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from tests.lightning.launch import launch_env  # noqa: PLC0415

    half = total // 2
    common = [
        *SMALL,
        f"strategy.name={strategy}",
        "trainer.devices=2",
        "trainer.deterministic=true",
        f"trainer.schedule_steps={total}",
        f"trainer.checkpoint_every_n_steps={half}",
        "telemetry.wandb=disabled",
        f"telemetry.log_every_n_steps={log_every}",
        "quant.strict=true",
    ]

    def train(*args):
        cmd = [sys.executable, "-m", "lightning_fp8state", "train", *args]
        done = subprocess.run(cmd, cwd=run_root, env=launch_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]

    train(*common, f"trainer.max_steps={total}", f"out_dir={run_root}", "name=whole")
    train(*common, f"trainer.max_steps={half}", f"out_dir={run_root}", "name=split")
    train("--resume", str(run_root / "split"), f"trainer.max_steps={total}")

    def tail(name):
        rows = read_jsonl(run_root / name / "telemetry.jsonl")
        return {r["step"]: (r["train/loss"], r["train/grad_norm"]) for r in rows if r["step"] > half}

    return tail("whole"), tail("split")


def test_two_rank_ddp_resume_through_the_cli_is_bit_identical(run_root):
    """Two CPU ranks (fp8state_ddp over gloo), launched by ``fp8state train``: 4 steps resumed
    to 8 log the same loss and gradient norm, bit for bit, on steps 5-8 as one run of 8."""
    whole, split = _two_rank_resume_tails(run_root, "fp8state_ddp", 8, 2)
    assert sorted(whole) == [5, 6, 7, 8]
    assert split == whole


def test_two_rank_fsdp_resume_through_the_cli_is_bit_identical(run_root):
    """``strategy.name=fp8state_fsdp`` on two CPU ranks (FSDP2 over gloo, weights all-gathered in
    FP8): the run writes sharded checkpoint directories (one shard file per rank), and 4 steps
    resumed to 8 log the same loss and gradient norm (the norm of the sharded gradients), bit for
    bit, on steps 5-8 as one run of 8."""
    whole, split = _two_rank_resume_tails(run_root, "fp8state_fsdp", 8, 2)
    last = run_root / "split" / "checkpoints" / "last.ckpt"
    assert last.is_dir() and len(list(last.glob("*.distcp"))) == 2
    assert sorted(whole) == [5, 6, 7, 8]
    assert split == whole


def test_bf16_mixed_with_clipping_runs_the_fused_optimizer_clipped_by_the_telemetry(run_root):
    """The CLI's AdamW is fused (the guard then skips on the device, no sync per step), and
    Lightning's mixed-precision plugin refuses to clip a fused optimizer: the telemetry clips
    (with the norm it measures), so bf16-mixed with trainer.gradient_clip_val trains."""
    code = main(
        [
            "train",
            *SMALL,
            "telemetry.wandb=disabled",
            "telemetry.log_every_n_steps=3",
            "trainer.precision=bf16-mixed",
            "trainer.gradient_clip_val=1e-3",  # every step's norm is above it
            "trainer.max_steps=6",
            "trainer.checkpoint_every_n_steps=6",
            f"out_dir={run_root / 'runs'}",
        ]
    )
    assert code == 0
    run = run_root / "runs" / "tiny_gpt_cpu"
    rows = read_jsonl(run / "telemetry.jsonl")
    assert [r["train/clipped"] for r in rows] == [1.0] * 6 and rows[-1]["train/clip_events"] == 6
    assert rows[-1]["train/steps_applied"] == 6
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert ckpt["optimizer_states"][0]["param_groups"][0]["fused"] is True


def test_a_run_saved_with_an_unfused_optimizer_resumes_fused(run_root):
    """Runs saved before the CLI's AdamW was fused hold param groups with fused unset, which
    load_state_dict would adopt (an unfused optimizer: the guard then syncs every step)."""
    common = [*SMALL, "telemetry.wandb=disabled", "trainer.checkpoint_every_n_steps=4", f"out_dir={run_root / 'runs'}"]
    assert main(["train", *common, "trainer.max_steps=4"]) == 0
    run = run_root / "runs" / "tiny_gpt_cpu"
    last = run / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=False, map_location="cpu")
    for group in ckpt["optimizer_states"][0]["param_groups"]:  # as an earlier version saved it
        group["fused"], group["foreach"] = None, None
    torch.save(ckpt, last)
    assert main(["train", "--resume", str(run), "trainer.max_steps=8"]) == 0
    resumed = torch.load(last, weights_only=False, map_location="cpu")
    assert all(g["fused"] is True for g in resumed["optimizer_states"][0]["param_groups"])
    step = next(iter(resumed["optimizer_states"][0]["state"].values()))["step"]
    assert float(step) == 8.0
    assert read_jsonl(run / "telemetry.jsonl")[-1]["train/steps_applied"] == 8


def test_the_summary_line_says_how_many_steps_were_skipped(run_root, capsys):
    """A run whose gradients turn non-finite goes on (the guard skips those steps, the
    parameters stay finite); its last line must not read like a healthy run."""
    code = main(
        [
            "train",
            *SMALL,
            "telemetry.wandb=disabled",
            "trainer.lr=1e8",  # the first applied step blows the weights up
            "trainer.gradient_clip_val=0",
            "trainer.max_steps=8",
            "trainer.checkpoint_every_n_steps=8",
            f"out_dir={run_root / 'runs'}",
        ]
    )
    assert code == 0
    rows = read_jsonl(run_root / "runs" / "tiny_gpt_cpu" / "telemetry.jsonl")
    skipped = rows[-1]["train/steps_skipped"]
    assert 0 < skipped < 8  # the first step applies
    assert f"steps: 8 ({skipped} skipped: their gradients were not finite" in capsys.readouterr().out


def test_trainer_compile_trains_bitwise_the_eager_run(run_root):
    """``trainer.compile=true``: every block compiled (each FP8 linear one op in its graph); the
    Lightning loop, the callback's events, the checkpointed state and the logged telemetry
    (the saturated fractions included) are those of the eager run, bit for bit."""
    from torch._dynamo.utils import counters

    common = [
        *SMALL,
        "telemetry.wandb=disabled",
        "telemetry.log_every_n_steps=3",
        "trainer.max_steps=6",
        "trainer.checkpoint_every_n_steps=6",
    ]
    assert main(["train", *common, f"out_dir={run_root / 'eager'}"]) == 0
    torch._dynamo.reset()
    counters.clear()
    assert main(["train", *common, "trainer.compile=true", f"out_dir={run_root / 'compiled'}"]) == 0
    assert counters["stats"]["unique_graphs"] >= 1  # the blocks did compile

    def final(name):
        run = run_root / name / "tiny_gpt_cpu"
        return torch.load(run / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu"), run

    (a, run_a), (b, run_b) = final("eager"), final("compiled")
    assert a["state_dict"].keys() == b["state_dict"].keys()  # compiled in place: the same keys
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k
    for k in ("scale", "amax_history"):
        assert torch.equal(a["fp8state"]["ranks"][0]["bank"][k], b["fp8state"]["ranks"][0]["bank"][k]), k
    rows_a, rows_b = read_jsonl(run_a / "telemetry.jsonl"), read_jsonl(run_b / "telemetry.jsonl")
    assert len(rows_a) == len(rows_b) == 6
    timed = {  # clock readings differ run to run
        "time",
        "train/effective_steps_per_s",
        "train/effective_tokens_per_s",
        "train/steps_per_s",
        "train/tokens_per_s",
        "train/window_seconds",
    }
    for ra, rb in zip(rows_a, rows_b, strict=True):
        keys = ra.keys() - timed
        assert keys == rb.keys() - timed
        assert any(k.startswith("fp8state/") for k in keys) or ra["step"] % 3, ra  # health on log steps
        assert {k: ra[k] for k in keys} == {k: rb[k] for k in keys}, ra["step"]


def test_trainer_compile_with_an_untested_strategy_is_refused(run_root, capsys):
    code = main(["train", *SMALL, "trainer.compile=true", "strategy.name=fp8state_deepspeed"])
    assert code == 2
    assert "trainer.compile=true with strategy.name='fp8state_deepspeed' is not allowed" in capsys.readouterr().err


def test_two_rank_ddp_with_trainer_compile_is_bitwise_the_eager_run(run_root):
    """``trainer.compile=true`` under ``fp8state_ddp`` on two CPU ranks (gloo): each rank's blocks
    compiled inside DDP; the logged loss and gradient norm of every step equal the eager run's."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from tests.lightning.launch import launch_env  # noqa: PLC0415

    common = [
        *SMALL,
        "strategy.name=fp8state_ddp",
        "trainer.devices=2",
        "trainer.deterministic=true",
        "trainer.max_steps=6",
        "trainer.checkpoint_every_n_steps=6",
        "telemetry.wandb=disabled",
        "telemetry.log_every_n_steps=3",
        "quant.strict=true",
        f"out_dir={run_root}",
    ]
    for name, extra in (("eager", []), ("compiled", ["trainer.compile=true"])):
        cmd = [sys.executable, "-m", "lightning_fp8state", "train", *common, *extra, f"name={name}"]
        done = subprocess.run(cmd, cwd=run_root, env=launch_env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    logged = [
        [(r["step"], r["train/loss"], r["train/grad_norm"]) for r in read_jsonl(run_root / name / "telemetry.jsonl")]
        for name in ("eager", "compiled")
    ]
    assert len(logged[0]) == 6 and logged[0] == logged[1]


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("trainer.accelerator=cpu", "trainer.accelerator='cpu'"),
        ("trainer.devices=2", "trainer.devices=2 x 1 node(s)"),
        ("trainer.accumulate_grad_batches=2", "trainer.accumulate_grad_batches=2"),
        ("telemetry.audit=true", "telemetry.audit=true"),
        ("strategy.name=fp8state_ddp trainer.compile=true", "trainer.compile=true"),
        ("strategy.name=fp8state_deepspeed strategy.partition_activations=true", "strategy.partition_activations=true"),
        ("strategy.name=fp8state_deepspeed strategy.cpu_checkpointing=true", "strategy.cpu_checkpointing=true"),
    ],
)
def test_trainer_cuda_graphs_outside_its_setup_is_refused_by_key(run_root, capsys, override, key):
    """A replayed step runs on one GPU, writes its gradients afresh and runs no Python per call:
    anything else is refused before a directory is made, naming the key to change."""
    code = main(["train", *SMALL, "trainer.accelerator=gpu", "trainer.cuda_graphs=true", *override.split()])
    assert code == 2
    err = capsys.readouterr().err
    assert f"trainer.cuda_graphs=true with {key} is not allowed" in err
    assert not (run_root / "runs").exists()


# the shipped recipes that replay from CUDA graphs, and the strategies each is measured under
GRAPHED_RECIPES = [
    ("gpt_124m_h200", []),
    ("gpt_350m_h200x2_deepspeed", []),
    ("gpt_350m_h200x2_deepspeed", ["strategy.name=fp8state_ddp"]),
    ("gpt_350m_h200x2_deepspeed", ["strategy.name=fp8state_fsdp"]),
    ("gpt_350m_h200x2_deepspeed", ["strategy.name=auto", "trainer.devices=1"]),
]


@pytest.mark.parametrize(
    ("recipe", "override"), GRAPHED_RECIPES, ids=lambda v: " ".join(v) if isinstance(v, list) else v
)
def test_the_h200_recipes_ship_cuda_graphs_and_their_setup_is_accepted(recipe, override):
    """The H200 recipes run the fast path as shipped: eager FP8 is host-bound at these sizes
    (0.70x bf16 under DeepSpeed on one H200), replayed from graphs it leads under every strategy.
    Their setup passes the graphs' checks under each strategy the 350M recipe is measured with."""
    cfg = load_config(recipe, override)
    assert cfg.trainer.cuda_graphs is True
    require_cuda_graphs_setup(cfg)  # raises ConfigError on a setup graphs cannot run


def test_the_1b_fsdp_recipe_stays_eager_until_its_shape_is_measured_with_graphs():
    assert load_config("gpt_1b_h200x2_fsdp").trainer.cuda_graphs is False


@pytest.mark.parametrize(
    ("override", "key"),
    [
        (["telemetry.audit=true"], "telemetry.audit=true"),
        (["strategy.name=auto"], "trainer.devices=2 x 1 node(s)"),  # the whole step: one GPU
        (["trainer.accelerator=cpu"], "trainer.accelerator='cpu'"),
    ],
)
def test_a_graphed_recipe_outside_the_graphs_setup_names_the_key_and_the_way_back_to_eager(override, key):
    """The recipe's own trainer.cuda_graphs=true is refused like a user's: by key, with
    trainer.cuda_graphs=false named as the way out; with it the same setup is accepted."""
    cfg = load_config("gpt_350m_h200x2_deepspeed", override)
    with pytest.raises(ConfigError) as refused:
        require_cuda_graphs_setup(cfg)
    assert f"trainer.cuda_graphs=true with {key} is not allowed" in str(refused.value)
    assert str(refused.value).endswith("or trainer.cuda_graphs=false")
    require_cuda_graphs_setup(load_config("gpt_350m_h200x2_deepspeed", [*override, "trainer.cuda_graphs=false"]))


def test_trainer_cuda_graphs_warmup_below_one_is_refused(run_root, capsys):
    assert main(["train", *SMALL, "trainer.cuda_graphs_warmup=0"]) == 2
    assert "cuda_graphs_warmup" in capsys.readouterr().err


def test_trainer_cuda_graphs_trains_bitwise_the_eager_run_and_resumes(run_root, monkeypatch):
    """``trainer.cuda_graphs=true`` through the CLI's own module, optimizer, schedule, clipping,
    telemetry and checkpoints, with GraphedStep's eager stand-in (the capture needs a GPU: the
    real replay runs in tests/gpu/test_graphed_training_cuda.py). Eight steps, and four then a
    resume to eight, end with the weights, the quantizer state and every step's loss and grad
    norm of the plain run."""
    import lightning_fp8state.cli.checks as cli_checks  # noqa: PLC0415
    import lightning_fp8state.lightning.graphed as graphed  # noqa: PLC0415
    from tests.lightning.graph_stand_in import for_model, model_of_graphed_body  # noqa: PLC0415

    monkeypatch.setattr(cli_checks, "CUDA_GRAPHS_ACCELERATORS", ("cpu",))
    runners = []
    stand_in = for_model(model_of_graphed_body)

    def factory(*a, **kw):
        runners.append(stand_in(*a, **kw))
        return runners[-1]

    monkeypatch.setattr(graphed, "GraphedStep", factory)
    common = [
        *SMALL,
        "telemetry.wandb=disabled",
        "telemetry.log_every_n_steps=1",
        "trainer.gradient_clip_val=0.05",  # clipped by the telemetry (the fused AdamW) on most steps
        "trainer.schedule_steps=8",
        "trainer.checkpoint_every_n_steps=4",
        "quant.strict=true",
    ]
    assert main(["train", *common, "trainer.max_steps=8", f"out_dir={run_root / 'eager'}"]) == 0
    graphs = [*common, "trainer.cuda_graphs=true", "trainer.cuda_graphs_warmup=2"]
    assert main(["train", *graphs, "trainer.max_steps=8", f"out_dir={run_root / 'graphed'}"]) == 0
    assert [(r.eager_calls, r.replays) for r in runners] == [(2, 6)]  # the steps did run through the "graph"
    assert main(["train", *graphs, "trainer.max_steps=4", f"out_dir={run_root / 'split'}"]) == 0
    split = run_root / "split" / "tiny_gpt_cpu"
    assert main(["train", "--resume", str(split), "trainer.max_steps=8"]) == 0
    assert [(r.eager_calls, r.replays) for r in runners[1:]] == [(2, 2), (2, 2)]  # a resume warms up again
    # the recipes ship graphs on: a run may go on eagerly (e.g. with the audit, which graphs
    # refuse) and an eager run may go on replayed, bitwise either way
    assert main(["train", *graphs, "trainer.max_steps=4", f"out_dir={run_root / 'to_eager'}"]) == 0
    to_eager = run_root / "to_eager" / "tiny_gpt_cpu"
    assert main(["train", "--resume", str(to_eager), "trainer.max_steps=8", "trainer.cuda_graphs=false"]) == 0
    assert main(["train", *common, "trainer.max_steps=4", f"out_dir={run_root / 'to_graphs'}"]) == 0
    to_graphs = run_root / "to_graphs" / "tiny_gpt_cpu"
    resumed = ["trainer.max_steps=8", "trainer.cuda_graphs=true", "trainer.cuda_graphs_warmup=1"]
    assert main(["train", "--resume", str(to_graphs), *resumed]) == 0
    assert [(r.eager_calls, r.replays) for r in runners[3:]] == [(2, 2), (1, 3)]

    def final(name):
        run = run_root / name / "tiny_gpt_cpu"
        ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
        logged = [
            (r["step"], r["train/loss"], r["train/grad_norm"], r["train/lr"])
            for r in read_jsonl(run / "telemetry.jsonl")
        ]
        return ckpt, logged

    (a, logged_a), (b, logged_b), (c, logged_c) = final("eager"), final("graphed"), final("split")
    (d, logged_d), (e, logged_e) = final("to_eager"), final("to_graphs")
    assert len(logged_a) == 8 and logged_a == logged_b == logged_c == logged_d == logged_e
    assert any(r["train/clipped"] for r in read_jsonl(run_root / "graphed" / "tiny_gpt_cpu" / "telemetry.jsonl"))
    for other in (b, c, d, e):
        assert other["global_step"] == 8
        for k in a["state_dict"]:
            assert torch.equal(a["state_dict"][k], other["state_dict"][k]), k
        for k in ("scale", "amax_history"):
            assert torch.equal(a["fp8state"]["ranks"][0]["bank"][k], other["fp8state"]["ranks"][0]["bank"][k]), k
        assert other["fp8state"]["ranks"][0]["clock"]["last"] == a["fp8state"]["ranks"][0]["clock"]["last"]


def test_under_fsdp2_a_resumed_unfused_optimizer_is_fused_again_at_train_start():
    """FSDP2's optimizer state loads through DCP in the strategy, after on_load_checkpoint: a
    run saved with an unfused AdamW would resume unfused, its guard syncing every step.
    on_train_start puts the configured setting back on the live optimizer."""
    from types import SimpleNamespace

    from lightning_fp8state.cli.config import load_config
    from lightning_fp8state.cli.gpt_module import module_and_data

    cfg = load_config("tiny_gpt_cpu", ["strategy.name=fp8state_fsdp"])
    module, _ = module_and_data(cfg)
    opt = torch.optim.AdamW(module.parameters(), foreach=True)  # as a loaded unfused state leaves it
    module._trainer = SimpleNamespace(optimizers=[opt])
    module.on_train_start()
    assert all(g["fused"] is True and g["foreach"] is None for g in opt.param_groups)


def test_a_run_manages_pythons_collector_unless_told_not_to(run_root, monkeypatch, capsys):
    """``trainer.gc=managed`` (the default): the training runs with Python's automatic collector
    off (collections at batch ends, frozen objects after the warm-up), and the caller gets it back
    on; ``trainer.gc=automatic`` leaves Python's own; anything else is refused by key."""
    import gc

    import lightning.pytorch as pl

    seen = []

    class Watch(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(gc.isenabled())

    original = pl.Trainer.__init__

    def init(self, *a, callbacks=None, **kw):
        original(self, *a, callbacks=[*(callbacks or []), Watch()], **kw)

    monkeypatch.setattr(pl.Trainer, "__init__", init)
    common = [*SMALL, "trainer.max_steps=3", "telemetry.wandb=disabled"]
    assert gc.isenabled()
    assert main(["train", *common, "out_dir=a"]) == 0
    assert seen == [False] * 3 and gc.isenabled() and gc.get_freeze_count() == 0
    seen.clear()
    assert main(["train", *common, "trainer.gc=automatic", "out_dir=b"]) == 0
    assert seen == [True] * 3
    capsys.readouterr()
    assert main(["train", *common, "trainer.gc=off", "out_dir=c"]) == 2
    err = capsys.readouterr().err
    assert "gc" in err and "managed" in err and "automatic" in err


def test_weight_codes_once_may_change_on_resume_and_changes_no_bit(run_root, capsys):
    """``quant.weight_codes_once`` says how a call runs, not what it computes: a run resumed with
    it off ends bit for bit where one uninterrupted run with it on ends; a value that is not a
    bool is refused by key."""
    common = [*SMALL, "telemetry.wandb=disabled", "trainer.checkpoint_every_n_steps=10", "trainer.schedule_steps=20"]
    assert main(["train", *common, "trainer.max_steps=20", f"out_dir={run_root / 'whole'}"]) == 0
    assert main(["train", *common, "trainer.max_steps=10", f"out_dir={run_root / 'split'}"]) == 0
    split = run_root / "split" / "tiny_gpt_cpu"
    assert main(["train", "--resume", str(split), "trainer.max_steps=20", "quant.weight_codes_once=false"]) == 0

    def final(run):
        return torch.load(run / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")

    a, b = final(run_root / "whole" / "tiny_gpt_cpu"), final(split)
    assert a["global_step"] == b["global_step"] == 20
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k
    capsys.readouterr()
    assert main(["train", *common, "quant.weight_codes_once=maybe", f"out_dir={run_root / 'bad'}"]) == 2
    assert "weight_codes_once" in capsys.readouterr().err


def test_a_run_without_checkpoints_writes_none_and_its_resume_is_refused_plainly(run_root, capsys):
    """``trainer.enable_checkpointing=false`` (a benchmark, or a model whose checkpoint would not fit
    the disk): the run trains and logs, writes no checkpoint, and a resume of it exits 2 naming
    what is missing."""
    out = run_root / "runs"
    args = [*SMALL, "telemetry.wandb=disabled", "trainer.max_steps=6", "trainer.checkpoint_every_n_steps=2"]
    assert main(["train", *args, "trainer.enable_checkpointing=false", f"out_dir={out}"]) == 0
    run = out / "tiny_gpt_cpu"
    assert not list(run.rglob("*.ckpt"))
    assert read_jsonl(run / "telemetry.jsonl")[-1]["step"] == 6
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 2
    assert "last.ckpt" in capsys.readouterr().err


def test_enable_checkpointing_must_be_a_bool(run_root, capsys):
    assert main(["train", *SMALL, "trainer.enable_checkpointing=sometimes", f"out_dir={run_root}"]) == 2
    err = capsys.readouterr().err
    assert "trainer.enable_checkpointing" in err and "not a valid bool" in err


def test_an_interrupted_run_without_checkpoints_keeps_its_directory(tmp_path, capsys):
    from lightning_fp8state.cli.rundir import report_interrupted

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "telemetry.jsonl").write_text('{"step": 1}\n')
    assert report_interrupted(run, 1, fresh=True, stopping=False, checkpointing=False) == 130
    assert (run / "telemetry.jsonl").is_file()  # a run with checkpoints would have been removed here
    assert "enable_checkpointing=false" in capsys.readouterr().err
    assert report_interrupted(run, 1, fresh=True, stopping=False) == 130 and not run.exists()
