"""graph_decoder_layers with real CUDA graphs: a tiny transformers Llama converted to FP8, its
decoder layers captured per layer through the model's own loop, bitwise the eager checkpointed
run (loss, gradients, scales), one commit per owner per event; and the same through
Fp8StateCallback(graph_blocks=True) under fp8state_deepspeed (ZeRO-2), fp8state_ddp and
fp8state_fsdp (each decoder layer an FSDP2 unit, its weights all-gathered as FP8 codes: the
layers captured and replayed inside the units' calls) on one GPU."""

from __future__ import annotations

import pytest
import torch

from lightning_fp8state.graphs import CudaGraphBackend
from tests.conftest import bitwise_equal
from tests.lightning.launch import load_ranks, run_plan

pytest.importorskip("transformers")

from tests.unit.test_hf_decoder_graphs import N_EVENTS, WARMUP, train  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_cuda_graphed_hf_decoder_layers_train_bitwise_the_eager_run():
    ref_state, _, ref_losses, ref_grads, _, _ = train(False, device="cuda")
    state, _, losses, grads, runner, _ = train(True, device="cuda", backend=CudaGraphBackend())
    assert runner.eager_calls == WARMUP and runner.replays == N_EVENTS - WARMUP
    for i, (a, b) in enumerate(zip(ref_losses, losses, strict=True)):
        assert bitwise_equal(a, b), f"event {i}: loss differs ({a.item()} vs {b.item()})"
    for i, (ga, gb) in enumerate(zip(ref_grads, grads, strict=True)):
        for name in ga:
            assert bitwise_equal(ga[name], gb[name]), f"step {i}: grad of {name} differs"
    assert bitwise_equal(ref_state.bank.scales, state.bank.scales)
    for event in state.ledger.events():
        assert {r.commits for r in state.ledger.event(event).values()} == {1}, event
    assert state.ledger.ok


STRATEGIES = {
    "deepspeed": {"strategy": "fp8state_deepspeed", "strategy_kwargs": {"stage": 2}},
    "ddp": {"strategy": "fp8state_ddp"},
    "fsdp": {"strategy": "fp8state_fsdp"},  # FP8 all-gather (the strategy's default)
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_graph_blocks_switch_under_each_strategy_is_bitwise_the_eager_fit(tmp_path, strategy):
    common = {
        "model": "hf_llama",
        "accelerator": "cuda",
        "devices": 1,
        "precision": "bf16-mixed",
        "audit": False,
        "samples": 12,  # 6 batches of 2
        "max_epochs": 1,
        "accumulate": 1,
        **STRATEGIES[strategy],
    }
    run_plan([{**common, "name": "eager"}, {**common, "name": "graphed", "graph_blocks": True}], tmp_path)
    (eager,), (graphed,) = load_ranks(tmp_path, "eager", 1), load_ranks(tmp_path, "graphed", 1)
    assert graphed["strategy"] == eager["strategy"] and graphed["replays"] == 6 - 2
    if strategy == "fsdp":  # the decoder layers' weights reach the graphs as FP8-gathered codes
        assert len([k for k in graphed["fp8_gathered"] if ".layers." in k]) == 14, graphed["fp8_gathered"]
    for i, (a, b) in enumerate(zip(eager["losses"], graphed["losses"], strict=True)):
        assert bitwise_equal(a, b), f"step {i}: loss differs"
    for name, p in eager["params"].items():
        assert bitwise_equal(p, graphed["params"][name]), name
    assert bitwise_equal(eager["bank"]["scale"], graphed["bank"]["scale"])
    assert graphed["violations"] == 0
