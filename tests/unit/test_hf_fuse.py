"""fuse_decoder_projections: a transformers LlamaForCausalLM on the fused FP8 path (RMSNorm folded
into one q/k/v and one gate/up encode, SwiGLU into down's) trains bitwise our own
Llama(fused_projections=True) on the same weights, under checkpointing, audited clean, graphed
per layer bitwise its eager run; unfuse restores transformers' modules and keys; what is refused."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.errors import ConfigError
from lightning_fp8state.graphs import graph_decoder_layers
from lightning_fp8state.models import load_hf_llama
from lightning_fp8state.models.hf_fuse import (
    DeferredRMSNorm,
    FusedSwiGLU,
    ProjectionSlice,
    fuse_decoder_projections,
    unfuse_decoder_projections,
)
from tests.conftest import bitwise_equal
from tests.graph_emulation import EmulatedGraphBackend
from tests.unit.test_llama import hf_model

STEPS = 4
CONFIG = {"strict": False, "exclude": ["*lm_head"]}


def batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 97, (2, 24), generator=g) for _ in range(STEPS)]


def checkpoint_layers(model) -> None:
    for layer in model.model.layers:
        original = layer.forward

        def forward(hidden, *args, _original=original, **kwargs):
            return f8s.checkpoint(functools.partial(_original, **kwargs), hidden, *args, use_reentrant=False)

        layer.forward = forward


def train(model, loss_of, audit=True):
    """STEPS events of ``model`` converted to FP8 delayed scaling: losses, the fused projections'
    gradients by their names without the ``model.`` prefix, the state and the audit report."""
    state = f8s.Fp8State(f8s.QuantConfig(**CONFIG))
    state.convert(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, grads = [], []
    auditor = f8s.RecomputeAuditor(state, model=model).__enter__() if audit else None
    for step, idx in enumerate(batches()):
        with state.step(step):
            loss = loss_of(model, idx)
            state.commit_forward()
            loss.backward()
        losses.append(loss.detach())
        grads.append({n.removeprefix("model."): p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    report = None
    if auditor is not None:
        auditor.__exit__(None, None, None)
        report = auditor.report()
    return losses, grads, state, report


def hf_loss(model, idx):
    logits = model(input_ids=idx, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 97), idx[:, 1:].reshape(-1))


def our_loss(model, idx):
    return torch.nn.functional.cross_entropy(model(idx)[:, :-1].reshape(-1, 97), idx[:, 1:].reshape(-1))


def test_a_fused_transformers_llama_trains_bitwise_our_fused_llama(tmp_path):
    _, hf = hf_model(tmp_path, tie=False)
    ours, _ = load_hf_llama(tmp_path, training={"fused_projections": True, "checkpoint": True})
    hf.train()
    fuse_decoder_projections(hf)
    checkpoint_layers(hf)
    layer = hf.model.layers[0]
    assert isinstance(layer.input_layernorm, DeferredRMSNorm) and isinstance(layer.mlp, FusedSwiGLU)
    assert isinstance(layer.self_attn.k_proj, ProjectionSlice)
    # the parameters are ours by name (transformers' keys with the fused projections'), value for value
    theirs = {n.removeprefix("model."): p for n, p in hf.named_parameters()}
    assert set(theirs) == {n for n, _ in ours.named_parameters()}
    for name, p in ours.named_parameters():
        assert bitwise_equal(p, theirs[name]), name
    ref_losses, ref_grads, ref_state, _ = train(ours, our_loss)
    losses, grads, state, report = train(hf, hf_loss)
    assert report.ok and report.recomputed > 0, report
    for i, (a, b) in enumerate(zip(ref_losses, losses, strict=True)):
        assert bitwise_equal(a, b), f"step {i}: loss {a.item()} vs {b.item()}"
    for i, (ga, gb) in enumerate(zip(ref_grads, grads, strict=True)):
        for name in ga:
            assert bitwise_equal(ga[name], gb[name]), f"step {i}: grad of {name}"
    # the owners are ours (one input owner for q/k/v and one for gate/up per layer), by layer name
    assert [(o.layer.removeprefix("model."), o.role) for o in state.bank.owners] == [
        (o.layer, o.role) for o in ref_state.bank.owners
    ]
    assert bitwise_equal(ref_state.bank.scales, state.bank.scales)
    assert state.ledger.ok and not state.ledger.violations


def test_q_k_and_v_run_one_projection_per_input(tmp_path):
    _, hf = hf_model(tmp_path, tie=True)
    fuse_decoder_projections(hf)
    attn = hf.model.layers[0].self_attn
    calls = []
    attn.qkv_proj.register_forward_hook(lambda m, i, o: calls.append(i[0]))
    x = torch.randn(2, 5, 64)
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    assert len(calls) == 1 and attn._fp8state_qkv is None  # nothing held once v is served
    expected = attn.qkv_proj(attn._fp8state_norm.norm()(x)).split(attn._fp8state_widths, dim=-1)
    for got, want in zip((q, k, v), expected, strict=True):
        assert bitwise_equal(got, want)
    # another input, or k first: the projection runs again and the answer is still right
    y = torch.randn(2, 5, 64)
    assert bitwise_equal(
        attn.k_proj(y), attn.qkv_proj(attn._fp8state_norm.norm()(y)).split(attn._fp8state_widths, -1)[1]
    )


def test_graphed_layers_of_a_fused_model_train_bitwise_its_eager_run(tmp_path):
    runs = []
    for graphed in (False, True):
        _, hf = hf_model(tmp_path / str(graphed), tie=True)
        hf.train()
        fuse_decoder_projections(hf)
        if graphed:
            state = f8s.Fp8State(f8s.QuantConfig(**CONFIG))
            state.convert(hf)
            runner = graph_decoder_layers(hf, warmup=2, backend=EmulatedGraphBackend())
            losses, grads = [], []
            opt = torch.optim.SGD(hf.parameters(), lr=0.05)
            for step, idx in enumerate(batches()):
                with state.step(step):
                    loss = hf_loss(hf, idx)
                    state.commit_forward()
                    loss.backward()
                losses.append(loss.detach())
                grads.append({n: p.grad.clone() for n, p in hf.named_parameters()})
                opt.step()
                opt.zero_grad(set_to_none=True)
            assert runner.replays == STEPS - 2
            runs.append((losses, grads))
        else:
            checkpoint_layers(hf)
            losses, grads, _, _ = train(hf, hf_loss, audit=False)
            runs.append(
                (losses, [{f"model.{n}" if n != "lm_head.weight" else n: g for n, g in s.items()} for s in grads])
            )
    (ref_losses, ref_grads), (losses, grads) = runs
    for i, (a, b) in enumerate(zip(ref_losses, losses, strict=True)):
        assert bitwise_equal(a, b), f"step {i}: loss"
    for i, (ga, gb) in enumerate(zip(ref_grads, grads, strict=True)):
        for name in gb:
            assert bitwise_equal(ga[name], gb[name]), f"step {i}: grad of {name}"


def test_unfuse_restores_transformers_modules_keys_and_outputs(tmp_path):
    transformers, hf = hf_model(tmp_path, tie=False)
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    keys = list(hf.state_dict())
    fuse_decoder_projections(hf)
    assert "model.layers.0.self_attn.qkv_proj.weight" in hf.state_dict()
    assert "model.layers.0.input_layernorm.weight" in hf.state_dict()  # the norm's weight keeps its key
    unfuse_decoder_projections(hf)
    assert list(hf.state_dict()) == keys
    assert type(hf.model.layers[0].input_layernorm).__name__ == "LlamaRMSNorm"
    idx = batches()[0]
    with torch.no_grad():
        assert bitwise_equal(hf(input_ids=idx).logits, reference(input_ids=idx).logits)
    with pytest.raises(ConfigError, match="layer 0 is not fused"):
        unfuse_decoder_projections(hf)


def test_refusals_name_what_differs(tmp_path):
    _, hf = hf_model(tmp_path, tie=True)
    f8s.Fp8State(f8s.QuantConfig(**CONFIG)).convert(hf)
    with pytest.raises(
        ConfigError, match=r"layer 0.self_attn.q_proj is already converted to FP8: fuse the projections first"
    ):
        fuse_decoder_projections(hf)
    _, hf = hf_model(tmp_path / "b", tie=True)
    fuse_decoder_projections(hf)
    with pytest.raises(ConfigError, match="layer 0 is fused already"):
        fuse_decoder_projections(hf)
    f8s.Fp8State(f8s.QuantConfig(**CONFIG)).convert(hf)
    with pytest.raises(ConfigError, match="qkv_proj is already converted to FP8"):
        unfuse_decoder_projections(hf)
    _, hf = hf_model(tmp_path / "c", tie=True)
    hf.model.layers[1].mlp.act_fn = nn.GELU()
    with pytest.raises(ConfigError, match=r"layer 1.mlp.act_fn is GELU; expected SiLU"):
        fuse_decoder_projections(hf)
    assert not isinstance(hf.model.layers[0].input_layernorm, DeferredRMSNorm)  # checked before any change
    with pytest.raises(ConfigError, match="expected one ModuleList of decoder layers"):
        fuse_decoder_projections(nn.Linear(2, 2))
