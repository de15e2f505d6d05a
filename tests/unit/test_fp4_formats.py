"""The packed-FP4 ops against an independent float64 model of E2M1, NVFP4 and MXFP4.

The model below builds E2M1 from its bit layout (sign, 2 exponent bits with bias 1, 1
mantissa bit), rounds in plain Python floats, packs nibbles with integer arithmetic and
derives block scales from the definitions written in ``lightning_fp8state.formats``. For
the E4M3 block scale it reuses the independent FP8 model of ``test_ops_reference`` (built
from the bit layout too). The only torch casts on the model side are float64 -> float32
(one round-to-nearest-even, how the ops round their float32 arithmetic) and, for the last
step of decoding into bf16/fp16, float32 -> bf16/fp16.
"""

from __future__ import annotations

import math
import random
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_fp8state import ops
from lightning_fp8state.ops import (
    dequantize_fp4_reference,
    pack_fp4_reference,
    quantize_fp4_reference,
    unpack_fp4_reference,
    update_centers_reference,
)
from tests.unit.test_ops_reference import E4M3_MODEL, F32_MAX, f32, model_round, to_f32

# --------------------------------------------------------------------------------------
# Independent float64 model
# --------------------------------------------------------------------------------------


def e2m1_decode_model(code: int) -> float:
    """Value of a 4-bit E2M1 code from its bit layout."""
    sign = -1.0 if code & 0x8 else 1.0
    e = (code >> 1) & 0x3
    m = code & 0x1
    mag = (m / 2) * 2.0**0 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    return sign * mag


E2M1_POS = sorted((e2m1_decode_model(c), c) for c in range(8))  # (value, code), ascending


def e2m1_code_model(y: float) -> int:
    """Nearest E2M1 code to float64 ``y``: ties to the even code, saturate to ±6, keep the
    sign bit (also of zero), NaN -> code 0."""
    if math.isnan(y):
        return 0
    neg = math.copysign(1.0, y) < 0
    a = abs(y)
    code = E2M1_POS[-1][1]
    for (lo, c_lo), (hi, c_hi) in zip(E2M1_POS, E2M1_POS[1:], strict=False):
        if a <= hi:
            mid = (lo + hi) / 2
            code = c_lo if a < mid else c_hi if a > mid else (c_lo if c_lo % 2 == 0 else c_hi)
            break
    return code | (0x8 if neg else 0)


def pack_model(codes: list[int]) -> list[int]:
    return [codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(len(codes) // 2)]


def unpack_model(data: list[int]) -> list[int]:
    out = []
    for b in data:
        out += [b & 0xF, b >> 4]
    return out


def e4m3_bits_model(v: float) -> int:
    """The E4M3 byte of a value the E4M3 model can represent (or NaN)."""
    if math.isnan(v):
        return 0x7F
    for code in range(256):
        if E4M3_MODEL.decode(code) == v and (math.copysign(1.0, E4M3_MODEL.decode(code)) < 0) == (
            math.copysign(1.0, v) < 0
        ):
            return code
    raise AssertionError(v)


def nvfp4_block_model(xs: list[float], s: float) -> tuple[int, list[int]]:
    """(E4M3 block-scale byte, E2M1 codes) of one 16-element block of float32 values."""
    a = math.nan if any(math.isnan(v) for v in xs) else max(abs(v) for v in xs)
    v = f32(f32(a / 6) * s)
    sb = math.nan if math.isnan(v) else model_round(min(max(v, 0.0), 448.0), E4M3_MODEL)
    if math.isnan(sb):
        enc = math.nan
    else:
        enc = 0.0 if sb == 0 else f32(s / sb)
    ys = to_f32([x * enc for x in xs])  # float64 product of two float32s is exact
    return e4m3_bits_model(abs(sb) if not math.isnan(sb) else sb), [e2m1_code_model(y) for y in ys]


def mxfp4_block_model(xs: list[float], s: float) -> tuple[int, list[int]]:
    """(E8M0 byte, E2M1 codes) of one 32-element block of float32 values."""
    us = to_f32([x * s for x in xs])
    if any(math.isnan(u) for u in us):
        return 0xFF, [0] * len(xs)
    a = max(abs(u) for u in us)
    if a == 0:
        x_exp = -127
    elif math.isinf(a):
        x_exp = 127
    else:
        x_exp = max(-127, min(127, math.frexp(a)[1] - 1 - 2))
    return x_exp + 127, [e2m1_code_model(u * 2.0**-x_exp) for u in us]


def quantize_model(rows: list[list[float]], s: float, layout: str, center: list[float] | None):
    """Packed bytes and block-scale bytes, row by row, of float32 ``rows`` (each of length K)."""
    block = 16 if layout == "nvfp4" else 32
    packed, scales = [], []
    for row in rows:
        if center is not None:
            row = to_f32([x - c for x, c in zip(row, center, strict=True)])
        codes = []
        for j in range(0, len(row), block):
            fn = nvfp4_block_model if layout == "nvfp4" else mxfp4_block_model
            sb, cs = fn(row[j : j + block], s)
            scales.append(sb)
            codes += cs
        packed += pack_model(codes)
    return packed, scales


def block_scale_value_model(byte: int, layout: str) -> float:
    if layout == "nvfp4":
        return E4M3_MODEL.decode(byte)
    return math.nan if byte == 0xFF else 2.0 ** (byte - 127)


def dequantize_model(packed: list[int], scales: list[int], d: float, layout: str, center, out_dtype, k: int):
    block = 16 if layout == "nvfp4" else 32
    codes = unpack_model(packed)
    vals = []
    for i, code in enumerate(codes):
        sb = block_scale_value_model(scales[i // block], layout)
        p = e2m1_decode_model(code) * sb  # exact in float64
        if abs(p) > F32_MAX:
            p = math.copysign(math.inf, p)  # float32 overflow of e * 2**X (X = 127 only)
        v = f32(p * d)  # e * sb * d is exact in float64: one rounding
        if center is not None:
            v = f32(v + center[i % k])
        vals.append(v)
    return torch.tensor(vals, dtype=torch.float32).to(out_dtype)


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------

LAYOUTS = ["nvfp4", "mxfp4"]
BLOCK = {"nvfp4": 16, "mxfp4": 32}
SCALE_DTYPE = {"nvfp4": torch.float8_e4m3fn, "mxfp4": torch.float8_e8m0fnu}
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def byte_list(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.uint8).reshape(-1).tolist()


def as_rows(x: torch.Tensor) -> list[list[float]]:
    return x.detach().to(torch.float64).reshape(-1, x.shape[-1]).tolist()


def check_quantize(x, s, layout, center=None):
    scale = torch.tensor([s], dtype=torch.float32)
    c = None if center is None else torch.tensor(center, dtype=torch.float32)
    packed, scales = ops.quantize_fp4(x, scale, layout, c)
    k = x.shape[-1]
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (*x.shape[:-1], k // 2)
    assert scales.dtype == SCALE_DTYPE[layout] and tuple(scales.shape) == (*x.shape[:-1], k // BLOCK[layout])
    want_packed, want_scales = quantize_model(as_rows(x), s, layout, center)
    assert byte_list(scales) == want_scales, (byte_list(scales), want_scales)
    got = byte_list(packed)
    for i, (g, w) in enumerate(zip(got, want_packed, strict=True)):
        assert g == w, f"byte {i}: got {g:#04x}, want {w:#04x} (x row {i * 2 // k})"
    ref = quantize_fp4_reference(x, scale, c, layout)
    assert byte_list(ref[0]) == got and byte_list(ref[1]) == byte_list(scales)
    return packed, scales


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1.0, a) == math.copysign(1.0, b))


# --------------------------------------------------------------------------------------
# The model itself, pinned to facts from the format definitions
# --------------------------------------------------------------------------------------


def test_e2m1_model_is_the_16_code_table():
    assert [e2m1_decode_model(c) for c in range(8)] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert [e2m1_decode_model(c | 8) for c in range(8)] == [-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert math.copysign(1.0, e2m1_decode_model(8)) < 0
    # ties to even code: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    ties = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}
    for y, want in ties.items():
        assert e2m1_decode_model(e2m1_code_model(y)) == want
        assert e2m1_decode_model(e2m1_code_model(-y)) == -want
    assert e2m1_code_model(5.0001) == 7 and e2m1_code_model(1e30) == 7 and e2m1_code_model(-math.inf) == 15
    assert e2m1_code_model(-0.1) == 8 and e2m1_code_model(math.nan) == 0
    assert pack_model([1, 2, 3, 4]) == [0x21, 0x43] and unpack_model([0x21, 0x43]) == [1, 2, 3, 4]


# --------------------------------------------------------------------------------------
# E2M1 codes, decoding and packing
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("out_dtype", IN_DTYPES, ids=str)
def test_every_byte_decodes_to_its_two_table_values(layout, out_dtype):
    """All 256 bytes with unit block scale and descale: low nibble first, then high nibble."""
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(4, 64)
    one = {"nvfp4": 0x38, "mxfp4": 127}[layout]  # E4M3 1.0, E8M0 2**0
    n_blocks = 128 // BLOCK[layout]
    scales = torch.full((4, n_blocks), one, dtype=torch.uint8).view(SCALE_DTYPE[layout])
    got = ops.dequantize_fp4(packed, scales, torch.tensor([1.0]), layout, out_dtype).reshape(-1)
    want = [e2m1_decode_model(c) for b in range(256) for c in (b & 0xF, b >> 4)]
    assert [same(g, w) for g, w in zip(got.double().tolist(), want, strict=True)] == [True] * 512


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=str)
def test_rounding_of_every_value_tie_and_saturation(layout, in_dtype):
    """Blocks whose element encode factor is exactly 1 (NVFP4: amax 6 with tensor scale 1;
    MXFP4: amax in [4, 8) with tensor scale 1): every E2M1 value, every tie and values past
    6, both signs, must round as the model says."""
    targets = [0.0, 0.1, 0.25, 0.3, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 4.9, 5.0, 5.1]
    targets += [6.0, 6.5, 7.0, 7.9]  # MXFP4 saturates (6, 8); NVFP4 blocks keep amax 6 below
    rows = []
    for t in targets:
        for sign in (1.0, -1.0):
            row = [6.0] + [sign * t] * (BLOCK[layout] - 1)
            if layout == "nvfp4" and t > 6:
                row = [7.9] + [sign * t] * (BLOCK[layout] - 1)  # amax 7.9: sb = E4M3(7.9 / 6)
            rows.append(row)
    x = torch.tensor(rows, dtype=torch.float64).to(in_dtype)
    packed, _ = check_quantize(x, 1.0, layout)
    codes = unpack_fp4_reference(packed)
    if layout == "mxfp4":  # encode factor is exactly 1 here: the codes are E2M1(t) itself
        for row, t in zip(codes[0::2].tolist(), targets, strict=True):
            assert e2m1_decode_model(row[1]) == e2m1_decode_model(e2m1_code_model(float(torch.tensor(t).to(in_dtype))))
        assert set(codes[0::2][-4:, 1:].reshape(-1).tolist()) == {7}  # (6, 8) saturates to 6


@st.composite
def fp4_case(draw, layout: str):
    """Rows of float32 values whose blocks span many magnitudes, plus a tensor scale."""
    block = BLOCK[layout]
    n_blocks = draw(st.integers(1, 3))
    rows = draw(st.integers(1, 3))
    s = draw(
        st.one_of(
            st.sampled_from([1.0, 0.5, 2688.0, 6.0, 2.0**-20, 2.0**20]),
            st.floats(min_value=2.0**-30, max_value=2.0**30, width=32),
        )
    )
    special = st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan, 3e38, -1e-40, 6.0, 448.0 * 6])
    values = []
    for _ in range(rows):
        row = []
        for _ in range(n_blocks):
            e = draw(st.integers(-40, 40))
            finite = st.builds(lambda m, neg, e=e: (-m if neg else m) * 2.0**e, st.floats(0.0, 8.0), st.booleans())
            elems = st.one_of(finite, finite, finite, special) if draw(st.booleans()) else finite
            row += draw(st.lists(elems, min_size=block, max_size=block))
        values.append(row)
    return values, s


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=str)
@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_quantize_matches_model(layout, in_dtype, data):
    """Codes, nibble order and block scales of both layouts, NaN/inf/zero/huge blocks included."""
    values, s = data.draw(fp4_case(layout))
    x = torch.tensor(values, dtype=torch.float64).to(in_dtype)
    check_quantize(x, s, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_centered_quantize_matches_model(layout, data):
    values, s = data.draw(fp4_case(layout))
    k = len(values[0])
    center = to_f32(data.draw(st.lists(st.floats(-1e3, 1e3), min_size=k, max_size=k)))
    x = torch.tensor(values, dtype=torch.float32)
    check_quantize(x, s, layout, center)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("out_dtype", IN_DTYPES, ids=str)
@settings(deadline=None, max_examples=40)
@given(data=st.data(), centered=st.booleans())
def test_dequantize_matches_model(layout, out_dtype, data, centered):
    """Any bytes, any block-scale code (E4M3 NaN, E8M0 0 / 254 / NaN included), any descale."""
    block = BLOCK[layout]
    rows, n_blocks = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    k = n_blocks * block
    packed = data.draw(st.lists(st.integers(0, 255), min_size=rows * k // 2, max_size=rows * k // 2))
    scale_codes = st.integers(0, 255) if layout == "mxfp4" else st.integers(0, 0x7F)
    scales = data.draw(st.lists(scale_codes, min_size=rows * n_blocks, max_size=rows * n_blocks))
    d = f32(data.draw(st.one_of(st.sampled_from([1.0, 1 / 2688.0]), st.floats(2.0**-20, 2.0**20, width=32))))
    center = to_f32(data.draw(st.lists(st.floats(-100.0, 100.0), min_size=k, max_size=k))) if centered else None
    t_packed = torch.tensor(packed, dtype=torch.uint8).reshape(rows, k // 2)
    t_scales = torch.tensor(scales, dtype=torch.uint8).reshape(rows, n_blocks).view(SCALE_DTYPE[layout])
    t_center = None if center is None else torch.tensor(center, dtype=torch.float32)
    got = ops.dequantize_fp4(t_packed, t_scales, torch.tensor([d]), layout, out_dtype, t_center)
    want = dequantize_model(packed, scales, d, layout, center, out_dtype, k).reshape(rows, k)
    assert got.dtype == out_dtype and got.shape == want.shape
    g, w = got.double().reshape(-1).tolist(), want.double().reshape(-1).tolist()
    bad = [(i, a, b) for i, (a, b) in enumerate(zip(g, w, strict=True)) if not same(a, b)]
    assert not bad, bad[:5]
    ref = dequantize_fp4_reference(t_packed, t_scales, torch.tensor([d]), t_center, layout, out_dtype)
    assert byte_list(ref) == byte_list(got)


@settings(deadline=None, max_examples=60)
@given(codes=st.lists(st.integers(0, 15), min_size=0, max_size=40).filter(lambda c: len(c) % 2 == 0))
def test_pack_unpack_round_trip(codes):
    t = torch.tensor(codes, dtype=torch.uint8)
    packed = pack_fp4_reference(t)
    assert packed.tolist() == pack_model(codes)
    assert unpack_fp4_reference(packed).tolist() == codes
    assert unpack_model(pack_model(codes)) == codes


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(deadline=None, max_examples=30)
@given(seed=st.integers(0, 2**31 - 1), spread=st.integers(0, 20))
def test_quantize_dequantize_round_trip_error_is_bounded(layout, seed, spread):
    """With the tensor scale from the tensor's own amax, decode(encode(x)) is within one
    unit of the block's scale (half E2M1's widest gap, 4 -> 6) for NVFP4 blocks with a
    normal E4M3 scale, and within two for MXFP4 (OCP's floor lets (6, 8) saturate to 6)."""
    g = torch.Generator().manual_seed(seed)
    block = BLOCK[layout]
    expo = torch.randint(-spread, spread + 1, (4, 64 // block, 1), generator=g).to(torch.float32)
    x = torch.randn(4, 64, generator=g) * torch.exp2(expo).repeat_interleave(block, -1).reshape(4, 64)
    fmax = {"nvfp4": 2688.0, "mxfp4": 6.0}[layout]
    s = torch.tensor([f32(fmax / x.abs().max().item())])
    d = torch.tensor([f32(1 / s.item())])
    packed, scales = ops.quantize_fp4(x, s, layout)
    back = ops.dequantize_fp4(packed, scales, d, layout, torch.float32)
    sb = scales.to(torch.float32).repeat_interleave(block, -1)
    units = {"nvfp4": 1.0, "mxfp4": 2.0}[layout]
    checked = sb >= 2.0**-6 if layout == "nvfp4" else torch.ones_like(sb, dtype=torch.bool)
    bound = units * sb * d + x.abs() * 2.0**-20
    assert bool(((back - x).abs() <= bound)[checked].all())
    assert int(checked.sum()) >= block  # the loudest block always has a normal scale


# --------------------------------------------------------------------------------------
# Block-scale choice, stated directly
# --------------------------------------------------------------------------------------


def test_nvfp4_block_scale_choice():
    one = torch.tensor([1.0])
    x = torch.zeros(5, 16)
    x[0, 3] = 6.0  # a / 6 * S = 1 -> sb = 1, encode factor 1
    x[1, 0] = 6.0 * 448 * 4  # v = 1792 > 448: sb saturates at 448
    x[2, 0] = 6.0 * 2.0**-12  # v = 2**-12 < half the smallest E4M3 subnormal: sb = 0, block -> zeros
    x[2, 1] = -(2.0**-12)
    x[3, 0] = math.nan
    x[3, 1] = 1.0
    x[4, 0] = 6.0 * 0.3  # v = 0.3 -> E4M3 0.3125 (nearest), encode factor 1 / 0.3125 = 3.2
    packed, scales = ops.quantize_fp4(x, one, "nvfp4")
    sb = scales.to(torch.float32).reshape(-1).tolist()
    assert sb[0] == 1.0 and sb[1] == 448.0 and sb[2] == 0.0 and math.isnan(sb[3]) and sb[4] == 0.3125
    codes = unpack_fp4_reference(packed)
    assert codes[0, 3] == 7  # 6 -> code 7
    assert codes[1, 0] == 7  # encode factor 1 / 448: 10752 / 448 = 24 saturates to 6
    assert codes[2].tolist() == [0, 8] + [0] * 14  # sign of zero kept
    assert codes[3].tolist() == [0] * 16  # a NaN block encodes as zeros...
    back = ops.dequantize_fp4(packed, scales, one, "nvfp4", torch.float32)
    assert bool(torch.isnan(back[3]).all())  # ...and decodes to NaN everywhere
    assert back[4, 0].item() == 6.0 * 0.3125  # 1.8 * 3.2 = 5.76 -> 6 (code 7) times sb
    # The tensor scale is what makes blocks of a quiet tensor usable: a = 1e-3 needs S.
    quiet = torch.full((1, 16), 1e-3)
    _, s_unit = ops.quantize_fp4(quiet, one, "nvfp4")
    _, s_own = ops.quantize_fp4(quiet, torch.tensor([2688.0 / 1e-3]), "nvfp4")
    assert s_unit.to(torch.float32).item() == 0.0  # below E4M3's range: the block flushes to 0
    assert s_own.to(torch.float32).item() == 448.0


def test_nvfp4_follows_the_documented_operation_order():
    """Where float32 rounding makes the order matter, the op follows the invariant:
    ``v = (a / 6) * S`` (not ``(a * S) / 6``), and elements use ``x * (S / sb)`` (not
    ``(x * S) / sb``). The cases are searched for in the model, near E4M3 and E2M1 ties."""
    rng = random.Random(0)
    order_cases, enc_cases = [], []
    while len(order_cases) < 4:
        s = f32(rng.uniform(1, 4))
        a = f32(1.0625 * 6 / s * (1 + rng.uniform(-1e-6, 1e-6)))  # v near the E4M3 tie 1.0625
        ours, other = f32(f32(a / 6) * s), f32(f32(a * s) / 6)
        if model_round(ours, E4M3_MODEL) != model_round(other, E4M3_MODEL):
            order_cases.append((a, s))
    while len(enc_cases) < 4:
        s = f32(rng.uniform(1, 4))
        sb = 1.125  # block amax 6 * 1.125 / s -> v = 1.125 exactly representable
        x = f32(0.75 * sb / s * (1 + rng.uniform(-1e-6, 1e-6)))  # y near the E2M1 tie 0.75
        ours, other = f32(x * f32(s / sb)), f32(f32(x * s) / sb)
        if e2m1_code_model(ours) != e2m1_code_model(other):
            enc_cases.append((x, s))
    for a, s in order_cases:
        _, scales = check_quantize(torch.tensor([[a] + [0.0] * 15]), s, "nvfp4")
        assert scales.to(torch.float32).item() == model_round(f32(f32(a / 6) * s), E4M3_MODEL)
    for x, s in enc_cases:
        amax = f32(6 * 1.125 / s)
        assert model_round(f32(f32(amax / 6) * s), E4M3_MODEL) == 1.125  # the block scale the case assumes
        check_quantize(torch.tensor([[amax, x] + [0.0] * 14]), s, "nvfp4")


def test_mxfp4_block_exponent_choice():
    one = torch.tensor([1.0])
    x = torch.zeros(6, 32)
    x[0, 0] = 6.0  # floor(log2 6) - 2 = 0
    x[1, 0] = 7.99  # still X = 0: 7.99 saturates to 6 (OCP)
    x[2, 0] = 8.0  # X = 1
    x[3, 0] = math.inf  # X = 127
    x[3, 1] = 5.0
    x[4, 0] = math.nan
    x[5, 0] = 1e-40  # float32 subnormal: floor(log2) = -133 -> X clamps at -127
    packed, scales = ops.quantize_fp4(x, one, "mxfp4")
    assert byte_list(scales) == [127, 127, 128, 254, 255, 0]
    zero_block = ops.quantize_fp4(torch.zeros(1, 32), one, "mxfp4")[1]
    assert byte_list(zero_block) == [0]  # A == 0 -> X = -127
    codes = unpack_fp4_reference(packed)
    assert codes[0, 0] == 7 and codes[1, 0] == 7 and codes[2, 0] == 6  # 8 / 2 = 4 -> code 6
    assert codes[3, 0] == 7 and codes[3, 1] == 0  # 5 * 2**-127 -> 0
    assert codes[4].tolist() == [0] * 32


# --------------------------------------------------------------------------------------
# The recording ops and the center update
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_record_ops_fold_amax_and_center_statistics(layout):
    g = torch.Generator().manual_seed(3)
    k = BLOCK[layout] * 2
    x = torch.randn(3, 5, k, generator=g) * 4 + 10
    s = torch.tensor([0.25])
    pending = torch.tensor([1.0, 100.0, 0.0])
    q = ops.quantize_fp4_record_amax(x, s, pending, 2, layout)
    assert pending.tolist() == [1.0, 100.0, x.abs().max().item()]
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(q, ops.quantize_fp4(x, s, layout), strict=True)
    )
    center = (torch.randn(k, generator=g) * 5).to(torch.float32)
    cmax = torch.full((3, k + 7), float("-inf"))
    cmin = torch.full((3, k + 7), float("inf"))
    cmax[0], cmin[0] = 1.0, -1.0
    before_max, before_min = cmax.clone(), cmin.clone()
    pending = torch.zeros(3)
    qc = ops.quantize_fp4_centered_record(x, s, center, pending, cmax, cmin, 1, layout)
    assert pending[1].item() == (x - center).abs().max().item() and pending[[0, 2]].tolist() == [0.0, 0.0]
    rows = x.reshape(-1, k)
    assert torch.equal(cmax[1, :k], rows.amax(0)) and torch.equal(cmin[1, :k], rows.amin(0))
    assert torch.equal(cmax[1, k:], before_max[1, k:]) and torch.equal(cmin[[0, 2]], before_min[[0, 2]])
    ref = ops.quantize_fp4(x, s, layout, center)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(qc, ref, strict=True))
    # a second call folds max/min; a NaN sticks in the amax
    y = x.clone()
    y[0, 0, 0] = math.nan
    ops.quantize_fp4_centered_record(y * 0.5, s, center, pending, cmax, cmin, 1, layout)
    assert math.isnan(pending[1].item())
    assert math.isnan(cmax[1, 0].item())


def update_centers_model(center, cmax, cmin, mask, m):
    m = f32(m)
    out = [row[:] for row in center]
    for j, row in enumerate(center):
        if not mask[j]:
            continue
        for c, v in enumerate(row):
            hi, lo = cmax[j][c], cmin[j][c]
            if math.isfinite(hi) and math.isfinite(lo):
                mu = f32(f32(0.5 * hi) + f32(0.5 * lo))
                out[j][c] = f32(v + f32(m * f32(mu - v)))
    return out


@pytest.mark.parametrize("fn", [ops.update_centers, update_centers_reference], ids=["op", "reference"])
@settings(deadline=None, max_examples=60)
@given(data=st.data())
def test_update_centers_matches_model(fn, data):
    n, c = data.draw(st.integers(1, 5)), data.draw(st.integers(0, 6))
    val = st.floats(-1e6, 1e6, width=32)
    stat = st.one_of(val, st.sampled_from([math.inf, -math.inf, math.nan]))
    center = [[data.draw(val) for _ in range(c)] for _ in range(n)]
    cmax = [[data.draw(stat) for _ in range(c)] for _ in range(n)]
    cmin = [[data.draw(stat) for _ in range(c)] for _ in range(n)]
    mask = [data.draw(st.booleans()) for _ in range(n)]
    m = data.draw(st.one_of(st.sampled_from([1.0, 0.5, 0.1]), st.floats(1e-3, 1.0)))
    t = [torch.tensor(v, dtype=torch.float32).reshape(n, c) for v in (center, cmax, cmin)]
    fn(t[0], t[1], t[2], torch.tensor(mask), m)
    want = update_centers_model(center, cmax, cmin, mask, m)
    assert torch.equal(t[0], torch.tensor(want, dtype=torch.float32).reshape(n, c))
    for j in range(n):
        if mask[j]:
            assert all(v == -math.inf for v in t[1][j].tolist()) and all(v == math.inf for v in t[2][j].tolist())
        else:
            assert [same(a, b) for a, b in zip(t[1][j].tolist(), cmax[j], strict=True)] == [True] * c


def test_update_centers_moves_toward_the_midrange():
    center = torch.tensor([[0.0, 10.0]])
    cmax, cmin = torch.tensor([[4.0, 12.0]]), torch.tensor([[2.0, 8.0]])
    ops.update_centers(center, cmax, cmin, torch.tensor([True]), 0.5)
    assert center.tolist() == [[1.5, 10.0]]  # midranges 3 and 10


# --------------------------------------------------------------------------------------
# Validation and torch.library registration
# --------------------------------------------------------------------------------------


def _raises(what: str):
    return pytest.raises(ValueError, match=re.escape(what))


def test_fp4_bad_inputs_raise_value_errors():
    x = torch.randn(2, 32)
    s = torch.tensor([1.0])
    with _raises("layout='fp4' is not allowed: expected one of ['mxfp4', 'nvfp4']"):
        ops.quantize_fp4(x, s, "fp4")
    with _raises("x.shape[-1]=16 is not allowed: expected a multiple of 32 (the mxfp4 block size)"):
        ops.quantize_fp4(torch.randn(2, 16), s, "mxfp4")
    with _raises("x.dtype"):
        ops.quantize_fp4(x.double(), s, "nvfp4")
    with _raises("center.shape"):
        ops.quantize_fp4(x, s, "nvfp4", torch.zeros(16))
    with _raises("scale.numel()"):
        ops.quantize_fp4(x, torch.ones(2), "nvfp4")
    pending = torch.zeros(2)
    with _raises("slot"):
        ops.quantize_fp4_record_amax(x, s, pending, 2, "nvfp4")
    with _raises("center_max.shape[1]=16 is not allowed: expected >= 32"):
        ops.quantize_fp4_centered_record(
            x, s, torch.zeros(32), pending, torch.zeros(2, 16), torch.zeros(2, 16), 0, "nvfp4"
        )
    assert pending.tolist() == [0.0, 0.0]
    packed, scales = ops.quantize_fp4(x, s, "nvfp4")
    with _raises("block_scales.dtype"):
        ops.dequantize_fp4(packed, scales.view(torch.uint8), s, "nvfp4", torch.float32)
    with _raises("block_scales.shape"):
        ops.dequantize_fp4(packed, scales[:, :1], s, "nvfp4", torch.float32)
    with _raises("packed.dtype"):
        ops.dequantize_fp4(packed.to(torch.int32), scales, s, "nvfp4", torch.float32)
    with _raises("dtype"):
        ops.dequantize_fp4(packed, scales, s, "nvfp4", torch.float64)
    with _raises("momentum=1.5 is not allowed: expected 0 < momentum <= 1"):
        ops.update_centers(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([True]), 1.5)
    with _raises("commit_mask.dtype"):
        ops.update_centers(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([1]), 0.5)


_O = torch.ops.fp8state
_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck_fp4_ops(layout):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g) * 3
    s = torch.tensor([2.0])
    c = torch.randn(64, generator=g)
    torch.library.opcheck(_O.quantize_fp4.default, (x, s, None, layout), test_utils=_UTILS)
    torch.library.opcheck(_O.quantize_fp4.default, (x.t().contiguous().t(), s, c, layout), test_utils=_UTILS)
    torch.library.opcheck(_O.quantize_fp4_record_amax.default, (x, s, torch.zeros(2), 1, layout), test_utils=_UTILS)
    stats = (torch.full((2, 64), -math.inf), torch.full((2, 64), math.inf))
    torch.library.opcheck(
        _O.quantize_fp4_centered_record.default, (x, s, c, torch.zeros(2), *stats, 0, layout), test_utils=_UTILS
    )
    packed, scales = ops.quantize_fp4(x, s, layout)
    for center in (None, c):
        torch.library.opcheck(
            _O.dequantize_fp4.default, (packed, scales, s, center, layout, torch.bfloat16), test_utils=_UTILS
        )
    args = (torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4) - 5, torch.tensor([True, False, True]), 0.25)
    torch.library.opcheck(_O.update_centers.default, args, test_utils=(*_UTILS, "test_schema"))


def test_fp4_schema_mutation_annotations():
    def mutated(op):
        return [a.name for a in op.default._schema.arguments if a.alias_info is not None and a.alias_info.is_write]

    assert mutated(_O.quantize_fp4) == [] and mutated(_O.dequantize_fp4) == []
    assert mutated(_O.quantize_fp4_record_amax) == ["amax_pending"]
    assert mutated(_O.quantize_fp4_centered_record) == ["amax_pending", "center_max", "center_min"]
    assert mutated(_O.update_centers) == ["center", "center_max", "center_min"]


# --------------------------------------------------------------------------------------
# Rules that pin what torch leaves to the device or version (canonical NaNs, signed zeros,
# the NVFP4 block scale of a zero or negative tensor scale)
# --------------------------------------------------------------------------------------


def bits32(t: torch.Tensor) -> list[int]:
    return [v & 0xFFFFFFFF for v in t.contiguous().view(torch.int32).reshape(-1).tolist()]


NEG_NAN = torch.tensor([0xFFC00000 - 2**32], dtype=torch.int32).view(torch.float32).item()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_nan_an_op_writes_is_canonical(layout):
    k = BLOCK[layout]
    x = torch.randn(2, k)
    x.view(torch.int32)[0, 1] = 0xFFC00000 - 2**32  # a negative NaN
    pending = torch.zeros(1)
    ops.quantize_fp4_record_amax(x, torch.tensor([1.0]), pending, 0, layout)
    assert bits32(pending) == [0x7FC00000]
    cmax, cmin = torch.full((1, k), -math.inf), torch.full((1, k), math.inf)
    ops.quantize_fp4_centered_record(x, torch.tensor([1.0]), torch.zeros(k), pending, cmax, cmin, 0, layout)
    assert bits32(cmax)[1] == 0x7FC00000 and bits32(cmin)[1] == 0x7FC00000
    packed, scales = ops.quantize_fp4(x, torch.tensor([1.0]), layout)
    canonical = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}
    for dtype, want in canonical.items():
        out = ops.dequantize_fp4(packed, scales, torch.tensor([1.0]), layout, dtype)
        raw16 = out.view(torch.int32 if dtype == torch.float32 else torch.int16)[0]
        assert {v & (0xFFFFFFFF if dtype == torch.float32 else 0xFFFF) for v in raw16.tolist()} == {want}
        nan_scale = scales.clone().view(torch.uint8)
        nan_scale[1] = 0xFF  # E4M3 0xFF (negative NaN) / E8M0 0xFF
        out = ops.dequantize_fp4(packed, nan_scale.view(SCALE_DTYPE[layout]), torch.tensor([1.0]), layout, dtype)
        raw16 = out.view(torch.int32 if dtype == torch.float32 else torch.int16)[1]
        assert {v & (0xFFFFFFFF if dtype == torch.float32 else 0xFFFF) for v in raw16.tolist()} == {want}
    # a centre update that yields NaN (inf - inf) writes the canonical NaN
    center = torch.tensor([[-math.inf, 1.0]])
    ops.update_centers(center, torch.tensor([[1.0, NEG_NAN]]), torch.tensor([[0.0, 0.0]]), torch.tensor([True]), 0.5)
    assert bits32(center) == [0x7FC00000, 0x3F800000]  # the NaN statistic leaves its centre alone


def test_center_statistics_order_negative_zero_below_positive_zero():
    x = torch.tensor([[0.0, -0.0, -0.0, 0.0], [-0.0, -0.0, 0.0, 0.0]])
    hi, lo = ops.center_stats_reference(x)
    assert bits32(hi) == [0, 0x80000000, 0, 0] and bits32(lo) == [0x80000000, 0x80000000, 0x80000000, 0]
    cmax = torch.tensor([[-0.0, 0.0, -math.inf, math.nan]])
    cmin = torch.tensor([[0.0, -0.0, math.inf, 1.0]])
    y = torch.tensor([[-0.0, -0.0, -0.0, 2.0]])
    folded_max, folded_min = ops.fold_center_stats_reference(cmax[0], cmin[0], y)
    row_max, row_min = torch.cat([cmax, torch.zeros(1, 12)], 1), torch.cat([cmin, torch.zeros(1, 12)], 1)
    ops.quantize_fp4_centered_record(
        y.repeat(1, 4), torch.ones(1), torch.zeros(16), torch.zeros(1), row_max, row_min, 0, "nvfp4"
    )
    assert bits32(row_max[0, :4]) == bits32(folded_max) and bits32(row_min[0, :4]) == bits32(folded_min)
    assert bits32(folded_max) == [0x80000000, 0, 0x80000000, 0x7FC00000]
    assert bits32(folded_min) == [0x80000000, 0x80000000, 0x80000000, 0x3F800000]


@pytest.mark.parametrize("s", [0.0, -0.0, -1.5, -math.inf])
def test_nvfp4_zero_or_negative_tensor_scale_gives_positive_zero_block_scales(s):
    """v <= 0 (-0 included) gives the block scale +0 (never the -0 code 0x80), enc = 0, and
    the elements encode as x * 0: signed zeros, or code 0 for inf * 0 = NaN."""
    finite = torch.tensor([[1.0, -2.0, 0.0, -0.0] + [3.0] * 12])
    packed, scales = ops.quantize_fp4(finite, torch.tensor([s]), "nvfp4")
    assert byte_list(scales) == [0x00]
    assert unpack_fp4_reference(packed)[0, :4].tolist() == [0, 8, 0, 8]
    with_inf = finite.clone()
    with_inf[0, 4:6] = torch.tensor([math.inf, -math.inf])
    packed, scales = ops.quantize_fp4(with_inf, torch.tensor([s]), "nvfp4")
    if s == 0:  # v = (inf / 6) * 0 = NaN: a NaN block
        assert byte_list(scales) == [0x7F] and unpack_fp4_reference(packed)[0].tolist() == [0] * 16
    else:  # v = -inf: block scale +0, inf * 0 = NaN -> code 0
        assert byte_list(scales) == [0x00]
        assert unpack_fp4_reference(packed)[0, :6].tolist() == [0, 8, 0, 8, 0, 0]
    assert byte_list(ops.quantize_fp4(finite, torch.tensor([math.nan]), "nvfp4")[1]) == [0x7F]
