"""torch.compile on the GPU: each block one Inductor graph with Fp8Linear as its opaque op
(``fp8state::fp8_linear``, _scaled_mm and the CUDA kernels inside), bitwise the eager run,
no host sync inside a step, and captured whole by GraphedStep (compile+graphs, the benchmark's
fastest mode) with the replay bitwise the compiled eager run."""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state.models import GPT
from tests.conftest import bitwise_equal

# the same model, data and step body as the eager GraphedStep tests
from tests.gpu.test_graphs import CFG, batches, make_body, pytestmark  # noqa: F401  (pytestmark: the GPU marks)

STEPS = 5
# fp8state train on one GPU at a small shape (bf16 autocast, no W&B): the GPU CLI tests' base
CLI_ON_THE_GPU = [
    "model.d_model=128",
    "model.n_layers=2",
    "model.seq_len=64",
    "data.batch_size=8",
    "data.num_samples=800",
    "telemetry.wandb=disabled",
    "trainer.accelerator=gpu",
    "trainer.precision=bf16-mixed",
]


def build(compiled: bool, graphs: bool = False, recipe: str = "fp8_delayed", backward_format: str = "auto"):
    # the stateless recipes run torch's LayerNorm / GELU outside the op: under Inductor those are
    # its own kernels, whose bits differ from eager's; aot_eager runs the eager kernels
    backend = "inductor" if recipe == "fp8_delayed" else "aot_eager"
    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    cfg = f8s.QuantConfig(mode="safe", strict=True, recipe=recipe, backward_format=backward_format)
    state = f8s.Fp8State(cfg)
    state.convert(model)
    if compiled:
        torch._dynamo.reset()
        for block in model.blocks:
            block.compile(fullgraph=True, backend=backend)  # a graph break raises
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=graphs)
    return model, state, opt


def run(data, compiled: bool, sync_check_from: int | None = None, recipe: str = "fp8_delayed", backward_format="auto"):
    model, state, opt = build(compiled, recipe=recipe, backward_format=backward_format)
    body = make_body(model, state)
    losses = []
    for n, (x, y) in enumerate(data):
        if sync_check_from is not None and n >= sync_check_from:
            torch.cuda.set_sync_debug_mode("error")
        try:
            with state.step(n, 0):
                losses.append(body(x, y))
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return model, state, torch.stack(losses)


def assert_same(run_a, run_b):
    (ma, sa, la), (mb, sb, lb) = run_a, run_b
    assert bitwise_equal(la, lb), (la, lb)
    for (name, p), q in zip(ma.named_parameters(), mb.parameters(), strict=True):
        assert bitwise_equal(p, q), name
    assert bitwise_equal(sa.bank.scale, sb.bank.scale)
    assert bitwise_equal(sa.bank.amax_history, sb.bank.amax_history)


@pytest.mark.parametrize(
    "recipe, backward_format",
    [
        ("fp8_delayed", "e5m2"),
        ("fp8_current", "e5m2"),
        ("fp8_rowwise", "e4m3"),  # as configs/quant/fp8_rowwise.yaml ships it: every GEMM cuBLASLt's
        # E5M2 gradients: the backward's GEMMs run the float32 emulation; the eager backward ran
        # them in bfloat16 under the step's autocast (the compiled op's did not): the two differed
        # on the H200 (2026-12-02) until the eager backward turned autocast off as well
        ("fp8_rowwise", "e5m2"),
    ],
)
def test_compiled_training_is_bitwise_the_eager_run_and_never_syncs(recipe, backward_format):
    data = batches(STEPS)
    eager = run(data, compiled=False, recipe=recipe, backward_format=backward_format)
    # steps 0-1 compile and calibrate
    compiled = run(data, compiled=True, sync_check_from=2, recipe=recipe, backward_format=backward_format)
    assert_same(eager, compiled)
    assert not compiled[1].ledger.violations


def test_compiled_blocks_captured_by_graphed_step_replay_the_compiled_run():
    data = batches(STEPS)
    reference = run(data, compiled=True)
    model, state, opt = build(compiled=True, graphs=True)
    graphed = f8s.GraphedStep(state, make_body(model, state), *data[0], optimizer=opt, warmup=2)
    losses = torch.stack([graphed(n, x, y).clone() for n, (x, y) in enumerate(data)])
    assert graphed.replays == STEPS - 2
    assert_same(reference, (model, state, losses))


def test_cli_trainer_compile_on_the_gpu_is_bitwise_the_eager_run(tmp_path, monkeypatch):
    """``fp8state train trainer.compile=true`` on one GPU, bf16 autocast, Inductor: the final
    weights, the quantizer state and the logged losses equal the eager run's."""
    from lightning_fp8state.cli.main import main
    from lightning_fp8state.telemetry.sinks import read_jsonl

    monkeypatch.chdir(tmp_path)
    common = [
        *CLI_ON_THE_GPU,
        "telemetry.log_every_n_steps=4",
        "trainer.max_steps=8",
        "trainer.checkpoint_every_n_steps=8",
    ]
    assert main(["train", *common, f"out_dir={tmp_path / 'eager'}"]) == 0
    torch._dynamo.reset()
    assert main(["train", *common, "trainer.compile=true", f"out_dir={tmp_path / 'compiled'}"]) == 0
    runs = [tmp_path / name / "tiny_gpt_cpu" for name in ("eager", "compiled")]
    a, b = (torch.load(r / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu") for r in runs)
    for k in a["state_dict"]:
        assert bitwise_equal(a["state_dict"][k], b["state_dict"][k]), k
    assert bitwise_equal(a["fp8state"]["ranks"][0]["bank"]["scale"], b["fp8state"]["ranks"][0]["bank"]["scale"])
    losses = [[r["train/loss"] for r in read_jsonl(r / "telemetry.jsonl")] for r in runs]
    assert losses[0] == losses[1]
