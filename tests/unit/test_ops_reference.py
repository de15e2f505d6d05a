"""The fp8state ops and their pure-torch references against an independent float64 model.

The model below builds both FP8 formats from their bit layouts (exponent bits, mantissa
bits, bias, which codes are NaN/inf) and rounds in plain Python floats; it never calls
torch's float8 casts. The only torch casts used on the model side are float64 -> float32
(one IEEE round-to-nearest-even, how we round the float32 products the ops compute) and,
for the final step of decoding into bf16/fp16, float32 -> bf16/fp16.
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_fp8state import ops
from lightning_fp8state.ops import (
    amax_reference,
    dequantize_fp8_reference,
    quantize_fp8_reference,
    update_scales_reference,
)

# --------------------------------------------------------------------------------------
# Independent float64 model of the FP8 formats
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FormatModel:
    name: str
    dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int
    bias: int
    fn: bool  # "finite" variant (E4M3fn): no inf, only NaN is S.1111.111

    # ---- bit layout -----------------------------------------------------------------
    def decode(self, code: int) -> float:
        """Value of an 8-bit code (sign bit 0x80), from the bit layout alone."""
        sign = -1.0 if code & 0x80 else 1.0
        e = (code >> self.mantissa_bits) & ((1 << self.exponent_bits) - 1)
        m = code & ((1 << self.mantissa_bits) - 1)
        e_all = (1 << self.exponent_bits) - 1
        m_all = (1 << self.mantissa_bits) - 1
        if self.fn:
            if e == e_all and m == m_all:
                return math.nan
        elif e == e_all:
            return sign * math.inf if m == 0 else math.nan
        if e == 0:  # subnormal
            mag = (m / 2**self.mantissa_bits) * 2.0 ** (1 - self.bias)
        else:
            mag = (1.0 + m / 2**self.mantissa_bits) * 2.0 ** (e - self.bias)
        return sign * mag

    @property
    def table(self) -> tuple[list[float], list[int]]:
        """All non-negative finite values (sorted) and their codes."""
        pairs = []
        for code in range(0x80):
            v = self.decode(code)
            if math.isfinite(v):
                pairs.append((v, code))
        pairs.sort()
        return [v for v, _ in pairs], [c for _, c in pairs]

    @property
    def max(self) -> float:
        return self.table[0][-1]

    @property
    def min_subnormal(self) -> float:
        return self.table[0][1]

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)


E4M3_MODEL = FormatModel("e4m3", torch.float8_e4m3fn, 4, 3, 7, fn=True)
E5M2_MODEL = FormatModel("e5m2", torch.float8_e5m2, 5, 2, 15, fn=False)
MODELS = [E4M3_MODEL, E5M2_MODEL]

_TABLES = {m.name: m.table for m in MODELS}


def model_round(v: float, fmt: FormatModel) -> float:
    """Round float64 ``v`` to ``fmt``: nearest, ties to the even code, saturate to ±max, NaN stays."""
    if math.isnan(v):
        return math.nan
    values, codes = _TABLES[fmt.name]
    a = abs(v)
    top = values[-1]
    if a >= top:  # includes inf
        return math.copysign(top, v)
    i = bisect.bisect_right(values, a) - 1  # values[i] <= a < values[i + 1]
    lo, hi = values[i], values[i + 1]
    # 2a vs lo + hi: exact in float64 for these magnitudes.
    if 2 * a < lo + hi:
        r = lo
    elif 2 * a > lo + hi:
        r = hi
    else:
        r = lo if codes[i] % 2 == 0 else hi
    return math.copysign(r, v)


def midpoints(fmt: FormatModel) -> list[float]:
    """Exact halfway points between consecutive non-negative values, plus the one past max."""
    values, _ = _TABLES[fmt.name]
    mids = [(a + b) / 2 for a, b in zip(values, values[1:], strict=False)]
    ulp_top = values[-1] - values[-2]
    mids.append(values[-1] + ulp_top / 2)  # would-be tie above max: must saturate
    return mids


# --------------------------------------------------------------------------------------
# Helpers (float32 rounding without float8 casts)
# --------------------------------------------------------------------------------------


def to_f32(vals: list[float]) -> list[float]:
    """Round float64 values to float32 once (RNE, overflow to inf)."""
    return torch.tensor(vals, dtype=torch.float64).to(torch.float32).tolist()


def f32(v: float) -> float:
    return to_f32([v])[0]


def as_f64_list(t: torch.Tensor) -> list[float]:
    return t.detach().to(torch.float64).reshape(-1).tolist()


def same_value(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def sign_bits(q: torch.Tensor) -> list[bool]:
    return ((q.contiguous().view(torch.uint8) & 0x80) != 0).reshape(-1).tolist()


F32_MAX = float(torch.finfo(torch.float32).max)
FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
MODEL_BY_DTYPE = {m.dtype: m for m in MODELS}
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def check_quantized(q: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, fmt: FormatModel) -> None:
    """Compare quantize output with the model, element by element, including sign bits."""
    assert q.dtype == fmt.dtype
    assert q.shape == x.shape
    xs = as_f64_list(x)  # exact upcast of fp32/bf16/fp16
    s = float(scale.reshape(()).item())
    assert s == f32(s)
    products = to_f32([xi * s for xi in xs])  # float64 product of two float32s is exact
    got = as_f64_list(q)
    signs = sign_bits(q)
    for i, (xi, p, g, neg) in enumerate(zip(xs, products, got, signs, strict=True)):
        want = model_round(p, fmt)
        assert same_value(g, want), f"[{i}] x={xi!r} scale={s!r} product={p!r}: want {want!r}, got {g!r}"
        if not math.isnan(want) and want != 0.0:
            assert neg == (math.copysign(1.0, p) < 0), f"[{i}] sign bit wrong for product {p!r}"


# --------------------------------------------------------------------------------------
# The model itself (pinned to facts from the format definitions, not to op output)
# --------------------------------------------------------------------------------------


def test_model_tables_match_format_definitions():
    e4, e5 = E4M3_MODEL, E5M2_MODEL
    # E4M3fn: 16 * 8 codes minus the single NaN; E5M2: 31 exponents * 4 mantissas.
    assert len(_TABLES["e4m3"][0]) == 127
    assert len(_TABLES["e5m2"][0]) == 124
    assert e4.max == 448.0 and e5.max == 57344.0
    assert e4.min_subnormal == 2.0**-9 and e5.min_subnormal == 2.0**-16
    assert e4.min_normal == 2.0**-6 and e5.min_normal == 2.0**-14
    assert math.isnan(e4.decode(0x7F)) and math.isnan(e4.decode(0xFF))
    assert e4.decode(0x7E) == 448.0 and e4.decode(0xFE) == -448.0
    assert e5.decode(0x7C) == math.inf and e5.decode(0xFC) == -math.inf
    assert all(math.isnan(e5.decode(c)) for c in (0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF))
    assert math.copysign(1.0, e4.decode(0x80)) < 0 and e4.decode(0x80) == 0.0
    # Ties to even code, saturation, NaN.
    assert model_round(432.0, e4) == 448.0  # 416 (m=101) vs 448 (m=110)
    assert model_round(400.0, e4) == 384.0  # 384 (m=100) vs 416 (m=101)
    assert model_round(2.0**-10, e4) == 0.0  # half the min subnormal: 0 has the even code
    assert model_round(3 * 2.0**-10, e4) == 2.0**-8
    assert model_round(2.0**-17, e5) == 0.0
    assert model_round(-3 * 2.0**-17, e5) == -(2.0**-15)
    assert model_round(1e9, e4) == 448.0 and model_round(-math.inf, e5) == -57344.0
    assert model_round(61440.0, e5) == 57344.0
    assert math.isnan(model_round(math.nan, e4))


# --------------------------------------------------------------------------------------
# quantize_fp8: exhaustive grid points and ties
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("k", [0, -3, 5])
def test_quantize_every_grid_point_and_every_tie(fmt, in_dtype, k):
    """Scale 2**k so x * scale is exact: every representable value and every halfway point."""
    values, _ = _TABLES[fmt.name]
    targets = values[1:] + midpoints(fmt)
    targets = targets + [-t for t in targets]
    x = torch.tensor([t * 2.0**-k for t in targets], dtype=torch.float64).to(in_dtype)
    # The input dtype must carry the target exactly, otherwise it is not a tie test.
    exact = torch.tensor(as_f64_list(x), dtype=torch.float64) * 2.0**k == torch.tensor(targets, dtype=torch.float64)
    if in_dtype != torch.float16:
        assert bool(exact.all())
    else:
        assert int(exact.sum()) > len(targets) // 2
    scale = torch.tensor(2.0**k, dtype=torch.float32)
    q = ops.quantize_fp8(x, scale, fmt.dtype)
    check_quantized(q, x, scale, fmt)
    # And explicitly: grid points are exact, ties go to the even code.
    got = as_f64_list(q)
    for t, xi, g in zip(targets, as_f64_list(x), got, strict=True):
        if xi * 2.0**k != t:
            continue
        assert g == model_round(t, fmt)
        if abs(t) in values:
            assert g == t


# --------------------------------------------------------------------------------------
# quantize_fp8: hypothesis properties
# --------------------------------------------------------------------------------------

POW2_SCALES = [2.0**k for k in range(-8, 9)]
scale_strategy = st.one_of(
    st.sampled_from(POW2_SCALES),
    st.floats(min_value=2.0**-12, max_value=2.0**12, width=32),
    st.floats(min_value=2.0**-126, max_value=2.0**100, width=32),
)


def target_strategy(fmt: FormatModel):
    """Magnitudes the format cares about, in the scaled (post-multiply) domain."""
    values, _ = _TABLES[fmt.name]
    interesting = st.sampled_from(
        values[1:]
        + midpoints(fmt)
        + [fmt.max * f for f in (0.999, 1.0001, 1.03, 1.07, 2.0, 1e6)]
        + [fmt.min_subnormal * f for f in (0.25, 0.5, 0.5000001, 0.75, 1.5, 2.5)]
    )
    log_uniform = st.builds(
        lambda e, m: m * 2.0**e,
        st.integers(min_value=-(fmt.bias + fmt.mantissa_bits + 3), max_value=fmt.bias + 3),
        st.floats(min_value=1.0, max_value=2.0),
    )
    return st.one_of(interesting, log_uniform)


@st.composite
def quantize_case(draw, fmt: FormatModel):
    scale = draw(scale_strategy)
    raw32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
    scaled = st.builds(
        lambda t, neg: (-t if neg else t) / scale,
        target_strategy(fmt),
        st.booleans(),
    )
    xs = draw(st.lists(st.one_of(scaled, scaled, raw32), min_size=1, max_size=40))
    return xs, scale


@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("fmt", MODELS, ids=lambda m: m.name)
@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_quantize_matches_model(fmt, in_dtype, data):
    xs, s = data.draw(quantize_case(fmt))
    x = torch.tensor(xs, dtype=torch.float64).to(in_dtype)
    scale = torch.tensor(s, dtype=torch.float32)
    q = ops.quantize_fp8(x, scale, fmt.dtype)
    check_quantized(q, x, scale, fmt)
    # The pure-torch reference is the same function bit for bit.
    assert bits_equal(quantize_fp8_reference(x, scale, fmt.dtype), q)


@pytest.mark.parametrize("fmt", MODELS, ids=lambda m: m.name)
@settings(deadline=None, max_examples=25)
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=st.sampled_from([(7,), (3, 5), (2, 3, 4), (1,), ()]),
    s=scale_strategy,
    spread=st.integers(0, 12),
)
def test_quantize_random_tensors_match_model(fmt, seed, shape, s, spread):
    """Dense random float32 tensors of various shapes with wide magnitude spread."""
    g = torch.Generator().manual_seed(seed)
    mant = torch.randn(shape, generator=g)
    expo = torch.randint(-spread, spread + 1, shape, generator=g).to(torch.float32)
    x = (mant * torch.exp2(expo)).to(torch.float32)
    scale = torch.tensor(s, dtype=torch.float32)
    q = ops.quantize_fp8(x, scale, fmt.dtype)
    check_quantized(q, x, scale, fmt)


@pytest.mark.parametrize("fmt", MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=str)
def test_quantize_saturates_and_keeps_nan(fmt, in_dtype):
    big = torch.finfo(in_dtype).max
    x = torch.tensor(
        [math.inf, -math.inf, big, -big, fmt.max * 1.5, -fmt.max * 1.5, math.nan, -math.nan, 1.0, -1.0],
        dtype=torch.float64,
    ).to(in_dtype)
    scale = torch.tensor(1.0, dtype=torch.float32)
    got = as_f64_list(ops.quantize_fp8(x, scale, fmt.dtype))
    m = fmt.max
    assert got[:6] == [m, -m, m, -m, m, -m]
    assert math.isnan(got[6]) and math.isnan(got[7])
    assert got[8:] == [1.0, -1.0]
    # A finite input whose float32 product overflows to inf also saturates.
    x = torch.tensor([3e38, -3e38, 1.0], dtype=torch.float32)
    got = as_f64_list(ops.quantize_fp8(x, torch.tensor(1e10, dtype=torch.float32), fmt.dtype))
    assert got == [m, -m, m]
    # The saturated result is never an E5M2 infinity code.
    q = ops.quantize_fp8(torch.tensor([math.inf, -math.inf]), scale, fmt.dtype)
    assert all(math.isfinite(v) for v in as_f64_list(q))


# --------------------------------------------------------------------------------------
# quantize_fp8_record_amax
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", MODELS, ids=lambda m: m.name)
@settings(deadline=None, max_examples=40)
@given(
    data=st.data(),
    n_slots=st.integers(1, 6),
    in_dtype=st.sampled_from(IN_DTYPES),
)
def test_record_amax_quantizes_and_folds_amax(fmt, data, n_slots, in_dtype):
    slot = data.draw(st.integers(0, n_slots - 1))
    xs, s = data.draw(quantize_case(fmt))
    x = torch.tensor(xs, dtype=torch.float64).to(in_dtype)
    scale = torch.tensor(s, dtype=torch.float32)
    old = data.draw(
        st.lists(
            st.one_of(st.floats(0.0, 1e6, width=32), st.just(math.nan), st.just(math.inf)),
            min_size=n_slots,
            max_size=n_slots,
        )
    )
    pending = torch.tensor(old, dtype=torch.float32)
    before = pending.clone()

    q = ops.quantize_fp8_record_amax(x, scale, pending, slot, fmt.dtype)

    assert bits_equal(q, ops.quantize_fp8(x, scale, fmt.dtype))
    check_quantized(q, x, scale, fmt)
    xv = as_f64_list(x)
    if any(math.isnan(v) for v in xv) or math.isnan(old[slot]):
        want = math.nan
    else:
        want = max([old[slot]] + [abs(v) for v in xv])
    got = as_f64_list(pending)
    assert same_value(got[slot], want), f"slot {slot}: want {want!r}, got {got[slot]!r}"
    others = [i for i in range(n_slots) if i != slot]
    assert bits_equal(pending[others], before[others])


def test_record_amax_details():
    fmt = torch.float8_e4m3fn
    g = torch.Generator().manual_seed(7)
    scale = torch.tensor(0.75, dtype=torch.float32)
    pending = torch.tensor([0.5, 2.0, 0.0], dtype=torch.float32)

    # Two consecutive calls accumulate the running max.
    x1 = torch.randn(64, generator=g) * 3.0
    x2 = torch.randn(64, generator=g) * 11.0
    ops.quantize_fp8_record_amax(x1, scale, pending, 2, fmt)
    assert pending[2].item() == x1.abs().max().item()
    ops.quantize_fp8_record_amax(x2, scale, pending, 2, fmt)
    m = max(x1.abs().max().item(), x2.abs().max().item())
    assert pending[2].item() == m
    ops.quantize_fp8_record_amax(x1 * 1e-3, scale, pending, 2, fmt)  # smaller: no change
    assert pending[2].item() == m
    assert pending[:2].tolist() == [0.5, 2.0]

    # An empty x leaves the slot unchanged and returns an empty fp8 tensor.
    q = ops.quantize_fp8_record_amax(torch.empty(0, 3), scale, pending, 1, fmt)
    assert q.shape == (0, 3) and q.dtype == fmt
    assert pending.tolist() == [0.5, 2.0, m]

    # NaN in x makes the slot NaN, and NaN sticks through later calls.
    x3 = torch.randn(16, generator=g)
    x3[5] = math.nan
    q = ops.quantize_fp8_record_amax(x3, scale, pending, 0, fmt)
    assert math.isnan(pending[0].item())
    assert math.isnan(q.to(torch.float32)[5].item())
    ops.quantize_fp8_record_amax(torch.randn(16, generator=g) * 100, scale, pending, 0, fmt)
    assert math.isnan(pending[0].item())
    assert pending[1:].tolist() == [2.0, m]

    # An infinite input records inf and quantizes to +max.
    q = ops.quantize_fp8_record_amax(torch.tensor([1.0, -math.inf]), scale, pending, 1, fmt)
    assert pending[1].item() == math.inf
    assert q.to(torch.float32).tolist() == [0.75, -448.0]


def test_amax_reference():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 7, generator=g) * 40).to(torch.bfloat16)
    a = amax_reference(x)
    assert a.dtype == torch.float32 and a.shape == ()
    assert a.item() == max(abs(v) for v in as_f64_list(x))
    assert amax_reference(torch.empty(0)).item() == 0.0
    y = torch.randn(9, generator=g)
    y[3] = math.nan
    assert math.isnan(amax_reference(y).item())


# --------------------------------------------------------------------------------------
# dequantize_fp8
# --------------------------------------------------------------------------------------


def all_codes(fmt: FormatModel) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.dtype)


def dequant_model(fmt: FormatModel, d: float, out_dtype: torch.dtype) -> torch.Tensor:
    """Expected decode of all 256 codes: float32(decode(code) * descale), then one rounding."""
    decoded = [fmt.decode(c) for c in range(256)]
    prods = to_f32([v * d for v in decoded])  # exact float64 products, one rounding
    return torch.tensor(prods, dtype=torch.float32).to(out_dtype)


def assert_same_floats(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = as_f64_list(got), as_f64_list(want)
    for i, (a, b) in enumerate(zip(g, w, strict=True)):
        assert same_value(a, b), f"[{i}] want {b!r}, got {a!r}"
        if not math.isnan(b):
            assert math.copysign(1.0, a) == math.copysign(1.0, b), f"[{i}] sign of {b!r}"


@pytest.mark.parametrize("fmt", MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("out_dtype", IN_DTYPES, ids=str)
@settings(deadline=None, max_examples=30)
@given(
    d=st.one_of(
        st.sampled_from([1.0, 0.5, 2.0**-20, 2.0**20]),
        st.floats(min_value=2.0**-10, max_value=2.0**10, width=32),
        st.floats(min_value=2.0**-149, max_value=F32_MAX, width=32),
    )
)
def test_dequantize_all_codes_match_model(fmt, out_dtype, d):
    q = all_codes(fmt)
    descale = torch.tensor(d, dtype=torch.float32)
    got = ops.dequantize_fp8(q, descale, out_dtype)
    want = dequant_model(fmt, d, out_dtype)
    assert_same_floats(got, want)
    assert bits_equal(dequantize_fp8_reference(q, descale, out_dtype), got)


@pytest.mark.parametrize("fmt", MODELS, ids=lambda m: m.name)
def test_dequantize_descale_one_is_the_decode(fmt):
    got = ops.dequantize_fp8(all_codes(fmt), torch.tensor([1.0]), torch.float32)
    want = torch.tensor([fmt.decode(c) for c in range(256)], dtype=torch.float64).to(torch.float32)
    assert_same_floats(got, want)


@pytest.mark.parametrize("fmt", MODELS, ids=lambda m: m.name)
@settings(deadline=None, max_examples=40)
@given(
    data=st.data(),
    s=st.one_of(st.sampled_from(POW2_SCALES), st.floats(min_value=2.0**-10, max_value=2.0**10, width=32)),
)
def test_round_trip_within_half_ulp(fmt, data, s):
    """quantize then dequantize with descale = 1/scale: within half a format ULP (normal range)."""
    lo_e = 1 - fmt.bias
    hi_e = int(math.floor(math.log2(fmt.max)))
    targets = data.draw(
        st.lists(
            st.builds(
                lambda e, m, neg: (-1.0 if neg else 1.0) * m * 2.0**e,
                st.integers(lo_e, hi_e),
                st.floats(1.0, 1.99),
                st.booleans(),
            ),
            min_size=1,
            max_size=32,
        )
    )
    x = torch.tensor([t / s for t in targets], dtype=torch.float64).to(torch.float32)
    scale = torch.tensor(s, dtype=torch.float32)
    descale = torch.tensor(f32(1.0 / s), dtype=torch.float32)
    q = ops.quantize_fp8(x, scale, fmt.dtype)
    back = ops.dequantize_fp8(q, descale, torch.float32)
    xs = as_f64_list(x)
    products = to_f32([v * s for v in xs])
    half = 2.0 ** -(fmt.mantissa_bits + 1)
    for xi, v, qi, bi in zip(xs, products, as_f64_list(q), as_f64_list(back), strict=True):
        if not (fmt.min_normal <= abs(v) <= fmt.max):
            continue
        e = math.floor(math.log2(abs(v)))
        # In the scaled domain: exactly within half an ULP at that magnitude.
        assert abs(qi - v) <= 2.0 ** (e - fmt.mantissa_bits - 1)
        # Back in x's domain: relative half ULP plus a few float32 roundings.
        assert abs(bi - xi) <= abs(xi) * (half + 2.0**-21), (xi, s, qi, bi)


# --------------------------------------------------------------------------------------
# update_scales
# --------------------------------------------------------------------------------------


def update_model(history, scale, descale, pending, count, mask, fmax, algo, margin):
    """Pure-Python owner loop. history is [H][n] lists of floats; returns new copies."""
    H, n = len(history), len(scale)
    history = [row[:] for row in history]
    scale, descale, pending, count = scale[:], descale[:], pending[:], count[:]
    for j in range(n):
        if not mask[j]:
            continue
        p = pending[j]
        if math.isfinite(p):
            col = [p] + [history[r][j] for r in range(H - 1)]
            for r in range(H):
                history[r][j] = col[r]
            amax = max(col) if algo == "max" else col[0]
            if amax > 0:
                c = f32(f32(fmax[j] / amax) / 2.0**margin)
                if math.isfinite(c):
                    scale[j] = c
                    descale[j] = f32(1.0 / c)
        else:
            count[j] += 1
        pending[j] = 0.0
    return history, scale, descale, pending, count


hist_value = st.one_of(
    st.just(0.0),
    st.floats(min_value=2.0**-20, max_value=2.0**20, width=32),
    st.floats(min_value=0.0, max_value=F32_MAX, width=32, allow_subnormal=True),
)
pending_value = st.one_of(
    hist_value,
    st.sampled_from([0.0, math.inf, -math.inf, math.nan, 2.0**-140, 1e-38, 3e38]),
)


@st.composite
def update_case(draw):
    H = draw(st.integers(1, 8))
    n = draw(st.integers(1, 10))
    # Every value is a float32, so the model and the tensors start from the same numbers.
    history = [to_f32([draw(hist_value) for _ in range(n)]) for _ in range(H)]
    scale = [draw(st.floats(min_value=2.0**-30, max_value=2.0**30, width=32)) for _ in range(n)]
    descale = [f32(1.0 / s) for s in scale]
    pending = to_f32([draw(pending_value) for _ in range(n)])
    count = [draw(st.integers(0, 5)) for _ in range(n)]
    mask = [draw(st.booleans()) for _ in range(n)]
    fmax = [draw(st.sampled_from([448.0, 57344.0])) for _ in range(n)]
    algo = draw(st.sampled_from(["max", "most_recent"]))
    margin = draw(st.integers(0, 3))
    return history, scale, descale, pending, count, mask, fmax, algo, margin


def make_update_tensors(history, scale, descale, pending, count, mask, fmax):
    return (
        torch.tensor(history, dtype=torch.float32),
        torch.tensor(scale, dtype=torch.float32),
        torch.tensor(descale, dtype=torch.float32),
        torch.tensor(pending, dtype=torch.float32),
        torch.tensor(count, dtype=torch.int32),
        torch.tensor(mask, dtype=torch.bool),
        torch.tensor(fmax, dtype=torch.float32),
    )


@pytest.mark.parametrize("fn", [ops.update_scales, update_scales_reference], ids=["op", "reference"])
@settings(deadline=None, max_examples=60)
@given(case=update_case())
def test_update_scales_matches_model(fn, case):
    history, scale, descale, pending, count, mask, fmax, algo, margin = case
    tensors = make_update_tensors(history, scale, descale, pending, count, mask, fmax)
    before = [t.clone() for t in tensors]
    t_hist, t_scale, t_descale, t_pending, t_count, t_mask, t_fmax = tensors

    fn(t_hist, t_scale, t_descale, t_pending, t_count, t_mask, t_fmax, algo, margin)

    w_hist, w_scale, w_descale, w_pending, w_count = update_model(
        history, scale, descale, pending, count, mask, fmax, algo, margin
    )
    assert bits_equal(t_hist, torch.tensor(w_hist, dtype=torch.float32)), (t_hist, w_hist)
    assert bits_equal(t_scale, torch.tensor(w_scale, dtype=torch.float32)), (t_scale, w_scale)
    assert bits_equal(t_descale, torch.tensor(w_descale, dtype=torch.float32)), (t_descale, w_descale)
    assert bits_equal(t_pending, torch.tensor(w_pending, dtype=torch.float32)), (t_pending, w_pending)
    assert t_count.tolist() == w_count
    assert bits_equal(t_mask, before[5]) and bits_equal(t_fmax, before[6])

    # The properties, stated directly.
    H = len(history)
    for j in range(len(scale)):
        p = pending[j]
        if not mask[j]:
            for got, old in zip(tensors[:5], before[:5], strict=True):
                col = (slice(None), slice(j, j + 1)) if got.dim() == 2 else slice(j, j + 1)
                assert bits_equal(got[col], old[col]), f"unselected owner {j} changed"
            continue
        assert t_pending[j].item() == 0.0 and not math.copysign(1.0, t_pending[j].item()) < 0
        if math.isfinite(p):
            assert t_hist[0, j].item() == p
            assert t_hist[1:, j].tolist() == [history[r][j] for r in range(H - 1)]
            assert t_count[j].item() == count[j]
            amax = max(t_hist[:, j].tolist()) if algo == "max" else t_hist[0, j].item()
            if amax == 0.0:
                assert t_scale[j].item() == scale[j] and t_descale[j].item() == descale[j]
        else:
            assert t_hist[:, j].tolist() == [history[r][j] for r in range(H)]
            assert t_scale[j].item() == scale[j] and t_descale[j].item() == descale[j]
            assert t_count[j].item() == count[j] + 1
    assert bool(torch.isfinite(t_scale).all()) and bool((t_scale > 0).all())
    assert bool(torch.isfinite(t_descale).all()) and bool((t_descale > 0).all())


def test_update_scales_hand_checked():
    """A small case worked out by hand."""
    g = torch.Generator().manual_seed(11)
    hist = torch.tensor([[2.0, 0.0, 8.0, 1.0], [16.0, 0.0, 1.0, 1.0]], dtype=torch.float32)
    scale0 = (torch.rand(4, generator=g) + 0.5).to(torch.float32)
    scale = scale0.clone()
    descale = 1.0 / scale
    descale0 = descale.clone()
    pending = torch.tensor([4.0, 0.0, math.nan, 3.0], dtype=torch.float32)
    count = torch.tensor([0, 0, 2, 0], dtype=torch.int32)
    mask = torch.tensor([True, True, True, False])
    fmax = torch.full((4,), 448.0)

    ops.update_scales(hist, scale, descale, pending, count, mask, fmax, "max", 1)

    assert hist.tolist() == [[4.0, 0.0, 8.0, 1.0], [2.0, 0.0, 1.0, 1.0]]
    assert scale[0].item() == 56.0
    assert descale[0].item() == f32(1.0 / 56.0)
    assert scale[1].item() == scale0[1].item() and descale[1].item() == descale0[1].item()  # zero amax
    assert scale[2].item() == scale0[2].item() and descale[2].item() == descale0[2].item()  # NaN pending
    assert scale[3].item() == scale0[3].item() and descale[3].item() == descale0[3].item()  # unselected
    assert count.tolist() == [0, 0, 3, 0]
    assert pending.tolist() == [0.0, 0.0, 0.0, 3.0]

    # most_recent uses row 0 only: history [1, 100] -> amax 1, not 100.
    hist = torch.tensor([[100.0]], dtype=torch.float32).repeat(2, 1)
    scale, descale = torch.tensor([1.0]), torch.tensor([1.0])
    ops.update_scales(
        hist, scale, descale, torch.tensor([1.0]), torch.zeros(1, dtype=torch.int32),
        torch.tensor([True]), torch.tensor([448.0]), "most_recent", 0,
    )  # fmt: skip
    assert hist.tolist() == [[1.0], [100.0]]
    assert scale.item() == 448.0 and descale.item() == f32(1 / 448.0)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_update_scales_zero_amax_keeps_scale(algo):
    g = torch.Generator().manual_seed(5)
    n = 6
    hist = torch.zeros(3, n)
    scale = (torch.rand(n, generator=g) * 10 + 0.1).to(torch.float32)
    descale = 1.0 / scale
    s0, d0 = scale.clone(), descale.clone()
    pending = torch.zeros(n)
    ops.update_scales(
        hist, scale, descale, pending, torch.zeros(n, dtype=torch.int32),
        torch.ones(n, dtype=torch.bool), torch.full((n,), 448.0), algo, 2,
    )  # fmt: skip
    assert bits_equal(scale, s0) and bits_equal(descale, d0)
    assert hist.tolist() == [[0.0] * n] * 3


# --------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------


def _raises(what: str):
    return pytest.raises(ValueError, match=re.escape(what))


def test_quantize_bad_inputs_raise_value_errors():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, generator=g)
    s = torch.tensor(1.5)
    e4 = torch.float8_e4m3fn
    with _raises("x.dtype"):
        ops.quantize_fp8((x * 10).to(torch.int32), s, e4)
    with _raises("x.dtype"):
        ops.quantize_fp8(x.to(torch.float64), s, e4)
    with _raises("scale.numel()"):
        ops.quantize_fp8(x, torch.tensor([1.0, 2.0]), e4)
    with _raises("scale.dtype"):
        ops.quantize_fp8(x, torch.tensor(1.5, dtype=torch.float64), e4)
    with _raises("dtype"):
        ops.quantize_fp8(x, s, torch.float16)
    pending = torch.rand(3, generator=g)
    pending_before = pending.clone()
    for bad in (3, -1, 100):
        with _raises("slot"):
            ops.quantize_fp8_record_amax(x, s, pending, bad, e4)
    with _raises("scale.numel()"):
        ops.quantize_fp8_record_amax(x, torch.tensor([1.0, 2.0]), pending, 0, e4)
    with _raises("x.dtype"):
        ops.quantize_fp8_record_amax(x.to(torch.int32), s, pending, 0, e4)
    with _raises("amax_pending.dtype"):
        ops.quantize_fp8_record_amax(x, s, pending.double(), 0, e4)
    with _raises("amax_pending.dim()"):
        ops.quantize_fp8_record_amax(x, s, pending.reshape(1, 3), 0, e4)
    assert bits_equal(pending, pending_before)  # rejected calls record nothing


def test_dequantize_bad_inputs_raise_value_errors():
    q = torch.randn(5).to(torch.float8_e5m2)
    d = torch.tensor(0.25)
    with _raises("q.dtype"):
        ops.dequantize_fp8(torch.randn(5), d, torch.float32)
    with _raises("dtype"):
        ops.dequantize_fp8(q, d, torch.float64)
    with _raises("descale.numel()"):
        ops.dequantize_fp8(q, torch.tensor([0.25, 0.5]), torch.float32)
    with _raises("descale.dtype"):
        ops.dequantize_fp8(q, torch.tensor(0.25, dtype=torch.float64), torch.float32)


def _update_args(n=4, H=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(n, generator=g) + 0.5
    return [
        torch.rand(H, n, generator=g) * 10,
        scale,
        1.0 / scale,
        torch.rand(n, generator=g) * 10,
        torch.zeros(n, dtype=torch.int32),
        torch.rand(n, generator=g) > 0.5,
        torch.full((n,), 448.0),
        "max",
        1,
    ]


@pytest.mark.parametrize(
    ("index", "bad", "what"),
    [
        (7, "mean", "amax_algo"),
        (7, "", "amax_algo"),
        (8, -1, "margin"),
        (0, torch.rand(3, 4, 1), "amax_history.dim()"),
        (1, torch.rand(5) + 0.5, "scale.shape"),
        (1, torch.rand(4, dtype=torch.float64) + 0.5, "scale.dtype"),
        (3, torch.rand(4, dtype=torch.float16), "amax_pending.dtype"),
        (4, torch.zeros(4, dtype=torch.int64), "nonfinite_count.dtype"),
        (5, torch.ones(4, dtype=torch.uint8), "commit_mask.dtype"),
        (6, torch.full((3,), 448.0), "fmax.shape"),
    ],
)
def test_update_scales_bad_inputs_raise_value_errors(index, bad, what):
    args = _update_args()
    args[index] = bad
    snapshot = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with _raises(what):
        ops.update_scales(*args)
    # A rejected call mutates nothing.
    for a, b in zip(args, snapshot, strict=True):
        if isinstance(a, torch.Tensor):
            assert bits_equal(a, b)


# --------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------

_O = torch.ops.fp8state
_ALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 4 + 0.1).to(dtype)


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_opcheck_quantize_ops(fp8, in_dtype):
    x = _rand(4, 8, seed=1, dtype=in_dtype)
    s = torch.tensor(1.75)
    torch.library.opcheck(_O.quantize_fp8.default, (x, s, fp8), test_utils=_ALL_UTILS)
    pending = torch.rand(3) + 0.01
    torch.library.opcheck(_O.quantize_fp8_record_amax.default, (x, s, pending, 1, fp8), test_utils=_ALL_UTILS)


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("out_dtype", IN_DTYPES, ids=str)
def test_opcheck_dequantize(fp8, out_dtype):
    q = ops.quantize_fp8(_rand(4, 8, seed=2), torch.tensor(3.0), fp8)
    args = (q, torch.tensor(0.3), out_dtype)
    others = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(_O.dequantize_fp8.default, args, test_utils=others)
    # torch's schema checker compares inputs before/after with torch.allclose, which has no
    # CPU float8 kernel, so test_schema cannot run on an fp8 input. Accept only that failure...
    try:
        torch.library.opcheck(_O.dequantize_fp8.default, args, test_utils="test_schema")
    except Exception as e:
        assert "not implemented for 'Float8_e" in str(e), e
    # ...and check what it would have checked by hand: nothing mutable/aliased, q untouched,
    # a fresh output of the requested dtype and shape.
    schema = _O.dequantize_fp8.default._schema
    assert all(a.alias_info is None for a in schema.arguments)
    assert all(r.alias_info is None for r in schema.returns)
    q_before = q.clone()
    out = _O.dequantize_fp8(*args)
    assert bits_equal(q, q_before)
    assert out.dtype == out_dtype and out.shape == q.shape
    assert out.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_opcheck_update_scales(algo):
    args = _update_args(n=6, H=4, seed=3)
    args[5] = torch.tensor([True, False, True, True, False, True])
    args[3][2] = math.inf
    args[7] = algo
    torch.library.opcheck(_O.update_scales.default, tuple(args), test_utils=_ALL_UTILS)


def test_schema_mutation_annotations():
    """Only the documented outputs are marked as mutated."""

    def mutated(op):
        return [a.name for a in op.default._schema.arguments if a.alias_info is not None and a.alias_info.is_write]

    assert mutated(_O.quantize_fp8) == []
    assert mutated(_O.dequantize_fp8) == []
    assert mutated(_O.quantize_fp8_record_amax) == ["amax_pending", "saturation"]
    assert mutated(_O.update_scales) == ["amax_history", "scale", "descale", "amax_pending", "nonfinite_count"]


@pytest.mark.parametrize("which", ["quantize_fp8", "quantize_fp8_record_amax", "dequantize_fp8"])
def test_opcheck_fake_strides_non_contiguous_input(which):
    x = _rand(8, 4, seed=4).t()  # non-contiguous, strides (1, 4)
    s = torch.tensor(2.0)
    e4 = torch.float8_e4m3fn
    if which == "quantize_fp8":
        op, args = _O.quantize_fp8.default, (x, s, e4)
    elif which == "quantize_fp8_record_amax":
        op, args = _O.quantize_fp8_record_amax.default, (x, s, torch.rand(2) + 0.01, 0, e4)
    else:
        op, args = _O.dequantize_fp8.default, (ops.quantize_fp8(x, s, e4), torch.tensor(0.5), torch.float32)
    torch.library.opcheck(op, args, test_utils="test_faketensor")


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_transpose_fp8_moves_every_code(fp8):
    g = torch.Generator().manual_seed(4)
    q = torch.randint(0, 256, (13, 37), generator=g, dtype=torch.uint8).view(fp8)
    out = ops.transpose_fp8(q)
    assert out.shape == (37, 13) and out.is_contiguous() and out.dtype == fp8
    codes, moved = q.view(torch.uint8), out.view(torch.uint8)
    assert all(moved[c, r] == codes[r, c] for r in range(13) for c in range(37))
    finite = ops.quantize_fp8(_rand(13, 37, seed=2), torch.tensor(1.0), fp8)  # opcheck compares values: no NaN
    torch.library.opcheck(
        torch.ops.fp8state.transpose_fp8.default, (finite,), test_utils=("test_faketensor", "test_aot_dispatch_dynamic")
    )


def test_transpose_fp8_bad_inputs_raise_value_errors():
    with pytest.raises(ValueError, match=r"q.dtype=torch.float32 is not allowed: expected one of"):
        ops.transpose_fp8(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"q.dim\(\)=1 is not allowed: expected 2"):
        ops.transpose_fp8(torch.zeros(4, dtype=torch.uint8).view(torch.float8_e4m3fn))


# --------------------------------------------------------------------------------------
# quantize + transpose + column sums (the backward's grad_output in one read)
# --------------------------------------------------------------------------------------
def _column_sums_by_hand(x: torch.Tensor) -> list[float]:
    """The kernel's summation order written as scalar float32 loops (numpy-free: each add is
    rounded to float32 through a one-element tensor): per column, per 128-row tile, per row
    ``i < rpp`` of a pass, rows ``i, i + rpp, ..`` in order; then the ``rpp`` partials; then the tiles."""

    def add(a: float, b: float) -> float:
        return float(torch.tensor([a], dtype=torch.float32) + torch.tensor([b], dtype=torch.float32))

    rows, cols = x.shape
    rpp = 256 // (128 // (16 // x.element_size()))
    vals = x.to(torch.float32).tolist()
    out = []
    for c in range(cols):
        total = 0.0
        for t0 in range(0, rows, 128):
            tile = 0.0
            for i in range(rpp):
                part = 0.0
                for r in range(t0 + i, t0 + 128, rpp):
                    part = add(part, vals[r][c] if r < rows else 0.0)
                tile = add(tile, part)
            total = add(total, tile)
        out.append(total)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_column_sum_reference_follows_the_documented_order(dtype):
    g = torch.Generator().manual_seed(0)
    # magnitudes over many decades, so that the order of the adds shows in the last bits
    x = (torch.randn(300, 3, generator=g) * torch.exp2(torch.randint(-20, 20, (300, 3), generator=g).float())).to(dtype)
    got = ops.column_sum_reference(x)
    assert got.dtype == torch.float32
    assert got.tolist() == _column_sums_by_hand(x)
    # the order is not torch's: some column differs from a plain float32 sum, all are close
    assert not torch.equal(got, x.float().sum(0)) or dtype == torch.float32
    assert torch.allclose(got.double(), x.double().sum(0), rtol=1e-4, atol=0)


def test_quantize_t_record_amax_reference():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 48, generator=g).to(torch.bfloat16) * 7
    scale, pending = torch.tensor([3.0]), torch.tensor([0.5, 0.0])
    q, q_t, sums = ops.quantize_fp8_t_record_amax(x, scale, pending, 1, torch.float8_e5m2, True)
    assert torch.equal(q.view(torch.uint8), quantize_fp8_reference(x, scale, torch.float8_e5m2).view(torch.uint8))
    assert q_t.is_contiguous() and torch.equal(q_t.view(torch.uint8), q.view(torch.uint8).t())
    assert torch.equal(sums, ops.column_sum_reference(x))
    assert pending.tolist() == [0.5, x.float().abs().max().item()]
    _, _, none = ops.quantize_fp8_t_record_amax(x, scale, pending, 0, torch.float8_e5m2, False)
    assert none.shape == (0,)
    with pytest.raises(ValueError, match=r"x.dim\(\)=.* is not allowed: expected 2"):
        ops.quantize_fp8_t_record_amax(x.view(2, 100, 48), scale, pending, 0, torch.float8_e5m2, True)
    with pytest.raises(ValueError, match=r"slot=.* is not allowed: expected 0 <= slot < 2"):
        ops.quantize_fp8_t_record_amax(x, scale, pending, 2, torch.float8_e5m2, True)
    torch.library.opcheck(
        torch.ops.fp8state.quantize_fp8_t_record_amax.default,
        (x, scale, pending, 0, torch.float8_e5m2, True),
        test_utils=("test_faketensor", "test_aot_dispatch_dynamic"),
    )
