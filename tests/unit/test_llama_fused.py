"""The Llama's fast path (``fused_projections``): one q/k/v and one gate/up projection per
block, the RMSNorms fused into their FP8 input encodes and SwiGLU into the down projection's
(issue 43, target 2). Its logits are bitwise those of transformers' separate projections on the
same weights (float32, CPU), a Hugging Face checkpoint loads into it, and under FP8 the fused
prologues run with recompute audited bitwise and the naive mode caught."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state.models import Llama, LlamaConfig, load_hf_llama
from lightning_fp8state.models.llama import fuse_projections

CFG = LlamaConfig(vocab_size=97, seq_len=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128)
FUSED = dataclasses.replace(CFG, fused_projections=True)


def _pair():
    torch.manual_seed(0)
    separate = Llama(CFG)
    fused = Llama(FUSED)
    fused.load_state_dict(fuse_projections(separate.state_dict(), FUSED))
    return separate, fused


def test_fused_projections_give_the_separate_projections_logits_bitwise():
    separate, fused = _pair()
    assert {n for n, _ in fused.named_modules() if n.endswith(("qkv_proj", "gate_up_proj"))}
    x = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(separate(x), fused(x))


def test_a_hugging_face_checkpoint_loads_fused(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model, cfg = load_hf_llama(tmp_path, training={"fused_projections": True})
    assert cfg.fused_projections and hasattr(model.layers[0].self_attn, "qkv_proj")
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(x), hf(x).logits)


def _train(model, mode="safe", steps=3):
    state = f8s.Fp8State(f8s.QuantConfig(mode=mode, strict=mode == "safe", exclude=["*lm_head"]))
    model = state.convert(model)
    g = torch.Generator().manual_seed(3)
    with f8s.RecomputeAuditor(state) as auditor:
        for step in range(steps):
            x = torch.randint(0, 97, (2, 24), generator=g)
            with state.step(step):
                loss = model.loss(x, x)
                state.commit_forward()
                loss.backward()
    return state, auditor.report()


def test_under_fp8_the_fused_prologues_run_and_recompute_is_bitwise():
    _, fused = _pair()
    with torch.profiler.profile() as prof:
        state, report = _train(fused)
    ran = {e.key for e in prof.key_averages()}
    for op in ("rms_norm_quantize_fp8_record_amax", "swiglu_quantize_fp8_record_amax", "rms_norm_backward"):
        assert f"fp8state::{op}" in ran, op
    assert report.ok, report.format_table()
    how = state.last_conversion.how
    assert sum(name.endswith(("qkv_proj", "gate_up_proj", "down_proj", "o_proj")) for name in how) == 8
    # the fused encodes record the amax of the normalized input (and of silu(gate) * up)
    owners = {str(o) for o in state.protocol.owners()}
    assert any("qkv_proj" in o for o in owners) and any("down_proj" in o for o in owners)


def test_the_naive_mode_is_caught_on_the_fused_model():
    _, fused = _pair()
    _, report = _train(fused, mode="naive")
    assert not report.ok and report.mismatches
