"""transformers 5's MoE experts blocks (Mixtral, Qwen2-MoE, Qwen3-MoE) converted to Fp8Experts
(issue 44, target 4): logits bitwise transformers' eager experts under the bf16 recipe, close
under FP8; the routers reported as kept in high precision; FP8 training under transformers'
gradient checkpointing bitwise the uncheckpointed run."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state.nn import Fp8Experts
from tests.conftest import bitwise_equal

transformers = pytest.importorskip("transformers")

SHAPE = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
FAMILIES = {
    "Mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "Qwen2Moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=40
    ),
    "Qwen3Moe": dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=True),
}


def hf_model(family: str):
    config = getattr(transformers, f"{family}Config")(**SHAPE, **FAMILIES[family])
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    # the eager experts loop: the reference (transformers' default here is its grouped_mm path,
    # which differs from its own eager loop in the last bits)
    model.config._experts_implementation = "eager"
    return model


def converted(model, recipe: str):
    model = copy.deepcopy(model)
    state = f8s.Fp8State(f8s.QuantConfig(recipe=recipe, exclude=["lm_head"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state.convert(model)
    return model, state


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_experts_blocks_convert_bitwise_under_bf16_and_close_under_fp8(family):
    reference = hf_model(family)
    idx = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(idx).logits
    passthrough, state = converted(reference, "bf16")
    report = state.last_conversion
    for layer in range(2):
        name = f"model.layers.{layer}.mlp"
        assert isinstance(passthrough.get_submodule(f"{name}.experts"), Fp8Experts)
        assert report.how[f"{name}.experts"].startswith(f"transformers experts {family}Experts -> Fp8Experts")
        assert "kept in high precision" in report.skipped[f"{name}.gate"]
        assert f"{name}.gate" not in report.not_quantizable
    with torch.no_grad():
        assert bitwise_equal(passthrough(idx).logits, expected)
    fp8, state = converted(reference, "fp8_delayed")
    with torch.no_grad():
        got = fp8(idx).logits
    assert not bitwise_equal(got, expected)  # quantized for real
    assert (got - expected).abs().max() < 0.1 * expected.abs().max()


@pytest.mark.parametrize("family, reentrant", [("Mixtral", False), ("Qwen2Moe", False), ("Qwen3Moe", True)])
def test_fp8_training_under_gradient_checkpointing_is_bitwise_the_plain_run(family, reentrant):
    runs = []
    for checkpointing in (True, False):
        model, state = converted(hf_model(family), "fp8_delayed")
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        losses, grads = [], []
        with f8s.RecomputeAuditor(state) as auditor:
            for step in range(2):
                idx = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(step))
                model.zero_grad(set_to_none=True)
                with state.step(step):
                    loss = model(idx, labels=idx).loss
                    loss.backward()
                losses.append(loss.detach())
                grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        report = auditor.report()
        assert report.ok, report.format_table()
        runs.append((losses, grads, report, state))
    (losses, grads, report, state), (losses_p, grads_p, _, plain) = runs
    assert any(".experts." in r.layer and r.recomputed for r in report.rows)
    for step in range(2):
        assert bitwise_equal(losses[step], losses_p[step])
        assert grads[step].keys() == grads_p[step].keys()
        for name, g in grads_p[step].items():
            assert bitwise_equal(grads[step][name], g), (step, name)
    assert bitwise_equal(state.bank.scale, plain.bank.scale)
