"""torch's own transformer modules as they really run (issue 27).

``nn.MultiheadAttention``: its in-projection (a bare parameter) and ``out_proj`` are quantized
(``Fp8MultiheadAttention``), every projection of a converted model is in the report, and the
module's computation is torch's, bitwise, wherever the projections are not quantized (the bf16
recipe), over every option; checkpointed gradients equal plain ones bitwise, recompute audited.

``nn.TransformerEncoderLayer`` in eval under ``no_grad``: torch's fast path read the converted
layers' weights directly (no ``Fp8Linear.forward`` ran, the report still said "converted");
now eval is bitwise the quantized path (the fast path switched off by hand, for the reference),
with and without a padding mask, and the process-wide switch is never touched.

Before issue 27: ``in_proj_weight`` was in no report entry, ``out_proj`` was "not quantizable"
and ran in high precision, and the eval output differed from the quantized path.
"""

from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.nn import Fp8MultiheadAttention, Fp8TransformerEncoderLayer
from tests.conftest import bitwise_equal

E, HEADS = 32, 4


@contextmanager
def fast_path(enabled: bool):
    """The process-wide switch, for the reference run only (restored after)."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(enabled)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


# -- nn.MultiheadAttention: torch's computation, every option ------------------------------------
MHA_CASES = {
    "self batch_first": ({"batch_first": True}, "self", {}),
    "self seq_first": ({}, "self", {}),
    "cross (key is value)": ({"batch_first": True}, "cross", {}),
    "distinct q k v": ({"batch_first": True}, "distinct", {}),
    "kdim vdim": ({"batch_first": True, "kdim": 24, "vdim": 40}, "distinct", {}),
    "bias_kv zero_attn": ({"add_bias_kv": True, "add_zero_attn": True}, "self", {"need_weights": True}),
    "masks and weights per head": (
        {"batch_first": True},
        "self",
        {"need_weights": True, "average_attn_weights": False, "masks": True},
    ),
    "padding mask, no weights": ({"batch_first": True}, "cross", {"need_weights": False, "masks": True}),
    "causal": ({"batch_first": True}, "self", {"need_weights": False, "causal": True}),
    "unbatched": ({}, "self", {"unbatched": True}),
    "no bias": ({"bias": False, "batch_first": True}, "self", {}),
    "dropout": ({"batch_first": True, "dropout": 0.25}, "self", {"need_weights": False}),
}


def mha_inputs(kwargs: dict, shape: str, opts: dict, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    batch_first = kwargs.get("batch_first", False)
    lq, ls, n = 5, 7, 3

    def rand(length, width):
        if opts.get("unbatched"):
            return torch.randn(length, width, generator=g)
        return torch.randn(n, length, width, generator=g) if batch_first else torch.randn(length, n, width, generator=g)

    q = rand(lq, E)
    if shape == "self":
        return q, q, q
    k = rand(ls, kwargs.get("kdim", E))
    if shape == "cross":
        return q, k, k
    return q, k, rand(ls, kwargs.get("vdim", E))


def mha_call(module, q, k, v, opts: dict):
    kw = {"need_weights": opts.get("need_weights", True)}
    if "average_attn_weights" in opts:
        kw["average_attn_weights"] = opts["average_attn_weights"]
    lq, ls = (q.shape[-2], k.shape[-2]) if module.batch_first or q.dim() == 2 else (q.shape[0], k.shape[0])
    if opts.get("masks"):
        n = q.shape[0] if module.batch_first else q.shape[1]
        pad = torch.zeros(n, ls)
        pad[0, -2:] = float("-inf")
        kw["key_padding_mask"] = pad
        kw["attn_mask"] = torch.randn(lq, ls) if opts.get("need_weights", True) else None
    if opts.get("causal"):
        kw["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(lq)
        kw["is_causal"] = True
    return module(q, k, v, **kw)


@pytest.mark.parametrize("case", list(MHA_CASES))
def test_fp8_multihead_attention_is_torchs_computation_bitwise(case):
    """Under the bf16 recipe the projections are plain F.linear: outputs, attention weights and
    every gradient are bitwise nn.MultiheadAttention's (training mode, torch's slow path)."""
    kwargs, shape, opts = MHA_CASES[case]
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, HEADS, **kwargs)
    got = copy.deepcopy(ref)
    model = nn.Sequential(got)
    state = f8s.Fp8State(f8s.QuantConfig(recipe="bf16"))
    state.convert(model)
    assert isinstance(model[0], Fp8MultiheadAttention)
    results = []
    for module in (ref, model[0]):
        q, k, v = (t.clone().requires_grad_() for t in mha_inputs(kwargs, shape, opts))
        if shape == "self":
            k = v = q
        elif shape == "cross":
            v = k
        torch.manual_seed(1)  # the same dropout draws
        with state.step(len(results)):
            out, weights = mha_call(module, q, k, v, opts)
            (out.sum() + (0 if weights is None else weights.sum())).backward()
        grads = [p.grad for p in module.parameters()] + [t.grad for t in {id(t): t for t in (q, k, v)}.values()]
        results.append((out, weights, grads))
    (o1, w1, g1), (o2, w2, g2) = results
    assert bitwise_equal(o1, o2)
    assert (w1 is None) == (w2 is None) and (w1 is None or bitwise_equal(w1, w2))
    assert len(g1) == len(g2) and all(bitwise_equal(a, b) for a, b in zip(g1, g2, strict=True))


def test_multihead_attention_projections_are_quantized():
    """Every projection owns input/weight/grad_output state after an event, the output is FP8
    arithmetic (close to, not equal to, float32), and the report names each projection."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.MultiheadAttention(E, HEADS, batch_first=True))
    reference = copy.deepcopy(model)
    state = f8s.Fp8State(f8s.QuantConfig())
    params = [id(p) for p in model.parameters()]
    keys = list(model.state_dict())
    state.convert(model)
    report = state.last_conversion
    assert report.converted == ["0.out_proj", "0.in_proj"]
    assert "in_proj_weight" in report.how["0.in_proj"] and "Fp8Linear" in report.how["0.out_proj"]
    assert [id(p) for p in model.parameters()] == params and list(model.state_dict()) == keys
    x = torch.randn(3, 5, E)
    with warnings.catch_warnings():
        warnings.simplefilter("error", f8s.ConversionWarning)  # nothing converted goes unowned
        for step in range(2):
            with state.step(step):
                model[0](x, x, x)[0].pow(2).mean().backward()
    owners = {(o.layer, o.role) for o in state.bank.owners}
    for layer in ("0.in_proj", "0.out_proj"):
        assert {(layer, r) for r in ("input", "weight", "grad_output")} <= owners
    with torch.no_grad():
        got, want = model[0](x, x, x)[0], reference[0](x, x, x)[0]
    assert not torch.equal(got, want)
    assert ((got - want).norm() / want.norm()).item() < 0.1


class EncDec(nn.Module):
    """An encoder layer and a decoder layer (self- and cross-attention), each checkpointed."""

    def __init__(self, region=None, dropout: float = 0.1) -> None:
        super().__init__()
        kw = {"dim_feedforward": 64, "dropout": dropout, "batch_first": True}
        self.enc = nn.TransformerEncoderLayer(E, HEADS, **kw)
        self.dec = nn.TransformerDecoderLayer(E, HEADS, **kw)
        self.region = region

    def forward(self, src, tgt):
        run = self.region or (lambda f, *a: f(*a))
        memory = run(self.enc, src)
        return run(self.dec, tgt, memory)


REGIONS = {
    "torch-nonreentrant": lambda f, *a: f8s.checkpoint(f, *a, use_reentrant=False),
    "torch-reentrant": lambda f, *a: f8s.checkpoint(f, *a, use_reentrant=True),
    "deepspeed": lambda f, *a: f8s.checkpoint(f, *a, engine="deepspeed"),
    "plain torch": lambda f, *a: torch.utils.checkpoint.checkpoint(f, *a, use_reentrant=False),
}


def train_encdec(region, mode="safe", steps=3, device="cpu", autocast=False):
    torch.manual_seed(0)
    model = EncDec(region)
    state = f8s.Fp8State(f8s.QuantConfig(mode=mode, strict=False))
    state.convert(model)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    grads = []
    with f8s.RecomputeAuditor(state, model=model) as auditor:
        for step in range(steps):
            src = (torch.randn(2, 6, E, generator=g) * 1.5**step).to(device).requires_grad_()
            tgt = (torch.randn(2, 4, E, generator=g) * 1.5**step).to(device).requires_grad_()
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)  # dropout
            with state.step(step):
                with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                    y = model(src, tgt)
                loss = y.float().pow(2).mean()
                state.commit_forward()
                loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()} | {"src": src.grad, "tgt": tgt.grad})
            opt.step()
    return state, grads, auditor.report()


@pytest.fixture(scope="module")
def encdec_plain():
    return {mode: train_encdec(None, mode) for mode in ("safe", "naive")}


@pytest.mark.parametrize("engine", list(REGIONS))
def test_attention_projections_checkpointed_bitwise_and_audited(encdec_plain, engine):
    _, ref, _ = encdec_plain["safe"]
    state, got, report = train_encdec(REGIONS[engine])
    for step, (a, b) in enumerate(zip(ref, got, strict=True)):
        bad = [n for n in a if not bitwise_equal(a[n], b[n])]
        assert not bad, (step, bad)
    assert report.ok, report.format_table()
    recomputed = {r.layer for r in report.rows if r.recomputed}
    assert {"enc.self_attn.in_proj", "dec.self_attn.in_proj", "dec.multihead_attn.in_proj.q"} <= recomputed
    assert {"dec.multihead_attn.in_proj.kv", "dec.multihead_attn.out_proj"} <= recomputed
    for event in state.ledger.events():
        assert all(rec.commits == 1 for rec in state.ledger.event(event).values())


def test_attention_projections_naive_mode_differs(encdec_plain):
    _, ref, _ = encdec_plain["naive"]
    _, got, report = train_encdec(REGIONS["torch-nonreentrant"], "naive")
    assert any(not bitwise_equal(a[n], b[n]) for a, b in zip(ref, got, strict=True) for n in a)
    assert not report.ok


class _MyAttention(nn.MultiheadAttention):
    pass


def test_every_gemm_weight_of_a_converted_model_is_in_the_report():
    """nn.Transformer plus separate-weight and subclassed attention: every weight that feeds a
    GEMM is named by an entry (the in-projections included), with a status and a reason."""
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "tf": nn.Transformer(E, HEADS, 1, 1, 64, dropout=0.0, batch_first=True),
            "kv": nn.MultiheadAttention(E, HEADS, kdim=24, vdim=40),
            "sub": _MyAttention(E, HEADS),
            "head": nn.Linear(E, 8),
        }
    )
    state = f8s.Fp8State(f8s.QuantConfig(exclude=("head", "kv.v_proj")))
    state.convert(model)
    report = state.last_conversion
    entries = {name: (status, why) for name, status, why in report.entries()}

    def entry_of(param: str) -> str:
        module, _, attr = param.rpartition(".")
        return {"weight": module, "in_proj_weight": f"{module}.in_proj"}.get(
            attr, f"{module}.{attr[: -len('_weight')]}"
        )

    gemm_weights = [n for n, p in model.named_parameters() if p.dim() == 2]
    assert len(gemm_weights) == 4 + 6 + 4 + 2 + 1  # enc (attn 2, ff 2), dec (2 attns x 2, ff 2), kv, sub, head
    missing = [n for n in gemm_weights if entry_of(n) not in entries]
    assert not missing, (missing, str(report))
    assert all(why for _, why in entries.values())
    assert entries["kv.q_proj"][0] == "converted" and entries["kv.v_proj"][0] == "skipped"
    assert (
        entries["sub.in_proj"][0] == "not quantizable"
        and "subclasses nn.MultiheadAttention" in entries["sub.in_proj"][1]
    )
    assert entries["sub.out_proj"][0] == "not quantizable"
    assert entries["head"][0] == "skipped"
    assert entries["tf.decoder.layers.0.multihead_attn.in_proj"][0] == "converted"
    assert entries["tf.encoder.layers.0"][0] == "rerouted" and entries["tf.encoder"][0] == "rerouted"
    # kv's v projection stays high precision, the other two quantize
    x, k, v = torch.randn(5, 2, E), torch.randn(7, 2, 24), torch.randn(7, 2, 40)
    with pytest.warns(f8s.ConversionWarning, match="never ran"), state.step(0):  # only kv ran
        model["kv"](x, k, v)[0].sum().backward()
    layers = {o.layer for o in state.bank.owners}
    assert {"kv.q_proj", "kv.k_proj"} <= layers and "kv.v_proj" not in layers


# -- nn.TransformerEncoderLayer / nn.TransformerEncoder in eval ------------------------------------
def trained_encoder(nested: bool = True, device="cpu"):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, HEADS, dim_feedforward=64, dropout=0.1, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested)
    float_model = copy.deepcopy(model).to(device)
    state = f8s.Fp8State(f8s.QuantConfig())
    state.convert(model)
    model.to(device)
    g = torch.Generator().manual_seed(5)
    for step in range(2):  # move the scales off their first event
        with state.step(step):
            model((torch.randn(3, 6, E, generator=g) * 2**step).to(device)).pow(2).mean().backward()
    model.eval()
    float_model.eval()
    return state, model, float_model


@pytest.mark.parametrize("padding", [False, True], ids=["no mask", "padding mask (nested tensors)"])
def test_encoder_eval_under_no_grad_is_bitwise_the_quantized_path(padding):
    state, model, float_model = trained_encoder()
    assert torch.backends.mha.get_fastpath_enabled()  # conversion never flips the process-wide switch
    x = torch.randn(3, 6, E, generator=torch.Generator().manual_seed(9))
    mask = None
    if padding:
        mask = torch.zeros(3, 6, dtype=torch.bool)
        mask[1, -2:] = True
    with torch.no_grad():
        got = model(x, src_key_padding_mask=mask)
        with fast_path(False):
            want = model(x, src_key_padding_mask=mask)
        plain = float_model(x, src_key_padding_mask=mask)
    assert bitwise_equal(got, want)
    assert not torch.equal(got, plain)  # and that is the FP8 computation, not the float one
    assert isinstance(model.layers[0], Fp8TransformerEncoderLayer) and not model.use_nested_tensor
    assert isinstance(model.layers[0].self_attn, Fp8MultiheadAttention)


class _OwnForward(nn.TransformerEncoderLayer):
    def forward(self, src, *args, **kwargs):
        return super().forward(src, *args, **kwargs)


def test_an_encoder_layer_subclass_with_its_own_forward_is_reported_and_warned_at_first_eval():
    torch.manual_seed(0)
    model = nn.Sequential(_OwnForward(E, HEADS, dim_feedforward=64, dropout=0.0, batch_first=True))
    state = f8s.Fp8State(f8s.QuantConfig())
    state.convert(model)
    report = state.last_conversion
    assert "its own forward" in report.fast_path["0"]
    assert report.counts()["eval fast path"] == 1
    x = torch.randn(2, 4, E)
    with warnings.catch_warnings():
        warnings.simplefilter("error", f8s.ConversionWarning)
        with state.step(0):  # training: no warning
            model(x).sum().backward()
    model.eval()
    with torch.no_grad():
        with pytest.warns(f8s.ConversionWarning, match=r"0 \(_OwnForward\) runs in eval under no_grad and may take"):
            model(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error", f8s.ConversionWarning)
            model(x)  # once only


def test_compiled_attention_layers_are_bitwise_the_eager_run():
    """Under torch.compile each projection is Fp8Linear's op (named by its Fp8Projection's key):
    checkpointed encoder and decoder layers compiled with aot_eager, gradients bitwise eager."""

    def go(compiled: bool):
        torch.manual_seed(0)
        model = EncDec(lambda f, *a: f8s.checkpoint(f, *a), dropout=0.0)
        state = f8s.Fp8State(f8s.QuantConfig())
        state.convert(model)
        if compiled:
            torch._dynamo.reset()
            model.enc.compile(backend="aot_eager")
            model.dec.compile(backend="aot_eager")
        g = torch.Generator().manual_seed(3)
        out = []
        for step in range(2):
            src = torch.randn(2, 6, E, generator=g).requires_grad_()
            tgt = torch.randn(2, 4, E, generator=g).requires_grad_()
            with state.step(step):
                model(src, tgt).pow(2).mean().backward()
            out += [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
        assert not state.ledger.violations
        return out

    for i, (a, b) in enumerate(zip(go(False), go(True), strict=True)):
        assert bitwise_equal(a, b), i
