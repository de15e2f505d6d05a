"""torchtitan: a tiny Llama3 (its own model code and configs, FlexAttention swapped for SDPA on
the CPU) with torchtitan's own full and selective activation checkpointing (``FullAC``,
``SelectiveAC``: torch SAC with its default save list, every second mm recomputed),
checkpointed gradients bitwise equal to plain ones over several AdamW steps, the naive mode
differing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lightning_fp8state as f8s
from tests.integration.common import (
    STEPS,
    VOCAB,
    assert_audit_complete,
    assert_bitwise,
    batches,
    differing,
    need,
    train,
)

need("torchtitan")
llama3 = need("torchtitan.models.llama3")
ac = need("torchtitan.distributed.activation_checkpoint")
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.embedding import Embedding  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.nn_modules import RMSNorm  # noqa: E402
from torchtitan.models.common.rope import ComplexRoPE  # noqa: E402

DIM, HEADS, LAYERS = 64, 4, 2


def tiny_llama3(device="cpu"):
    """torchtitan's debugmodel recipe, shrunk; SDPA (causal) instead of FlexAttention."""
    layers = llama3._build_llama3_layers(
        n_layers=LAYERS,
        dim=DIM,
        n_heads=HEADS,
        n_kv_heads=2,
        hidden_dim=128,
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=500000, scaling="none"),
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg = llama3.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)),
        layers=layers,
    )
    with torch.device(device):
        model = cfg.build()
        model.init_states()
    return model


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


AC = {
    "full": lambda: ac.FullAC(ac.FullAC.Config()),
    "selective": lambda: ac.SelectiveAC(ac.SelectiveAC.Config()),
}


def run(mode, policy, device="cpu"):
    torch.manual_seed(0)
    model = tiny_llama3(device)
    state = f8s.Fp8State(f8s.QuantConfig(mode=mode, strict=False))
    state.convert(model)
    if policy is not None:
        AC[policy]().apply(model)
    grads, report = train(state, model, loss_fn, batches(device=device))
    return state, grads, report


def positional(grads):
    # the checkpoint wrapper renames parameters: compare by position
    return [dict(enumerate(g.values())) for g in grads]


@pytest.fixture(scope="module")
def plain():
    return {mode: run(mode, None) for mode in ("safe", "naive")}


@pytest.mark.parametrize("policy", sorted(AC))
def test_torchtitan_activation_checkpointing_bitwise(plain, policy):
    _, ref, _ = plain["safe"]
    state, got, report = run("safe", policy)
    # wqkv, wo, w1, w2, w3 per layer, and lm_head
    assert len(state.last_conversion.converted) == LAYERS * 5 + 1, str(state.last_conversion)
    assert_bitwise(positional(ref), positional(got))
    assert_audit_complete(report, min_recomputed=LAYERS * 5 * STEPS)


@pytest.mark.parametrize("policy", sorted(AC))
def test_torchtitan_naive_mode_differs(plain, policy):
    _, ref, _ = plain["naive"]
    _, got, report = run("naive", policy)
    assert differing(positional(ref), positional(got))
    assert not report.ok


@pytest.mark.parametrize("policy", sorted(AC))
def test_torchtitan_compiled_blocks_under_its_activation_checkpointing_bitwise(plain, policy):
    """torchtitan's TransformerBlocks compiled (as its own per-block compile does; each converted
    linear one op in the block's graph) under its full and selective AC: gradients bitwise those
    of the plain eager run. The blocks run once under no_grad first: SAC must not see a
    process's first compile (docs/MODELS.md)."""
    torch.manual_seed(0)
    model = tiny_llama3()
    state = f8s.Fp8State(f8s.QuantConfig(mode="safe", strict=False))
    state.convert(model)
    AC[policy]().apply(model)
    torch._dynamo.reset()
    for block in model.layers.children():
        block.compile(backend="aot_eager")
    with torch.no_grad():
        model(batches()[0][:, :-1])
    got, _ = train(state, model, loss_fn, batches(), audit=False)
    _, ref, _ = plain["safe"]
    assert_bitwise(positional(ref), positional(got))
    assert not state.ledger.violations
