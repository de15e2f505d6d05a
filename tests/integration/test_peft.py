"""peft's LoRA on a tiny Llama (issue 43, edge 6): the rank-8 adapters stay in high precision
whichever comes first, ``get_peft_model`` or ``convert``; the layers they wrap (peft's
``base_layer``) are converted and quantize; a checkpointed training step is audited clean.

Converting after ``get_peft_model`` used to convert the adapters (plain nn.Linear inside
ModuleDicts). Converting first, peft wraps each Fp8Linear (an nn.Linear) as its base layer and
adds plain nn.Linear adapters, which the Lightning callback's second convert at fit start
(``state.convert`` again here) must leave alone.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from tests.integration.common import VOCAB, assert_audit_complete, batches, need, train

transformers = need("transformers")
peft = need("peft")

LORA_WHY = "a LoRA adapter (peft): kept in high precision; name it in an include pattern to quantize it"
TARGETS = ("q_proj", "v_proj")
LAYERS = 2


def llama():
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(cfg)


def with_lora(model):
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(TARGETS))
    return peft.get_peft_model(model, config)


def build(order: str):
    """A LoRA Llama converted by a fresh state: peft first, or conversion first (then converted
    again, as the Lightning callback does at fit start)."""
    torch.manual_seed(0)
    state = f8s.Fp8State(f8s.QuantConfig(strict=False))
    if order == "peft-first":
        model = with_lora(llama())
        state.convert(model)
    else:
        model = with_lora(state.convert(llama()))
        state.convert(model)
    return state, model


ORDERS = ["peft-first", "convert-first"]


@pytest.mark.parametrize("order", ORDERS)
def test_lora_adapters_stay_in_high_precision_and_their_base_layers_convert(order):
    state, model = build(order)
    wrapped = {n: m for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.Linear)}
    assert len(wrapped) == LAYERS * len(TARGETS)
    adapters = {
        f"{n}.{ab}.default": getattr(m, ab)["default"] for n, m in wrapped.items() for ab in ("lora_A", "lora_B")
    }
    for name, adapter in adapters.items():
        assert type(adapter) is nn.Linear, name
        assert state.conversion.skipped[name] == LORA_WHY
        assert name not in state.conversion.converted
    assert all(isinstance(m.base_layer, f8s.Fp8Linear) for m in wrapped.values())
    if order == "peft-first":
        assert {f"{n}.base_layer" for n in wrapped} <= set(state.last_conversion.converted)
    else:  # the second convert converted nothing new, and said nothing about it
        assert state.last_conversion.converted == [] and set(state.last_conversion.skipped) == set(adapters)
    # every other Linear converted too: the blocks' k, o, gate, up, down projections and lm_head
    assert len(state.conversion.converted) == LAYERS * 7 + 1


@pytest.mark.parametrize("order", ORDERS)
def test_a_checkpointed_lora_training_step_is_audited_clean(order):
    state, model = build(order)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    grads, report = train(state, model, lambda m, tok: m(input_ids=tok, labels=tok).loss, batches(n=1))
    assert_audit_complete(report, min_recomputed=LAYERS * 7)  # the base layers and the other Linears
    assert not state.ledger.violations
    assert state.conversion.unowned(state) == []
    owners = {o.layer for o in state.bank.owners}
    assert not any("lora_" in layer for layer in owners)  # the adapters never quantized
    lora_grads = [n for n in grads[0] if ".lora_B." in n]
    assert len(lora_grads) == LAYERS * len(TARGETS) and all(torch.isfinite(grads[0][n]).all() for n in lora_grads)
