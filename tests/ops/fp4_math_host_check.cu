// Host check of the scalar FP4 rules in csrc/fp4_ops.cu (the same source,
// compiled with -DFP8STATE_FP4_MATH_ONLY), against direct definitions written here:
//   * e2m1_mag / e2m1_code: every float32 in [0, 16] and a spread of others, against
//     "count the decision thresholds 0.25 0.75 1.25 1.75 2.5 3.5 5 (ties to the even code)";
//   * the packing of biased magnitudes (kPackBias);
//   * div6: the IEEE quotient a / 6 for every mantissa at the ends and the middle of the
//     exponent range it shortcuts (scaling by 2 commutes with each of its steps in between),
//     and for random floats of every exponent; nvfp4_scale_code against its definition;
//   * e2m1_value: the 16-code table; mx_exponent / pow2_neg / e8m0_value: every exponent;
//   * order_key: orders like the values with -0 < +0 and is its own inverse.
// Built (nvcc -std=c++17 -O2 -DFP8STATE_FP4_MATH_ONLY -Xcompiler -ffp-contract=off) and run by
// tests/ops/test_fp4_math_host.py (needs nvcc, no GPU). Exit status 0 = pass.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

#include "fp4_ops.cu"  // found through -I <ops.cuda.source_dir()>

using namespace fp4math;

static unsigned ref_mag(float y) {  // |y| not NaN
  const float a = std::fabs(y);
  const float t[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const bool up_on_tie[7] = {false, true, false, true, false, true, false};
  unsigned m = 0;
  for (int i = 0; i < 7; ++i) m += up_on_tie[i] ? (a >= t[i]) : (a > t[i]);
  return m;
}

static unsigned ref_code(float y) {
  if (std::isnan(y)) return 0;
  return ref_mag(y) | (std::signbit(y) ? 8u : 0u);
}

static int failures = 0;
#define EXPECT(cond, ...)                      \
  do {                                         \
    if (!(cond) && failures++ < 20) {          \
      std::printf("FAIL %s: ", #cond);         \
      std::printf(__VA_ARGS__);                \
      std::printf("\n");                       \
    }                                          \
  } while (0)

int main() {
  // every float32 bit pattern in [2^-7, 16], both signs (below 2^-7 every code is a zero)
  for (uint32_t b = 0x3c000000u; b <= 0x41800000u; ++b) {
    const float y = u2f(b);
    const unsigned got = e2m1_code(y), want = ref_code(y);
    if (got != want) EXPECT(false, "y=%a got %u want %u", y, got, want);
    const float ny = u2f(b | 0x80000000u);
    if (e2m1_code(ny) != ref_code(ny)) EXPECT(false, "y=%a got %u want %u", ny, e2m1_code(ny), ref_code(ny));
  }
  // every other exponent (subnormals included) with random mantissas, infinities and NaNs
  std::mt19937 rng(0);
  for (uint32_t e = 0; e <= 255; ++e) {
    if (e >= 120 && e <= 130) continue;
    for (int i = 0; i < 20000; ++i) {
      const uint32_t b = (e << 23) | (rng() & 0x7fffffu) | (rng() & 0x80000000u);
      const float y = u2f(b);
      if (e2m1_code(y) != ref_code(y)) EXPECT(false, "y=%a got %u want %u", y, e2m1_code(y), ref_code(y));
    }
  }
  EXPECT(e2m1_code(INFINITY) == 7 && e2m1_code(-INFINITY) == 15, "inf");
  EXPECT(e2m1_code(u2f(0x7fc00000u)) == 0 && e2m1_code(u2f(0xffc00001u)) == 0, "nan");
  EXPECT(e2m1_code(-0.0f) == 8 && e2m1_code(0.0f) == 0, "zero");

  for (int i = 0; i < 100000; ++i) {  // packing biased magnitudes by addition
    uint32_t w = 0u - kPackBias, want = 0;
    for (int j = 0; j < 8; ++j) {
      const float y = u2f(rng() & 0x7fffffffu) ;
      const uint32_t m = std::isnan(y) ? 0u : e2m1_mag(y);
      w += (m + kMagicBits) << (4 * j);
      want |= m << (4 * j);
    }
    EXPECT(w == want, "pack %08x != %08x", w, want);
  }

  // div6: every mantissa of exponents at both ends and in the middle of its shortcut range
  for (int e : {-121, -120, -119, -60, -2, -1, 0, 1, 2, 60, 119, 120, 121}) {
    for (uint32_t m = 0; m < (1u << 23); ++m) {
      const float a = std::ldexp(1.0f + std::ldexp(float(m), -23), e);
      const float want = a / 6.0f;
      if (f2u(div6(a)) != f2u(want)) EXPECT(false, "div6(%a) = %a want %a", a, div6(a), want);
    }
  }
  for (int i = 0; i < 4000000; ++i) {
    const float a = u2f(rng() & 0x7fffffffu);
    const float want = a / 6.0f;
    if (f2u(div6(a)) != f2u(want) && !(std::isnan(want) && std::isnan(div6(a))))
      EXPECT(false, "div6(%a) = %a want %a", a, div6(a), want);
  }
  for (int i = 0; i < 2000000; ++i) {  // the NVFP4 block-scale rule
    const float a = i % 7 == 0 ? u2f(0x7fc00000u) : u2f(rng() & 0x7fffffffu) * (i % 3 ? 1e-30f : 1.0f);
    const float s = i % 11 == 0 ? -1.5f : i % 13 == 0 ? 0.0f : i % 17 == 0 ? INFINITY : u2f(rng() & 0x7fffffffu);
    const float v = (a / 6.0f) * s;
    unsigned want = std::isnan(v) ? 0x7fu : !(v > 0) ? 0u : __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
    EXPECT(nvfp4_scale_code(a, s) == want, "scale code a=%a s=%a: %u want %u", a, s, nvfp4_scale_code(a, s), want);
  }
  EXPECT(nvfp4_scale_code(6.0f, 1.0f) == 0x38 && nvfp4_scale_code(6.0f * 448 * 4, 1.0f) == 0x7e &&
             nvfp4_scale_code(0.0f, 1.0f) == 0 && nvfp4_scale_code(1.0f, -0.0f) == 0 &&
             nvfp4_scale_code(INFINITY, 0.0f) == 0x7f,
         "scale code specials");

  const float table[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (unsigned c = 0; c < 16; ++c) {
    const float v = e2m1_value(c), want = (c & 8) ? -table[c & 7] : table[c & 7];
    EXPECT(f2u(v) == f2u(want), "code %u: %a != %a", c, v, want);
    EXPECT(e2m1_code(v) == c, "round trip %u", c);
  }

  for (int X = -127; X <= 127; ++X) {
    EXPECT(pow2_neg(X) == std::ldexp(1.0f, -X), "pow2_neg(%d)", X);
    EXPECT(e8m0_value(uint32_t(X + 127)) == std::ldexp(1.0f, X), "e8m0(%d)", X);
  }
  EXPECT(std::isnan(e8m0_value(255)), "e8m0 NaN");
  for (uint32_t b = 0; b < 0x7f800000u; b += 997) {  // positive finite floats
    const float A = u2f(b);
    int want = -127;
    if (A > 0) {
      int e;
      std::frexp(static_cast<double>(A), &e);  // exact in double, subnormals included
      want = std::max(-127, std::min(127, e - 1 - 2));
    }
    EXPECT(mx_exponent(A) == want, "mx_exponent(%a) = %d want %d", A, mx_exponent(A), want);
  }
  EXPECT(mx_exponent(INFINITY) == 127 && mx_exponent(0.0f) == -127 && mx_exponent(6.0f) == 0 &&
             mx_exponent(7.99f) == 0 && mx_exponent(8.0f) == 1,
         "mx_exponent specials");

  std::uniform_int_distribution<uint32_t> any;
  for (int i = 0; i < 2000000; ++i) {
    uint32_t a = any(rng), b = any(rng);
    if (i % 4 == 0) b = a ^ 0x80000000u;  // same magnitude, other sign (zeros included below)
    if (i % 1000 == 0) a = 0, b = 0x80000000u;
    const float fa = u2f(a), fb = u2f(b);
    if (std::isnan(fa) || std::isnan(fb)) continue;
    const bool less = fa < fb || (fa == 0 && fb == 0 && std::signbit(fa) && !std::signbit(fb));
    EXPECT((order_key(a) < order_key(b)) == less, "order %a %a", fa, fb);
    EXPECT(uint32_t(order_key(uint32_t(order_key(a)))) == a, "involution %08x", a);
  }
  EXPECT(order_key(f2u(INFINITY)) == kKeyPosInf && order_key(f2u(-INFINITY)) == kKeyNegInf, "inf keys");
  EXPECT(order_key(0x7f800001u) > kKeyPosInf && order_key(0xff800001u) < kKeyNegInf, "nan keys");

  std::printf(failures ? "%d failures\n" : "all host checks passed\n", failures);
  return failures ? 1 : 0;
}
