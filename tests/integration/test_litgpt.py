"""litgpt: a tiny Llama-style ``litgpt.model.GPT`` (no weights downloaded) whose blocks are wrapped
as litgpt does it (Fabric's ``activation_checkpointing_policy={Block}`` applies torch's
``checkpoint_wrapper`` to every ``Block``), checkpointed gradients bitwise equal to plain ones
over several AdamW steps, the naive mode differing."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

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

litgpt_model = need("litgpt.model")


def tiny_gpt():
    cfg = litgpt_model.Config(
        name="tiny-llama",
        block_size=32,
        vocab_size=VOCAB,
        padded_vocab_size=VOCAB,
        n_layer=2,
        n_head=4,
        n_embd=64,
        n_query_groups=2,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=128,
    )
    return litgpt_model.GPT(cfg)


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


WRAPPERS = {
    # what Fabric's FSDPStrategy(activation_checkpointing_policy={Block}) applies
    "checkpoint_wrapper": functools.partial(checkpoint_wrapper),
    "checkpoint_wrapper_sac": functools.partial(
        checkpoint_wrapper, context_fn=f8s.selective_checkpoint_context(save_quantized=True)
    ),
}


def run(mode, wrapper):
    torch.manual_seed(0)
    model = tiny_gpt()
    state = f8s.Fp8State(f8s.QuantConfig(mode=mode, strict=False))
    state.convert(model)
    if wrapper is not None:
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=WRAPPERS[wrapper],
            check_fn=lambda m: isinstance(m, litgpt_model.Block),
        )
    grads, report = train(state, model, loss_fn, batches())
    return state, grads, report


@pytest.fixture(scope="module")
def plain():
    return {mode: run(mode, None) for mode in ("safe", "naive")}


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_litgpt_checkpoint_wrapper_bitwise(plain, wrapper):
    _, ref, _ = plain["safe"]
    state, got, report = run("safe", wrapper)
    assert len(state.last_conversion.converted) == 2 * 5 + 1  # qkv, proj, fc_1, fc_2, proj; lm_head
    # checkpoint_wrapper names parameters "_checkpoint_wrapped_module": compare by position
    assert_bitwise([dict(enumerate(g.values())) for g in ref], [dict(enumerate(g.values())) for g in got])
    assert_audit_complete(report, min_recomputed=2 * 5 * STEPS)


def test_litgpt_naive_mode_differs(plain):
    _, ref, _ = plain["naive"]
    _, got, report = run("naive", "checkpoint_wrapper")
    assert differing([dict(enumerate(g.values())) for g in ref], [dict(enumerate(g.values())) for g in got])
    assert not report.ok


def test_litgpt_compiled_blocks_under_the_checkpoint_wrapper_bitwise(plain):
    """litgpt's Blocks compiled (each converted linear one op in the block's graph) inside
    Fabric's checkpoint wrapper: gradients bitwise those of the plain eager run."""
    torch.manual_seed(0)
    model = tiny_gpt()
    state = f8s.Fp8State(f8s.QuantConfig(mode="safe", strict=False))
    state.convert(model)
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=WRAPPERS["checkpoint_wrapper"],
        check_fn=lambda m: isinstance(m, litgpt_model.Block),
    )
    torch._dynamo.reset()
    for module in model.modules():
        if isinstance(module, litgpt_model.Block):
            module.compile(backend="aot_eager")
    got, _ = train(state, model, loss_fn, batches(), audit=False)
    _, ref, _ = plain["safe"]
    assert_bitwise([dict(enumerate(g.values())) for g in ref], [dict(enumerate(g.values())) for g in got])
    assert not state.ledger.violations
