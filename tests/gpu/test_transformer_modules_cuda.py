"""tests/unit/test_transformer_modules.py on the GPU (issue 27): nn.MultiheadAttention's
projections (Fp8MultiheadAttention) in encoder and decoder layers with the CUDA kernels and
torch._scaled_mm under bf16 autocast, checkpointed gradients bitwise plain ones under every
engine with the recompute audited; an nn.TransformerEncoder in eval under no_grad bitwise the
quantized path (torch's fast path off, for the reference only; float32, as autocast turns torch's
fast path off by itself). Same code path as the CPU tests."""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from tests.conftest import bitwise_equal
from tests.unit.test_transformer_modules import REGIONS, E, fast_path, train_encdec, trained_encoder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def plain():
    assert f8s.ops.cuda.ensure_loaded(), f8s.ops.cuda.extension_info()
    return train_encdec(None, device="cuda", autocast=True)


@pytest.mark.parametrize("engine", list(REGIONS))
def test_attention_projections_on_cuda_checkpointed_bitwise_and_audited(plain, engine):
    if engine == "deepspeed":
        pytest.importorskip("deepspeed", reason="deepspeed not installed on this machine")
    _, ref, _ = plain
    state, got, report = train_encdec(REGIONS[engine], device="cuda", autocast=True)
    for step, (a, b) in enumerate(zip(ref, got, strict=True)):
        bad = [n for n in a if not bitwise_equal(a[n], b[n])]
        assert not bad, (step, bad)
    assert report.ok, report.format_table()
    assert {"dec.multihead_attn.in_proj.kv", "enc.self_attn.in_proj"} <= {r.layer for r in report.rows if r.recomputed}


@pytest.mark.parametrize("padding", [False, True], ids=["no mask", "padding mask"])
def test_encoder_eval_on_cuda_is_bitwise_the_quantized_path(padding):
    assert f8s.ops.cuda.ensure_loaded(), f8s.ops.cuda.extension_info()
    state, model, _ = trained_encoder(device="cuda")  # float32: where torch's fast path would run
    x = torch.randn(3, 6, E, generator=torch.Generator().manual_seed(9)).cuda()
    mask = None
    if padding:
        mask = torch.zeros(3, 6, dtype=torch.bool, device="cuda")
        mask[1, -2:] = True
    with torch.no_grad():
        got = model(x, src_key_padding_mask=mask)
        with fast_path(False):
            want = model(x, src_key_padding_mask=mask)
    assert bitwise_equal(got, want)
