"""GraphedBlocks with real CUDA graphs: bitwise the eager checkpointed run (the CUDA kernels and
torch._scaled_mm), one commit per owner, naive caught on replay, replays free of host syncs, and
``fp8state train trainer.cuda_graphs=true`` under fp8state_ddp, fp8state_deepspeed and fp8state_fsdp
bitwise the eager run of the same strategy (FSDP2's: written, not yet run on a GPU)."""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state.graphs import CudaGraphBackend, GraphedBlocks
from tests.conftest import bitwise_equal
from tests.gpu.test_compile_cuda import CLI_ON_THE_GPU
from tests.unit.test_block_graphs import N_EVENTS, WARMUP, Net, inputs, train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize(
    "recipe", ["fp8_delayed", "bf16", "fp8_current", "fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_blockwise"]
)
def test_cuda_graphed_blocks_train_bitwise_the_eager_run(recipe):
    ref_state, ref_model, ref_outs, _, _ = train(False, recipe=recipe, device="cuda")
    state, model, outs, _, _ = train(True, recipe=recipe, device="cuda", backend=CudaGraphBackend())
    assert model.runner.replays == N_EVENTS - WARMUP
    for i, (a, b) in enumerate(zip(ref_outs, outs, strict=True)):
        assert bitwise_equal(a, b), f"event {i}: output differs"
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters(), strict=True):
        assert bitwise_equal(p, q), name
    if recipe == "fp8_delayed":
        assert bitwise_equal(ref_state.bank.scales, state.bank.scales)
    for event in state.ledger.events():
        assert {r.commits for r in state.ledger.event(event).values()} == {1}, event
    assert state.ledger.ok


def test_cuda_graphed_blocks_naive_is_caught_on_replay():
    state, _, _, _, _ = train(True, mode="naive", device="cuda", backend=CudaGraphBackend())
    kinds = {}
    for v in state.ledger.violations:
        kinds.setdefault(v.event, set()).add(v.kind)
    for event in [(i, 0) for i in range(WARMUP + 1, N_EVENTS)]:
        assert {"record_in_recompute", "second_commit"} <= kinds.get(event, set()), event


def test_cuda_graphed_blocks_hold_one_blocks_parameter_gradients_not_one_per_block():
    """Peak memory of a graphed stack above its eager run, for blocks whose parameters dwarf
    their activations, at two depths: the graphs keep one block's gradient buffers (shared by
    every block of the layout), so the excess does not grow with the depth; a buffer per block
    held the stack's parameter gradients a second time (a transformers Llama 1B graphed per
    layer peaked 4.0 GiB above its eager run). Constant costs (the side stream's cuBLAS
    workspace) cancel in the difference."""
    from tests.conftest import Block

    d = 1024
    block_grad_bytes = sum(p.numel() * 4 for p in Block(d).parameters())  # float32 gradients

    def peak(graphed: bool, n_blocks: int) -> int:
        torch.manual_seed(0)
        state = f8s.Fp8State(f8s.QuantConfig(strict=False))
        blocks = state.convert(torch.nn.ModuleList(Block(d) for _ in range(n_blocks))).cuda()
        runner = GraphedBlocks(blocks, warmup=1) if graphed else None
        x = torch.randn(64, d, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for step in range(3):
            with state.step(step):
                h = x
                if runner is not None:
                    h = runner(h)
                else:
                    for block in blocks:
                        h = f8s.checkpoint(block, h, engine="torch", use_reentrant=False)
                loss = h.float().pow(2).mean()
                state.commit_forward()
                loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    excess = {n: peak(True, n) - peak(False, n) for n in (2, 6)}
    # per-block buffers: 4 more blocks' gradients (67 MB here) in the deeper stack's excess
    assert excess[6] - excess[2] < block_grad_bytes, (excess, block_grad_bytes)


@pytest.mark.parametrize("recipe", ["fp8_delayed", "fp8_current", "fp8_rowwise", "fp8_blockwise"])
def test_cuda_graphed_blocks_replays_never_sync(recipe):
    # the recipe's own formats (E4M3 gradients for rowwise, blockwise)
    state = f8s.Fp8State(f8s.QuantConfig(recipe=recipe))
    model = state.convert(Net()).cuda()
    model.runner = GraphedBlocks(model.blocks, warmup=1)
    xs = inputs(6, device="cuda")
    for i, x in enumerate(xs):
        if i >= 2:  # after the capture: every replayed event with syncs raising
            torch.cuda.set_sync_debug_mode("error")
        try:
            with state.step(i):
                loss = model(x).float().pow(2).mean()
                state.commit_forward()
                loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        model.zero_grad(set_to_none=True)
    assert model.runner.replays == 5


@pytest.mark.parametrize("strategy", ["fp8state_ddp", "fp8state_deepspeed", "fp8state_fsdp"])
def test_cli_cuda_graphs_under_a_data_parallel_strategy_is_bitwise_its_eager_run(tmp_path, monkeypatch, strategy):
    from lightning_fp8state.cli.main import main
    from lightning_fp8state.telemetry.sinks import read_jsonl

    monkeypatch.chdir(tmp_path)
    common = [
        *CLI_ON_THE_GPU,
        f"strategy.name={strategy}",
        "trainer.devices=1",
        "telemetry.log_every_n_steps=1",
        "trainer.max_steps=8",
        "trainer.checkpoint_every_n_steps=8",
    ]
    assert main(["train", *common, f"out_dir={tmp_path / 'eager'}"]) == 0
    assert main(["train", *common, "trainer.cuda_graphs=true", f"out_dir={tmp_path / 'graphed'}"]) == 0
    runs = [tmp_path / name / "tiny_gpt_cpu" for name in ("eager", "graphed")]
    logged = [[(r["train/loss"], r["train/grad_norm"]) for r in read_jsonl(r / "telemetry.jsonl")] for r in runs]
    assert len(logged[0]) == 8 and logged[0] == logged[1]
    if strategy == "fp8state_ddp":
        a, b = (torch.load(r / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu") for r in runs)
        for k in a["state_dict"]:
            assert bitwise_equal(a["state_dict"][k], b["state_dict"][k]), k
        for k in ("scale", "amax_history"):
            assert bitwise_equal(a["fp8state"]["ranks"][0]["bank"][k], b["fp8state"]["ranks"][0]["bank"][k]), k
