"""A tiny transformers LlamaForCausalLM, converted to FP8, its decoder layers graphed by
graph_decoder_layers (graphs emulated on the CPU): trained through the model's own forward loop,
bitwise the eager run with the layers checkpointed (loss and gradients), that eager run audited
clean, one commit per owner per event; and what is refused."""

from __future__ import annotations

import functools

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state.graphs import find_decoder_layers, graph_decoder_layers
from tests.conftest import bitwise_equal
from tests.graph_emulation import EmulatedGraphBackend

transformers = pytest.importorskip("transformers")

N_EVENTS = 5
WARMUP = 2
VOCAB, SEQ, BATCH = 128, 16, 2


def make_model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",  # the mask reaches the layers as a tensor
    )
    return transformers.LlamaForCausalLM(config)


def checkpoint_layers(model) -> None:
    """The eager reference: each decoder layer checkpointed by lightning_fp8state.checkpoint."""
    for layer in model.model.layers:
        original = layer.forward

        def forward(hidden, *args, _original=original, **kwargs):
            return f8s.checkpoint(
                functools.partial(_original, **kwargs), hidden, *args, engine="torch", use_reentrant=False
            )

        layer.forward = forward


def batches(n=N_EVENTS):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(n)]


def train(graphed: bool, audit: bool = False, device: str = "cpu", backend=None):
    """N events of the tiny Llama; ``backend``: the graphs' (the emulation on the CPU by default)."""
    state = f8s.Fp8State(f8s.QuantConfig(strict=False))
    model = state.convert(make_model()).to(device)
    model.train()
    runner = None
    if graphed:
        runner = graph_decoder_layers(model, warmup=WARMUP, backend=backend or EmulatedGraphBackend())
    else:
        checkpoint_layers(model)
    auditor = f8s.RecomputeAuditor(state, model=model).__enter__() if audit else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for i, ids in enumerate(batches()):
        ids = ids.to(device)
        with state.step(i):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            state.commit_forward()
            loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    report = None
    if auditor is not None:
        auditor.__exit__(None, None, None)
        report = auditor.report()
    return state, model, losses, grads, runner, report


def test_graphed_hf_decoder_layers_train_bitwise_the_eager_checkpointed_run():
    ref_state, ref_model, ref_losses, ref_grads, _, report = train(False, audit=True)
    assert report.ok, report
    state, model, losses, grads, runner, _ = train(True)
    assert runner.eager_calls == WARMUP and runner.replays == N_EVENTS - WARMUP
    assert all(g.fwd.replays == N_EVENTS - WARMUP for g in runner.graphs)
    for i, (a, b) in enumerate(zip(ref_losses, losses, strict=True)):
        assert bitwise_equal(a, b), f"event {i}: loss differs ({a.item()} vs {b.item()})"
    for i, (ga, gb) in enumerate(zip(ref_grads, grads, strict=True)):
        assert set(ga) == set(gb)
        for name in ga:
            assert bitwise_equal(ga[name], gb[name]), f"step {i}: grad of {name} differs"
    assert bitwise_equal(ref_state.bank.scales, state.bank.scales)
    for event in state.ledger.events():
        assert {r.commits for r in state.ledger.event(event).values()} == {1}, event
    assert state.ledger.ok and not state.ledger.violations
    # the layers stay where they were: the state dict's keys are the model's own
    assert list(model.state_dict()) == list(ref_model.state_dict())
    # evaluation runs the layers' own forward, no graph replayed
    with torch.no_grad():
        model(input_ids=batches(1)[0], use_cache=False)
    assert all(g.fwd.replays == N_EVENTS - WARMUP for g in runner.graphs)


def test_graphed_hf_decoder_layers_refusals():
    state = f8s.Fp8State(f8s.QuantConfig(strict=False))
    model = state.convert(make_model())
    graph_decoder_layers(model, warmup=1, backend=EmulatedGraphBackend())
    with pytest.raises(f8s.ConfigError, match="graphed already"):
        graph_decoder_layers(model)
    ids = batches(1)[0]
    with state.step(0), pytest.raises(f8s.ConfigError, match="argument 'past_key_values' is a DynamicCache.*use_cache"):
        model(input_ids=ids, labels=ids, use_cache=True)
    other = make_model()
    other.gradient_checkpointing_enable()
    with pytest.raises(f8s.ConfigError, match="gradient_checkpointing_disable"):
        graph_decoder_layers(other)
    with pytest.raises(f8s.ConfigError, match="expected one ModuleList of decoder layers"):
        find_decoder_layers(torch.nn.Linear(2, 2))
    assert find_decoder_layers(torch.nn.ModuleDict({"net": other}), "net.model.layers") is other.model.layers
