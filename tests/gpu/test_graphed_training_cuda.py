"""GraphedTrainingStep on the GPU: the Lightning step's forward and backward captured by the real
GraphedStep and replayed. The same model and data trained with automatic optimization (eager)
and through the replayed step end bitwise equal (every step's loss, the weights, the optimizer
state, the quantizer bank), one commit per owner per replayed event, the naive mode's defect
replayed and counted, and ``fp8state train trainer.cuda_graphs=true`` bitwise its eager run with
its steady-state steps free of host syncs (``set_sync_debug_mode("error")``)."""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state.models import GPTConfig
from lightning_fp8state.telemetry import read_jsonl
from tests.conftest import bitwise_equal
from tests.gpu.test_compile_cuda import CLI_ON_THE_GPU
from tests.gpu.test_lightning_sync_free import watch, watched  # noqa: F401  (the fixtures)
from tests.lightning.test_graphed_training import STEPS, GPTModule, fit, losses

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CFG = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layers=3, n_heads=4)


def train(tmp_path, graphed: bool, mode: str = "safe"):
    module = GPTModule(graphed=graphed, warmup=2, cfg=CFG, batch_size=4, real_graphs=True)
    quant = f8s.QuantConfig(mode=mode, strict=mode == "safe")
    trainer, fp8 = fit(tmp_path, module, accelerator="gpu", precision="bf16-mixed", quant=quant)
    return module, trainer, fp8


def assert_bitwise_same(a, b) -> None:
    (ma, _, fa), (mb, _, fb) = a, b
    for (name, p), q in zip(ma.state_dict().items(), mb.state_dict().values(), strict=True):
        assert bitwise_equal(p, q), name
    oa, ob = ma.trainer.optimizers[0].state_dict()["state"], mb.trainer.optimizers[0].state_dict()["state"]
    for i in oa:
        for key in oa[i]:
            assert bitwise_equal(oa[i][key], ob[i][key]), (i, key)
    for key in ("scale", "amax_history", "saturation"):  # (saturation: the kernels' clip counts)
        assert bitwise_equal(getattr(fa.state.bank, key), getattr(fb.state.bank, key)), key


def test_the_replayed_lightning_step_is_bitwise_the_eager_run_with_one_commit_per_owner(tmp_path):
    eager = train(tmp_path / "eager", graphed=False)
    graphed = train(tmp_path / "graphed", graphed=True)
    runner = graphed[0].graphed.runner
    assert isinstance(runner, f8s.GraphedStep) and runner.graph is not None
    assert runner.eager_calls == 2 and runner.replays == STEPS - 2
    assert_bitwise_same(eager, graphed)
    assert losses(tmp_path / "graphed") == losses(tmp_path / "eager")
    sat = [  # the saturated fractions logged: replays count in the kernels, as the eager run does
        [
            {k: v for k, v in r.items() if k.startswith("fp8state/saturated_frac")}
            for r in read_jsonl(d / "telemetry.jsonl")
        ]
        for d in (tmp_path / "eager", tmp_path / "graphed")
    ]
    assert sat[0] == sat[1] and sum(len(r) for r in sat[1]) >= STEPS
    state = graphed[2].state
    owners = state.ledger.owners()
    assert owners and state.ledger.ok and state.clock.last == (STEPS - 1, 0)
    for event in state.ledger.events():
        assert all(state.ledger.commits(owner, event) == 1 for owner in owners), event
    # the history moved on every replayed event (the device work of the capture, replayed)
    assert not bitwise_equal(state.bank.amax_history[0], state.bank.amax_history[1])


def test_the_naive_mode_captured_replays_its_defect_and_is_counted_in_every_event(tmp_path):
    eager = train(tmp_path / "eager", graphed=False, mode="naive")
    graphed = train(tmp_path / "graphed", graphed=True, mode="naive")
    assert_bitwise_same(eager, graphed)
    ea, ga = eager[2].state.ledger, graphed[2].state.ledger

    def second_commits(ledger):
        return sorted((v.event, str(v.owner)) for v in ledger.violations if v.kind == "second_commit")

    assert second_commits(ga) == second_commits(ea)
    assert {event for event, _ in second_commits(ga)} == {(s, 0) for s in range(STEPS)}  # every event, replays too


def test_cli_trainer_cuda_graphs_is_bitwise_the_eager_run_and_its_steady_steps_never_sync(
    tmp_path,
    monkeypatch,
    watched,  # noqa: F811
):
    """``fp8state train trainer.cuda_graphs=true`` on one GPU, bf16 autocast, the fused AdamW
    clipped by the telemetry: the final weights, the quantizer state and every step's loss and
    grad norm equal the eager run's; steps 3-9 (replays) run with syncs raising."""
    from lightning_fp8state.cli.main import main
    from lightning_fp8state.telemetry.sinks import read_jsonl

    monkeypatch.chdir(tmp_path)
    common = [
        *CLI_ON_THE_GPU,
        "telemetry.log_every_n_steps=100",  # no log step inside the watched steps
        "trainer.gradient_clip_val=0.5",
        "trainer.max_steps=12",
        "trainer.checkpoint_every_n_steps=12",
    ]
    watched.first = 10**9  # the eager run is not watched (tests/gpu/test_lightning_sync_free.py does that)
    assert main(["train", *common, f"out_dir={tmp_path / 'eager'}"]) == 0
    watched.first, watched.checked = 3, []
    assert main(["train", *common, "trainer.cuda_graphs=true", f"out_dir={tmp_path / 'graphed'}"]) == 0
    assert watched.checked == list(range(3, 10))
    runs = [tmp_path / name / "tiny_gpt_cpu" for name in ("eager", "graphed")]
    a, b = (torch.load(r / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu") for r in runs)
    for k in a["state_dict"]:
        assert bitwise_equal(a["state_dict"][k], b["state_dict"][k]), k
    for k in ("scale", "amax_history"):
        assert bitwise_equal(a["fp8state"]["ranks"][0]["bank"][k], b["fp8state"]["ranks"][0]["bank"][k]), k
    logged = [[(r["train/loss"], r["train/grad_norm"]) for r in read_jsonl(r / "telemetry.jsonl")] for r in runs]
    assert len(logged[0]) == 12 and logged[0] == logged[1]


@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_blockwise"])
def test_cli_cuda_graphs_with_a_stateless_recipe_is_bitwise_its_eager_run(tmp_path, monkeypatch, recipe):
    """A stateless recipe (scales from each call's own tensor, derived on the device) replays
    from the whole-step graph: weights and every step's loss and grad norm equal the eager run's.
    fp8_rowwise failed this on the H200 (from step 0; 2026-12-02) while its op wrappers did not
    load the kernels: the eager run's first calls went to the pure-torch reference."""
    from lightning_fp8state.cli.main import main
    from lightning_fp8state.telemetry.sinks import read_jsonl

    monkeypatch.chdir(tmp_path)
    common = [
        *CLI_ON_THE_GPU,
        f"quant.recipe={recipe}",  # with configs/quant/<recipe>.yaml's formats (the CLI merges the piece)
        "trainer.max_steps=10",
        "trainer.checkpoint_every_n_steps=10",
    ]
    assert main(["train", *common, f"out_dir={tmp_path / 'eager'}"]) == 0
    assert main(["train", *common, "trainer.cuda_graphs=true", f"out_dir={tmp_path / 'graphed'}"]) == 0
    assert main(["train", *common, f"out_dir={tmp_path / 'eager2'}"]) == 0  # is eager itself repeatable?
    runs = [tmp_path / name / "tiny_gpt_cpu" for name in ("eager", "graphed", "eager2")]
    a, b, c = (torch.load(r / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu") for r in runs)
    logged = [[(r["train/loss"], r["train/grad_norm"]) for r in read_jsonl(r / "telemetry.jsonl")] for r in runs]
    first = next((i for i, (x, y) in enumerate(zip(logged[0], logged[1], strict=True)) if x != y), None)
    differ = [k for k in a["state_dict"] if not bitwise_equal(a["state_dict"][k], b["state_dict"][k])]
    eager_repeat = [k for k in a["state_dict"] if not bitwise_equal(a["state_dict"][k], c["state_dict"][k])]
    facts = (f"first differing step {first}", differ, f"eager vs eager differs in {eager_repeat}", logged)
    assert not differ and first is None, facts
    assert len(logged[0]) == 10
