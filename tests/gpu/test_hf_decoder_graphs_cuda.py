"""graph_decoder_layers with real CUDA graphs: a tiny transformers Llama converted to FP8, its
decoder layers captured per layer through the model's own loop, bitwise the eager checkpointed
run (loss, gradients, scales), one commit per owner per event."""

from __future__ import annotations

import pytest
import torch

from lightning_fp8state.graphs import CudaGraphBackend
from tests.conftest import bitwise_equal

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
