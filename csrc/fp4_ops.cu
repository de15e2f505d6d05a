// CUDA kernels for the packed-FP4 fp8state ops. Schemas are defined in Python
// (lightning_fp8state/ops/library_fp4.py); this file only adds CUDA implementations, built
// into the same extension as fp8state_ops.cu. Every kernel is bit-identical to the pure-torch
// reference in ops/reference_fp4.py, which follows the FP4 invariants in formats.py:
//   NVFP4: a = max|x| per 16-element block, v = (a / 6) * S, sb = E4M3(v) for v > 0 (RNE,
//          saturating), +0 for v <= 0, 0x7F for NaN; enc = S / sb (0 when sb == 0);
//          codes = E2M1(x * enc).
//   MXFP4: u = x * S, A = max|u| per 32-element block, X = floor(log2 A) - 2 clamped to
//          [-127, 127] (A == 0 -> -127, inf -> 127), E8M0 code X + 127 (NaN -> 0xFF and
//          codes 0); codes = E2M1(u * 2^-X).
//   E2M1:  nearest, ties to the even code, saturating at 6, sign kept, NaN -> code 0.
//   decode: float32(float32(e * sb) * D) (+ center), one rounding to the output dtype,
//          NaN -> the dtype's canonical quiet NaN.
//   record: max|x (- center)| folded into the owner's pending slot (one atomicMax per CTA on
//          the float bits; the canonical NaN 0x7FC00000 orders above +inf); per-channel
//          max/min of x folded into row `slot` of center_max/center_min, ordering -0 < +0, a
//          NaN anywhere giving the canonical NaN.
// Every float32 operation is a single IEEE operation (the __f*_rn intrinsics: no FMA
// contraction), denormals are kept (no -ftz), every launch runs on the current stream and no
// wrapper synchronizes the host.
//
// Compiled with -DFP8STATE_FP4_MATH_ONLY, only the scalar rules (host and device) below are
// kept: tests/ops/fp4_math_host_check.cu checks them exhaustively on the host.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>

#include "fp8state_common.cuh"  // fmax_nan, the CTA amax fold (shared with fp8state_ops.cu)

#define FP4_HD __host__ __device__ __forceinline__

namespace fp4math {

using fp8state_common::fmax_nan;

FP4_HD uint32_t f2u(float v) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(v);
#else
  uint32_t u;
  __builtin_memcpy(&u, &v, 4);
  return u;
#endif
}

FP4_HD float u2f(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float v;
  __builtin_memcpy(&v, &u, 4);
  return v;
#endif
}

// Single IEEE float32 operations, never contracted into an FMA.
FP4_HD float mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;  // host checks build with -ffp-contract=off
#endif
}
FP4_HD float add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;  // host checks build with -ffp-contract=off
#endif
}
FP4_HD float sub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;  // host checks build with -ffp-contract=off
#endif
}
FP4_HD float div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;  // host checks build with -ffp-contract=off
#endif
}

FP4_HD bool is_nan(float v) { return (f2u(v) & 0x7fffffffu) > 0x7f800000u; }

FP4_HD float fma_rn(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// E2M1 magnitude code (0..7) of |y| plus kMagicBits, y not NaN: round to nearest, ties to
// the even code, saturating at 6. E2M1's grid has steps of 0.5 on [0, 2], 1 on [2, 4] and 2
// on [4, 6]; each candidate rounds |y| once (one FMA into [2^23, 2^24), where float32's ulp
// is 1, so the FMA itself rounds to nearest even on the integers) on one of those grids:
//   c0 = RN(2|y|)      (the code itself on [0, 2]),
//   c1 = RN(|y|) + 2   (the code on [2, 4]),
//   c2 = RN(|y|/2) + 4 (the code on [4, 6]; 7 caps larger values),
// each as the bit pattern of M + c with M = 1.5 * 2^23, and min(c0, c1, c2, 7) is the code
// (each candidate overestimates it outside its range; the bit patterns of floats of one
// binade order like the integers, and larger |y| only give larger patterns).
constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
constexpr uint32_t kMagicBits = 0x4b400000u;
FP4_HD uint32_t e2m1_mag_biased(float y) {
  const float a = fabsf(y);
  const int c0 = static_cast<int>(f2u(fma_rn(a, 2.0f, kMagic)));
  const int c1 = static_cast<int>(f2u(fma_rn(a, 1.0f, kMagic + 2.0f)));
  const int c2 = static_cast<int>(f2u(fma_rn(a, 0.5f, kMagic + 4.0f)));
  return static_cast<uint32_t>(__vimin3_s32(c0, c1, min(c2, static_cast<int>(kMagicBits) + 7)));
}

FP4_HD uint32_t e2m1_mag(float y) { return e2m1_mag_biased(y) - kMagicBits; }

// Eight biased magnitudes packed by plain addition, (m_j + kMagicBits) << 4j summed over j,
// carry the constant sum of kMagicBits << 4j (mod 2^32), taken off once per word.
constexpr uint32_t kPackBias = kMagicBits + (kMagicBits << 4) + (kMagicBits << 8) + (kMagicBits << 12) +
                               (kMagicBits << 16) + (kMagicBits << 20) + (kMagicBits << 24) + (kMagicBits << 28);

// The full 4-bit code (sign in bit 3), NaN -> 0.
FP4_HD uint32_t e2m1_code(float y) {
  if (is_nan(y)) return 0;
  return e2m1_mag(y) | ((f2u(y) >> 28) & 8u);
}

// Exact value of a 4-bit code: (mag << 22) is the float32 subnormal mag * 2^-127, i.e. the
// E2M1 value times 2^-126 (E2M1's exponent bias 1 against float32's subnormal exponent).
FP4_HD float e2m1_value(uint32_t nib) {
  return mul(u2f(((nib & 7u) << 22) | ((nib & 8u) << 28)), 0x1p126f);
}

// The IEEE quotient a / 6 for a >= 0 (or NaN). In the normal range, Markstein's correction of
// q0 = a * RN(1/6) with the exact remainder a - 6 q0 (one FMA) is the correctly rounded
// quotient (checked on the host for every mantissa, which suffices: scaling by a power of two
// commutes with every step there); elsewhere (0, subnormal, huge, inf, NaN) a true division.
FP4_HD float div6(float a) {
  if (f2u(a) - 0x03800000u < 0x7c000000u - 0x03800000u) {  // 2^-120 <= a < 2^121
    const float r = 0x1.555556p-3f;                          // RN(1/6)
    const float q0 = mul(a, r);
    return fma_rn(fma_rn(-6.0f, q0, a), r, q0);
  }
  return div(a, 6.0f);
}

// NVFP4 block scale code from the block amax a (>= 0 or NaN) and the tensor scale s:
// E4M3(v) for v > 0 (nearest even; the satfinite conversion saturates v > 448, +inf
// included, to 448), 0 for v <= 0, 0x7F for NaN. max(v, 0) keeps NaN and turns every v <= 0
// into a zero, whose code (0x00 or, for -0, 0x80) the mask clears like a NaN's sign.
FP4_HD uint32_t nvfp4_scale_code(float a, float s) {
  const float v = fmax_nan(mul(div6(a), s), 0.0f);
  return static_cast<uint32_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)) & 0x7fu;
}

// Exact float32 value of an E4M3 code (0x7F / 0xFF -> NaN).
FP4_HD float e4m3_value(uint32_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(__half(h));
}

// MXFP4 block exponent X of a non-NaN block amax A = max|x * S|.
FP4_HD int mx_exponent(float A) {
  if (A == INFINITY) return 127;
  const int field = static_cast<int>((f2u(A) >> 23) & 0xffu);  // 0 for zero and subnormals
  return max(-127, min(127, field - 127 - 2));
}

// 2^-X for X in [-127, 127] (2^-127 is the float32 subnormal 0x00400000).
FP4_HD float pow2_neg(int X) {
  return X == 127 ? u2f(0x00400000u) : u2f(static_cast<uint32_t>(127 - X) << 23);
}

// Exact float32 value of an E8M0 code: 2^(c - 127), 0xFF -> NaN.
FP4_HD float e8m0_value(uint32_t code) {
  if (code == 0xffu) return u2f(0x7fc00000u);
  return code == 0 ? u2f(0x00400000u) : u2f(code << 23);
}

// int32 keys ordering float32 bit patterns like their values with -0 < +0 (the map is its
// own inverse). A positive NaN's key is above +inf's, a negative NaN's below -inf's.
FP4_HD int32_t order_key(uint32_t b) {
  return static_cast<int32_t>(b ^ (static_cast<uint32_t>(static_cast<int32_t>(b) >> 31) & 0x7fffffffu));
}
constexpr int32_t kKeyPosInf = 0x7f800000;                       // order_key(+inf)
constexpr int32_t kKeyNegInf = static_cast<int32_t>(0x807fffffu);  // order_key(-inf)

}  // namespace fp4math

#ifndef FP8STATE_FP4_MATH_ONLY

// =======================================================================================
// The kernels and their launch plans (no torch: tests/ops/fp4_emulate.cpp runs this part
// on the host, one thread per CUDA thread, against the reference)
// =======================================================================================
#include <algorithm>
#include <climits>
#include <type_traits>

namespace fp4kernels {

using namespace fp4math;

using fp8state_common::block_fold_amax;
using fp8state_common::kCanonicalNanF32;
using fp8state_common::warp_max_nan;

constexpr int kThreads = 256;
constexpr int kQChunk = 16;  // elements of one row a quantize thread handles per step
constexpr int kDChunk = 8;   // elements of one row a dequantize thread handles per step

// ---------------------------------------------------------------------------------------
// device helpers
// ---------------------------------------------------------------------------------------
// Folds a CTA's per-channel key (max or min of x over its rows) into one float of
// center_max / center_min: the -0 < +0 max/min of the stored value and the key's value, or
// the canonical NaN if either is NaN. With `atomic` (several CTAs fold the same channel) a
// compare-and-swap loop; it reads first and writes only if the value changes (the stored
// value only moves towards the extreme, so a stale read never skips a needed write).
template <bool MAX>
__device__ __forceinline__ void fold_stat(float* ptr, int32_t key, bool nan, bool atomic) {
  auto combine = [&](uint32_t old) -> uint32_t {
    if (nan || is_nan(__uint_as_float(old))) return kCanonicalNanF32;
    const int32_t ko = order_key(old);
    return static_cast<uint32_t>(order_key(static_cast<uint32_t>(MAX ? max(ko, key) : min(ko, key))));
  };
  unsigned int* p = reinterpret_cast<unsigned int*>(ptr);
  if (!atomic) {
    *p = combine(*p);
    return;
  }
  unsigned int old = *reinterpret_cast<volatile unsigned int*>(p);
  while (true) {
    const unsigned int next = combine(old);
    if (next == old) return;
    const unsigned int prev = atomicCAS(p, old, next);
    if (prev == old) return;
    old = prev;
  }
}

// Packs 8 E2M1 codes (y[0] in the low nibble); no y may be NaN. The magnitudes are added in
// place; the 8 sign bits are gathered with byte permutes from the floats' top bytes:
// even elements' signs go to bit 3 of each byte, odd elements' to bit 7.
__device__ __forceinline__ uint32_t pack8_fast(const float* y) {
  uint32_t w = 0u - kPackBias;  // magnitudes <= 7 never carry into the next nibble
#pragma unroll
  for (int j = 0; j < 8; ++j) w += e2m1_mag_biased(y[j]) << (4 * j);
  const uint32_t u0 = __float_as_uint(y[0]), u1 = __float_as_uint(y[1]), u2 = __float_as_uint(y[2]),
                 u3 = __float_as_uint(y[3]), u4 = __float_as_uint(y[4]), u5 = __float_as_uint(y[5]),
                 u6 = __float_as_uint(y[6]), u7 = __float_as_uint(y[7]);
  const uint32_t even = __byte_perm(__byte_perm(u0, u2, 0x0073), __byte_perm(u4, u6, 0x7300), 0x7610);
  const uint32_t odd = __byte_perm(__byte_perm(u1, u3, 0x0073), __byte_perm(u5, u7, 0x7300), 0x7610);
  return w | ((even >> 4) & 0x08080808u) | (odd & 0x80808080u);
}

// Element by element, NaN -> code 0 (blocks that may produce a NaN y: rare).
__device__ __forceinline__ uint32_t pack8_slow(const float* y) {
  uint32_t w = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) w |= e2m1_code(y[j]) << (4 * j);
  return w;
}

// ---------------------------------------------------------------------------------------
// input types: 16 elements of a row = G16 16-byte words
// ---------------------------------------------------------------------------------------
template <typename T>
struct In;

template <>
struct In<__nv_bfloat16> {
  static constexpr int kWords = 2;  // uint4 per 16 elements
  static __device__ __forceinline__ void to_float(const uint4* r, float* f) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t w[4] = {r[i].x, r[i].y, r[i].z, r[i].w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        f[8 * i + 2 * k] = __uint_as_float(w[k] << 16);
        f[8 * i + 2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
      }
    }
  }
  // max|x| over the 16 elements with packed NaN-propagating max/min (exact: the result is
  // one of the inputs' magnitudes).
  static __device__ __forceinline__ float absmax(const uint4* r) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(r);
    const __nv_bfloat162 hi = __hmax2_nan(__hmax2_nan(__hmax2_nan(h[0], h[1]), __hmax2_nan(h[2], h[3])),
                               __hmax2_nan(__hmax2_nan(h[4], h[5]), __hmax2_nan(h[6], h[7])));
    const __nv_bfloat162 lo = __hmin2_nan(__hmin2_nan(__hmin2_nan(h[0], h[1]), __hmin2_nan(h[2], h[3])),
                               __hmin2_nan(__hmin2_nan(h[4], h[5]), __hmin2_nan(h[6], h[7])));
    const __nv_bfloat162 m = __hmax2_nan(hi, __hneg2(lo));  // max|x| = max(max x, -min x), NaN sticks
    return fabsf(fmax_nan(__low2float(m), __high2float(m)));  // fabsf: never -0
  }

};

template <>
struct In<__half> {
  static constexpr int kWords = 2;
  static __device__ __forceinline__ void to_float(const uint4* r, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(r);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float2 v = __half22float2(h[k]);
      f[2 * k] = v.x;
      f[2 * k + 1] = v.y;
    }
  }
  static __device__ __forceinline__ float absmax(const uint4* r) {
    const __half2* h = reinterpret_cast<const __half2*>(r);
    const __half2 hi = __hmax2_nan(__hmax2_nan(__hmax2_nan(h[0], h[1]), __hmax2_nan(h[2], h[3])),
                               __hmax2_nan(__hmax2_nan(h[4], h[5]), __hmax2_nan(h[6], h[7])));
    const __half2 lo = __hmin2_nan(__hmin2_nan(__hmin2_nan(h[0], h[1]), __hmin2_nan(h[2], h[3])),
                               __hmin2_nan(__hmin2_nan(h[4], h[5]), __hmin2_nan(h[6], h[7])));
    const __half2 m = __hmax2_nan(hi, __hneg2(lo));  // max|x| = max(max x, -min x), NaN sticks
    return fabsf(fmax_nan(__low2float(m), __high2float(m)));  // fabsf: never -0
  }

};

template <>
struct In<float> {
  static constexpr int kWords = 4;
  static __device__ __forceinline__ void to_float(const uint4* r, float* f) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[4 * i] = __uint_as_float(r[i].x);
      f[4 * i + 1] = __uint_as_float(r[i].y);
      f[4 * i + 2] = __uint_as_float(r[i].z);
      f[4 * i + 3] = __uint_as_float(r[i].w);
    }
  }
  static __device__ __forceinline__ float absmax(const uint4* r) {
    float f[16];
    to_float(r, f);
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) m = fmax_nan(m, fabsf(f[j]));
    return m;
  }
};

// ---------------------------------------------------------------------------------------
// quantize: a CTA is a tile of (tc column chunks of 16 elements) x (tr row lanes); CTAs along
// y take every rstride-th row. A thread keeps its columns for all its rows, so its slice of
// the center is loaded once and its per-channel statistics stay in registers until one fold
// per CTA. NVFP4: one thread per 16-element block; MXFP4: two neighbouring lanes per
// 32-element block, combining their amax with one shuffle.
// ---------------------------------------------------------------------------------------
struct QuantizeParams {
  const void* x;
  uint8_t* packed;
  uint8_t* scales;
  const float* scale;
  const float* center;  // [K] or null
  float* amax_slot;     // or null
  float* cmax;          // &center_max[slot][0] or null
  float* cmin;
  int64_t cmax_stride;  // stride between channels of center_max
  int64_t cmin_stride;
  int64_t rows;
  int64_t k;   // elements per row
  int64_t nc;  // 16-element column chunks per row
  int64_t rstride;
  int tc;  // column chunks per CTA
  int tr;  // row lanes per CTA
  bool atomic_stats;
};

// 16-bit order keys of two bf16 / fp16 bit patterns packed in a word (sign-magnitude to two's
// complement per half: the same map as order_key, on 16 bits), for SIMD max/min.
__device__ __forceinline__ uint32_t order_key16x2(uint32_t w) { return w ^ (((w >> 15) & 0x00010001u) * 0x7fffu); }

// 16-bit keys of +inf and -inf (sign-extended): a key above the first or below the second
// is a NaN's. The NaN check happens on these keys, before any conversion: converting a
// negative fp16 NaN to float32 need not keep its sign, and the check must not depend on it.
template <typename T>
constexpr int32_t key16_pos_inf() {
  return std::is_same_v<T, __nv_bfloat16> ? 0x7f80 : 0x7c00;
}
template <typename T>
constexpr int32_t key16_neg_inf() {
  return std::is_same_v<T, __nv_bfloat16> ? int32_t(0x807f) - 0x10000 : int32_t(0x83ff) - 0x10000;
}

// The float32 order key of the 16-bit type's value whose 16-bit key is k (sign-extended;
// not a NaN's).
template <typename T>
__device__ __forceinline__ int32_t key32_of_key16(int32_t k) {
  const uint32_t b = static_cast<uint32_t>(k ^ (k < 0 ? 0x7fff : 0)) & 0xffffu;
  float f;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    f = __uint_as_float(b << 16);
  } else {
    __half_raw h;
    h.x = static_cast<unsigned short>(b);
    f = __half2float(__half(h));
  }
  return order_key(__float_as_uint(f));
}

// Rows a quantize thread processes per step (and loads ahead: the next step's rows are
// loaded before this step's are processed).
template <typename T, bool STATS>
constexpr int rows_per_step() {
  return STATS || sizeof(T) == 4 ? 1 : 2;
}

template <typename T, bool MX, bool CENTER, bool RECORD, bool STATS>
__global__ void __launch_bounds__(kThreads) quantize_fp4_kernel(const QuantizeParams p) {
  constexpr int W = In<T>::kWords;
  constexpr int U = rows_per_step<T, STATS>();
  // bf16 / fp16 statistics: 16-bit order keys, two per register (SIMD max / min).
  constexpr bool kPacked = STATS && sizeof(T) == 2;
  constexpr int kStatRegs = !STATS ? 1 : kPacked ? kQChunk / 2 : kQChunk;
  const float S = *p.scale;

  __shared__ float s_enc[MX ? 1 : 128];  // NVFP4: enc = S / sb for every E4M3 code 0..127
  if constexpr (!MX) {
    if (threadIdx.x < 128) {
      const float sb = e4m3_value(threadIdx.x);
      s_enc[threadIdx.x] = sb == 0.0f ? 0.0f : div(S, sb);
    }
    __syncthreads();
  }

  const uint32_t enc_base = static_cast<uint32_t>(__cvta_generic_to_shared(s_enc));
  const int tc = threadIdx.x % p.tc, tr = threadIdx.x / p.tc;
  const int64_t cc = int64_t(blockIdx.x) * p.tc + tc;
  const bool active = tr < p.tr && cc < p.nc;
  const int64_t col0 = cc * kQChunk;

  float c[CENTER ? kQChunk : 1];
  if constexpr (CENTER) {
    if (active) {
      const float4* cv = reinterpret_cast<const float4*>(p.center + col0);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 v = cv[i];
        c[4 * i] = v.x;
        c[4 * i + 1] = v.y;
        c[4 * i + 2] = v.z;
        c[4 * i + 3] = v.w;
      }
    }
  }
  // Per-channel statistics: float32 order keys, or (kPacked) 16-bit keys two per word.
  int32_t kmax[kStatRegs], kmin[kStatRegs];
  if constexpr (STATS) {
#pragma unroll
    for (int j = 0; j < kStatRegs; ++j) {
      kmax[j] = kPacked ? int32_t(0x80008000u) : INT_MIN;
      kmin[j] = kPacked ? 0x7fff7fff : INT_MAX;
    }
  }
  float amax = 0.0f;
  const bool s_inf = isinf(S);
  const unsigned int pair_mask = 3u << ((threadIdx.x & 31) & ~1u);

  if (active) {
    // Pointers to this thread's first row, advanced by whole row strides (no per-row
    // 64-bit index arithmetic): 16 elements of x (W 16-byte words), 8 packed bytes, and
    // the block's scale byte.
    const int64_t r_first = int64_t(blockIdx.y) * p.tr + tr;
    const int64_t e_first = r_first * p.k + col0;
    const int64_t row_blocks = p.k / (MX ? 32 : 16);
    const uint4* xp = reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + e_first);
    uint2* op = reinterpret_cast<uint2*>(p.packed) + e_first / 16;
    uint8_t* sp = p.scales + r_first * row_blocks + col0 / (MX ? 32 : 16);
    const int64_t x_step = p.rstride * p.k / (16 / int64_t(sizeof(T)));  // in uint4
    const int64_t o_step = p.rstride * p.k / 16;                          // in uint2
    const int64_t s_step = p.rstride * row_blocks;                        // in bytes
    // Software pipelining: the loads of the next step's rows are in flight while this step's
    // rows are converted, packed and stored (the H200 measurements: docs/PERFORMANCE.md).
    uint4 raw[U][W], next[U][W];
    auto load_rows = [&](uint4 (*dst)[W], int64_t r, const uint4* src) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (r + u * p.rstride < p.rows) {
#pragma unroll
          for (int i = 0; i < W; ++i) dst[u][i] = __ldcs(src + u * x_step + i);
        }
      }
    };
    load_rows(raw, r_first, xp);
    for (int64_t r0 = r_first; r0 < p.rows;
         r0 += p.rstride * U, xp += x_step * U, op += o_step * U, sp += s_step * U) {
      load_rows(next, r0 + p.rstride * U, xp + x_step * U);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (r0 + u * p.rstride >= p.rows) break;
        float f[kQChunk];
        In<T>::to_float(raw[u], f);
        if constexpr (kPacked) {
          const uint32_t* w = reinterpret_cast<const uint32_t*>(raw[u]);
#pragma unroll
          for (int j = 0; j < kStatRegs; ++j) {
            const uint32_t key = order_key16x2(w[j]);
            kmax[j] = static_cast<int32_t>(__vmaxs2(static_cast<uint32_t>(kmax[j]), key));
            kmin[j] = static_cast<int32_t>(__vmins2(static_cast<uint32_t>(kmin[j]), key));
          }
        } else if constexpr (STATS) {
#pragma unroll
          for (int j = 0; j < kQChunk; ++j) {
            const int32_t key = order_key(__float_as_uint(f[j]));
            kmax[j] = max(kmax[j], key);
            kmin[j] = min(kmin[j], key);
          }
        }
        float a;  // max|x - center| over this thread's 16 elements
        if constexpr (CENTER) {
          a = 0.0f;
#pragma unroll
          for (int j = 0; j < kQChunk; ++j) {
            f[j] = sub(f[j], c[j]);
            a = fmax_nan(a, fabsf(f[j]));
          }
        } else {
          a = In<T>::absmax(raw[u]);
        }
        uint2 words;
        uint32_t code;
        if constexpr (!MX) {
          code = nvfp4_scale_code(a, S);
          float enc;  // s_enc[code]
#ifdef __CUDA_ARCH__
          asm("ld.shared.f32 %0, [%1];" : "=f"(enc) : "r"(enc_base + (code << 2)));
#else
          enc = s_enc[code + 0 * enc_base];
#endif
          // A NaN y (x NaN, x = inf with enc = 0, x = 0 with enc = inf) only in these blocks.
          const bool slow = !(enc < INFINITY) || (enc == 0.0f && a == INFINITY);
#pragma unroll
          for (int j = 0; j < kQChunk; ++j) f[j] = mul(f[j], enc);
          if (!slow) {
            words = make_uint2(pack8_fast(f), pack8_fast(f + 8));
          } else {
            words = make_uint2(pack8_slow(f), pack8_slow(f + 8));
          }
        } else {
          a = fmax_nan(a, __shfl_xor_sync(pair_mask, a, 1));  // the block's max|x - center|
          float A;                                          // max|u|, u = (x - center) * S
          if (!s_inf) {
            A = mul(a, fabsf(S));  // rounding is monotonic, and no 0 * inf can occur
          } else {
            A = 0.0f;
#pragma unroll
            for (int j = 0; j < kQChunk; ++j) A = fmax_nan(A, fabsf(mul(f[j], S)));
            A = fmax_nan(A, __shfl_xor_sync(pair_mask, A, 1));
          }
          if (is_nan(A)) {
            code = 0xffu;
            words = make_uint2(0u, 0u);
          } else {
            const int X = mx_exponent(A);
            code = static_cast<uint32_t>(X + 127);
            const float p2 = pow2_neg(X);
#pragma unroll
            for (int j = 0; j < kQChunk; ++j) f[j] = mul(mul(f[j], S), p2);
            words = make_uint2(pack8_fast(f), pack8_fast(f + 8));
          }
        }
        __stcs(op + u * o_step, words);
        if (!MX || (tc & 1) == 0) sp[u * s_step] = static_cast<uint8_t>(code);
        if constexpr (RECORD) amax = fmax_nan(amax, a);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int i = 0; i < W; ++i) raw[u][i] = next[u][i];
      }
    }
  }

  if constexpr (RECORD) block_fold_amax<kThreads>(amax, p.amax_slot);

  if constexpr (STATS) {
    // Reduce over the CTA's row lanes through shared memory, then fold each channel once.
    __shared__ int32_t s_kmax[kThreads * kQChunk], s_kmin[kThreads * kQChunk];
    const int width = p.tc * kQChunk;
    if (tr < p.tr) {
#pragma unroll
      for (int j = 0; j < kQChunk; ++j) {
        if constexpr (kPacked) {  // the 16-bit key of element j (half j & 1), sign-extended
          const int sh = 16 * (j & 1);
          s_kmax[tr * width + tc * kQChunk + j] = static_cast<int16_t>(static_cast<uint32_t>(kmax[j / 2]) >> sh);
          s_kmin[tr * width + tc * kQChunk + j] = static_cast<int16_t>(static_cast<uint32_t>(kmin[j / 2]) >> sh);
        } else {
          s_kmax[tr * width + tc * kQChunk + j] = kmax[j];
          s_kmin[tr * width + tc * kQChunk + j] = kmin[j];
        }
      }
    }
    __syncthreads();
    for (int ch = threadIdx.x; ch < width; ch += kThreads) {
      const int64_t channel = int64_t(blockIdx.x) * width + ch;
      if (channel >= p.k) continue;
      int32_t hi = INT_MIN, lo = INT_MAX;
      for (int t = 0; t < p.tr; ++t) {
        hi = max(hi, s_kmax[t * width + ch]);
        lo = min(lo, s_kmin[t * width + ch]);
      }
      if (lo > hi) continue;  // no row of this CTA reached the channel
      bool nan;
      if constexpr (kPacked) {
        nan = hi > key16_pos_inf<T>() || lo < key16_neg_inf<T>();
        hi = key32_of_key16<T>(hi);  // only used when no NaN was seen
        lo = key32_of_key16<T>(lo);
      } else {
        nan = hi > kKeyPosInf || lo < kKeyNegInf;
      }
      fold_stat<true>(p.cmax + channel * p.cmax_stride, hi, nan, p.atomic_stats);
      fold_stat<false>(p.cmin + channel * p.cmin_stride, lo, nan, p.atomic_stats);
    }
  }
}

// Column chunks x row lanes of a 256-thread CTA: up to 8 row lanes (so that a CTA spans at
// least 32 chunks of a row, 512 contiguous bytes of bf16, when the rows are long enough); a
// short last dimension packs more rows into the CTA instead.
struct Tile {
  int tc, tr;
};

Tile tile_for(int64_t rows, int64_t nc) {
  const int rlanes = rows >= 8 ? 8 : rows >= 4 ? 4 : rows >= 2 ? 2 : 1;
  const int tc = int(std::min<int64_t>(nc, kThreads / rlanes));
  return {tc, kThreads / tc};
}

// Grid for `rows` x `nc` column chunks: tiles of tile_for, and along y as many row groups as
// fill the device (`resident` CTAs at once) with at least `unroll` rows per thread.
struct Plan {
  dim3 grid;
  int tc, tr;
  int64_t rstride;
};

inline Plan plan_for(int64_t rows, int64_t nc, int resident, int unroll) {
  const Tile t = tile_for(rows, nc);
  const int64_t gx = (nc + t.tc - 1) / t.tc;
  const int64_t rows_per_cta = int64_t(t.tr) * unroll;
  int64_t gy = std::min<int64_t>((rows + rows_per_cta - 1) / rows_per_cta, std::max<int64_t>(1, resident / gx));
  gy = std::max<int64_t>(1, std::min<int64_t>(gy, 65535));
  return {dim3(unsigned(gx), unsigned(gy)), t.tc, t.tr, gy * t.tr};
}

// A Launcher provides `template <auto Kernel> int resident()` (CTAs of that kernel resident
// on the whole device) and `template <auto Kernel, class P> void launch(dim3 grid, const P&)`.
template <typename T, bool MX, bool CENTER, bool RECORD, bool STATS, typename L>
void launch_quantize_t(QuantizeParams p, L& launcher) {
  constexpr auto kernel = quantize_fp4_kernel<T, MX, CENTER, RECORD, STATS>;
  const Plan plan = plan_for(p.rows, p.nc, launcher.template resident<kernel>(), rows_per_step<T, STATS>());
  p.tc = plan.tc;
  p.tr = plan.tr;
  p.rstride = plan.rstride;
  p.atomic_stats = plan.grid.y > 1;
  launcher.template launch<kernel>(plan.grid, p);
}

template <typename T, bool MX, typename L>
void launch_quantize_flags(const QuantizeParams& p, bool center, bool record, bool stats, L& launcher) {
  // (centered record without statistics has no schema)
  if (stats)
    launch_quantize_t<T, MX, true, true, true>(p, launcher);
  else if (center)
    launch_quantize_t<T, MX, true, false, false>(p, launcher);
  else if (record)
    launch_quantize_t<T, MX, false, true, false>(p, launcher);
  else
    launch_quantize_t<T, MX, false, false, false>(p, launcher);
}

enum class InType { kF32, kBF16, kF16 };

// Quantizes a contiguous, 16-byte aligned x of `rows` x `k` (p.x ... p.cmin_stride set;
// center 16-byte aligned or null; cmax/cmin null unless recording statistics).
template <typename L>
void run_quantize(QuantizeParams p, InType type, bool mx, L& launcher) {
  p.nc = p.k / kQChunk;
  const bool center = p.center != nullptr, record = p.amax_slot != nullptr, stats = p.cmax != nullptr;
  switch (type) {
    case InType::kF32:
      mx ? launch_quantize_flags<float, true>(p, center, record, stats, launcher)
         : launch_quantize_flags<float, false>(p, center, record, stats, launcher);
      break;
    case InType::kBF16:
      mx ? launch_quantize_flags<__nv_bfloat16, true>(p, center, record, stats, launcher)
         : launch_quantize_flags<__nv_bfloat16, false>(p, center, record, stats, launcher);
      break;
    default:
      mx ? launch_quantize_flags<__half, true>(p, center, record, stats, launcher)
         : launch_quantize_flags<__half, false>(p, center, record, stats, launcher);
      break;
  }
}

// ---------------------------------------------------------------------------------------
// dequantize: the same tiling, 8 elements (4 packed bytes) per thread and row
// ---------------------------------------------------------------------------------------
template <typename T>
struct Out;  // bf16 / fp16 pairs; float32 outputs are stored directly

template <>
struct Out<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pair(float a, float b, bool check_nan) {
    if (check_nan) {
      const uint32_t lo = is_nan(a) ? 0x7fc0u : __bfloat16_as_ushort(__float2bfloat16_rn(a));
      const uint32_t hi = is_nan(b) ? 0x7fc0u : __bfloat16_as_ushort(__float2bfloat16_rn(b));
      return lo | (hi << 16);
    }
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
};

template <>
struct Out<__half> {
  static __device__ __forceinline__ uint32_t pair(float a, float b, bool check_nan) {
    if (check_nan) {
      const uint32_t lo = is_nan(a) ? 0x7e00u : __half_as_ushort(__float2half_rn(a));
      const uint32_t hi = is_nan(b) ? 0x7e00u : __half_as_ushort(__float2half_rn(b));
      return lo | (hi << 16);
    }
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
};

struct DequantizeParams {
  const uint8_t* packed;
  const uint8_t* scales;
  const float* descale;
  const float* center;
  void* out;
  int64_t rows, k, nc, rstride;
  int tc, tr;
};

template <typename T, bool MX, bool CENTER>
__global__ void __launch_bounds__(kThreads) dequantize_fp4_kernel(const DequantizeParams p) {
  constexpr int U = 4;
  const int tc = threadIdx.x % p.tc, tr = threadIdx.x / p.tc;
  const int64_t cc = int64_t(blockIdx.x) * p.tc + tc;
  if (tr >= p.tr || cc >= p.nc) return;
  const int64_t col0 = cc * kDChunk;
  const float D = *p.descale;
  // Without a center a NaN output needs a NaN block scale, a non-finite descale, or an
  // overflowing e * sb (E8M0 2^126, 2^127) times a zero descale.
  const bool d_safe = isfinite(D) && D != 0.0f;
  float c[CENTER ? kDChunk : 1];
  if constexpr (CENTER) {
    const float4* cv = reinterpret_cast<const float4*>(p.center + col0);
    const float4 v0 = cv[0], v1 = cv[1];
    c[0] = v0.x, c[1] = v0.y, c[2] = v0.z, c[3] = v0.w, c[4] = v1.x, c[5] = v1.y, c[6] = v1.z, c[7] = v1.w;
  }
  // Pointers to this thread's first row, advanced by whole row strides: 4 packed bytes
  // (8 codes), the block's scale byte, 8 outputs.
  const int64_t r_first = int64_t(blockIdx.y) * p.tr + tr;
  const int64_t e_first = r_first * p.k + col0;
  const int64_t row_blocks = p.k / (MX ? 32 : 16);
  const uint32_t* pw = reinterpret_cast<const uint32_t*>(p.packed) + e_first / 8;
  const uint8_t* ps = p.scales + r_first * row_blocks + col0 / (MX ? 32 : 16);
  T* po = static_cast<T*>(p.out) + e_first;
  const int64_t w_step = p.rstride * p.k / 8, s_step = p.rstride * row_blocks, o_step = p.rstride * p.k;
  for (int64_t r0 = r_first; r0 < p.rows; r0 += p.rstride * U, pw += w_step * U, ps += s_step * U, po += o_step * U) {
    uint32_t w[U];
    uint8_t code[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (r0 + u * p.rstride < p.rows) {
        w[u] = __ldcs(pw + u * w_step);
        code[u] = __ldg(ps + u * s_step);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (r0 + u * p.rstride >= p.rows) break;
      const float sb = MX ? e8m0_value(code[u]) : e4m3_value(code[u]);
      const bool check_nan = CENTER || is_nan(sb) || !d_safe;
      float v[kDChunk];
#pragma unroll
      for (int j = 0; j < kDChunk; ++j) {
        v[j] = mul(mul(e2m1_value((w[u] >> (4 * j)) & 0xfu), sb), D);
        if constexpr (CENTER) v[j] = add(v[j], c[j]);
      }
      T* dst = po + u * o_step;
      if constexpr (std::is_same_v<T, float>) {
        uint4 o[2];
        uint32_t* ow = reinterpret_cast<uint32_t*>(o);
#pragma unroll
        for (int j = 0; j < kDChunk; ++j)
          ow[j] = (check_nan && is_nan(v[j])) ? kCanonicalNanF32 : __float_as_uint(v[j]);
        __stcs(reinterpret_cast<uint4*>(dst), o[0]);
        __stcs(reinterpret_cast<uint4*>(dst) + 1, o[1]);
      } else {
        const uint4 o = make_uint4(Out<T>::pair(v[0], v[1], check_nan), Out<T>::pair(v[2], v[3], check_nan),
                                   Out<T>::pair(v[4], v[5], check_nan), Out<T>::pair(v[6], v[7], check_nan));
        __stcs(reinterpret_cast<uint4*>(dst), o);
      }
    }
  }
}

template <typename T, bool MX, bool CENTER, typename L>
void launch_dequantize_t(DequantizeParams p, L& launcher) {
  constexpr auto kernel = dequantize_fp4_kernel<T, MX, CENTER>;
  const Plan plan = plan_for(p.rows, p.nc, launcher.template resident<kernel>(), 4);
  p.tc = plan.tc;
  p.tr = plan.tr;
  p.rstride = plan.rstride;
  launcher.template launch<kernel>(plan.grid, p);
}

template <typename T, typename L>
void launch_dequantize_flags(const DequantizeParams& p, bool mx, bool center, L& launcher) {
  if (mx)
    center ? launch_dequantize_t<T, true, true>(p, launcher) : launch_dequantize_t<T, true, false>(p, launcher);
  else
    center ? launch_dequantize_t<T, false, true>(p, launcher) : launch_dequantize_t<T, false, false>(p, launcher);
}

// Decodes contiguous packed codes (4-byte aligned) and block scales of `rows` x `k` elements
// into `out` (16-byte aligned) of type `type`; center 16-byte aligned or null.
template <typename L>
void run_dequantize(DequantizeParams p, InType type, bool mx, L& launcher) {
  p.nc = p.k / kDChunk;
  const bool center = p.center != nullptr;
  switch (type) {
    case InType::kF32:
      launch_dequantize_flags<float>(p, mx, center, launcher);
      break;
    case InType::kBF16:
      launch_dequantize_flags<__nv_bfloat16>(p, mx, center, launcher);
      break;
    default:
      launch_dequantize_flags<__half>(p, mx, center, launcher);
      break;
  }
}

// ---------------------------------------------------------------------------------------
// update_centers: one thread per (owner, channel), all owners in one launch
// ---------------------------------------------------------------------------------------
struct CenterParams {
  float* center;
  float* cmax;
  float* cmin;
  const bool* mask;
  int64_t n, c;
  int64_t s_center[2], s_max[2], s_min[2], s_mask;
  float momentum;
};

__global__ void update_centers_kernel(const CenterParams p) {
  const int64_t ch = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (ch >= p.c) return;
  for (int64_t o = blockIdx.y; o < p.n; o += gridDim.y) {
    if (!p.mask[o * p.s_mask]) continue;
    float* pc = p.center + o * p.s_center[0] + ch * p.s_center[1];
    float* phi = p.cmax + o * p.s_max[0] + ch * p.s_max[1];
    float* plo = p.cmin + o * p.s_min[0] + ch * p.s_min[1];
    const float hi = *phi, lo = *plo;
    if (isfinite(hi) && isfinite(lo)) {
      const float c = *pc;
      const float mu = add(mul(0.5f, hi), mul(0.5f, lo));
      const float next = add(c, mul(p.momentum, sub(mu, c)));
      *pc = is_nan(next) ? __uint_as_float(kCanonicalNanF32) : next;
    }
    *phi = -INFINITY;
    *plo = INFINITY;
  }
}

template <typename L>
void run_update_centers(const CenterParams& p, L& launcher) {
  const dim3 grid(unsigned((p.c + 127) / 128), unsigned(std::min<int64_t>(p.n, 65535)));
  launcher.template launch<update_centers_kernel, CenterParams, 128>(grid, p);
}

}  // namespace fp4kernels


#ifndef FP8STATE_FP4_NO_TORCH
// =======================================================================================
// The torch ops: argument checks (the messages of ops/library_fp4.py), layouts, launches
// =======================================================================================
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using namespace fp4kernels;

// Launches on the current stream; occupancy looked up once per kernel (one device kind assumed).
struct CudaLauncher {
  cudaStream_t stream;
  template <auto Kernel>
  int resident() {
    static const int ctas = [] {
      int per_sm = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kThreads, 0));
      return std::max(1, per_sm) * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    }();
    return ctas;
  }
  template <auto Kernel, typename P, int kBlock = kThreads>
  void launch(dim3 grid, const P& params) {
    Kernel<<<grid, kBlock, 0, stream>>>(params);
  }
};

// ---------------------------------------------------------------------------------------
// error text, built from strings only (streaming integers through an ostream from the
// extension crashed on the device image: see fp8state_ops.cu)
// ---------------------------------------------------------------------------------------
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::ScalarType::Float: return "torch.float32";
    case at::ScalarType::Double: return "torch.float64";
    case at::ScalarType::Half: return "torch.float16";
    case at::ScalarType::BFloat16: return "torch.bfloat16";
    case at::ScalarType::Byte: return "torch.uint8";
    case at::ScalarType::Char: return "torch.int8";
    case at::ScalarType::Short: return "torch.int16";
    case at::ScalarType::Int: return "torch.int32";
    case at::ScalarType::Long: return "torch.int64";
    case at::ScalarType::Bool: return "torch.bool";
    case at::ScalarType::Float8_e4m3fn: return "torch.float8_e4m3fn";
    case at::ScalarType::Float8_e5m2: return "torch.float8_e5m2";
    case at::ScalarType::Float8_e8m0fnu: return "torch.float8_e8m0fnu";
    default: return std::string("torch.") + c10::toString(t);
  }
}

// Python's tuple formatting: (), (3,), (2, 16).
std::string shape_str(c10::IntArrayRef s) {
  std::string r = "(";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + (s.size() == 1 ? ",)" : ")");
}

// Python's repr of a float: the shortest text that reads back to the same double.
std::string float_str(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof(buf), "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s(buf);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

// The package's one argument-check message (config.require_that): "<key>=<found> is not
// allowed: expected <what is>", bit for bit the CPU reference's.
#define FP4S_CHECK(cond, what, expected, found) \
  TORCH_CHECK_VALUE(cond, what, "=", found, " is not allowed: expected ", expected)

const std::string kInDtypes = "one of [torch.float32, torch.bfloat16, torch.float16]";

bool is_in_dtype(at::ScalarType t) {
  return t == at::ScalarType::Float || t == at::ScalarType::BFloat16 || t == at::ScalarType::Half;
}

// Returns the block size (16 or 32); raises for any other layout name.
int check_layout(c10::string_view layout) {
  const bool nv = layout == "nvfp4", mx = layout == "mxfp4";
  FP4S_CHECK(nv || mx, "layout", std::string("one of ['mxfp4', 'nvfp4']"), "'" + std::string(layout) + "'");
  return nv ? 16 : 32;
}

void check_scalar(const at::Tensor& t, const char* name, const at::Device& device) {
  FP4S_CHECK(t.scalar_type() == at::ScalarType::Float, std::string(name) + ".dtype", std::string("torch.float32"),
             dtype_name(t.scalar_type()));
  FP4S_CHECK(t.numel() == 1, std::string(name) + ".numel()", std::string("1"), std::to_string(t.numel()));
  FP4S_CHECK(t.device() == device, std::string(name) + ".device", device.str(), t.device().str());
}

void check_center(const std::optional<at::Tensor>& center, int64_t k, const at::Device& device) {
  if (!center.has_value()) return;
  const at::Tensor& c = *center;
  FP4S_CHECK(c.scalar_type() == at::ScalarType::Float, "center.dtype", std::string("torch.float32"),
             dtype_name(c.scalar_type()));
  FP4S_CHECK(c.dim() == 1 && c.size(0) == k, "center.shape",
             "(" + std::to_string(k) + ",) (one value per channel of x)", shape_str(c.sizes()));
  FP4S_CHECK(c.device() == device, "center.device", device.str(), c.device().str());
}

// The checks of library_fp4.check_fp4_quantize_args, in the same order. Returns the block size.
int check_quantize_args(const at::Tensor& x, const at::Tensor& scale, const std::optional<at::Tensor>& center,
                        c10::string_view layout) {
  const int block = check_layout(layout);
  FP4S_CHECK(is_in_dtype(x.scalar_type()), "x.dtype", kInDtypes, dtype_name(x.scalar_type()));
  FP4S_CHECK(x.dim() >= 1, "x.dim()", std::string(">= 1"), std::to_string(x.dim()));
  const int64_t k = x.size(-1);
  FP4S_CHECK(k % block == 0, "x.shape[-1]",
             "a multiple of " + std::to_string(block) + " (the " + std::string(layout) + " block size)",
             std::to_string(k));
  check_scalar(scale, "scale", x.device());
  check_center(center, k, x.device());
  return block;
}

void check_pending(const at::Tensor& amax_pending, int64_t slot, const at::Device& device) {
  FP4S_CHECK(amax_pending.scalar_type() == at::ScalarType::Float, "amax_pending.dtype", std::string("torch.float32"),
             dtype_name(amax_pending.scalar_type()));
  FP4S_CHECK(amax_pending.dim() == 1, "amax_pending.dim()", std::string("1"), std::to_string(amax_pending.dim()));
  FP4S_CHECK(amax_pending.device() == device, "amax_pending.device", device.str(), amax_pending.device().str());
  FP4S_CHECK(slot >= 0 && slot < amax_pending.numel(), "slot", "0 <= slot < " + std::to_string(amax_pending.numel()),
             std::to_string(slot));
}

void check_center_stats(const at::Tensor& cmax, const at::Tensor& cmin, int64_t slot, int64_t k,
                        const at::Device& device) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"center_max", cmax},
                                std::pair<const char*, const at::Tensor&>{"center_min", cmin}}) {
    FP4S_CHECK(t.scalar_type() == at::ScalarType::Float, std::string(name) + ".dtype", std::string("torch.float32"),
               dtype_name(t.scalar_type()));
    FP4S_CHECK(t.dim() == 2, std::string(name) + ".dim()", std::string("2 ([owners, channels])"),
               std::to_string(t.dim()));
    FP4S_CHECK(t.device() == device, std::string(name) + ".device", device.str(), t.device().str());
  }
  FP4S_CHECK(cmin.sizes() == cmax.sizes(), "center_min.shape", shape_str(cmax.sizes()), shape_str(cmin.sizes()));
  FP4S_CHECK(slot >= 0 && slot < cmax.size(0), "slot", "0 <= slot < " + std::to_string(cmax.size(0)),
             std::to_string(slot));
  FP4S_CHECK(cmax.size(1) >= k, "center_max.shape[1]", ">= " + std::to_string(k) + " (x's channels)",
             std::to_string(cmax.size(1)));
}

// Contiguous and 16-byte aligned (a misaligned view is copied).
at::Tensor aligned_contiguous(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

std::vector<int64_t> with_last(c10::IntArrayRef sizes, int64_t last) {
  std::vector<int64_t> s(sizes.begin(), sizes.end());
  s.back() = last;
  return s;
}

std::tuple<at::Tensor, at::Tensor> quantize_impl(const at::Tensor& x_in, const at::Tensor& scale,
                                                 const std::optional<at::Tensor>& center_in,
                                                 c10::string_view layout, float* amax_slot, float* cmax, float* cmin,
                                                 int64_t cmax_stride, int64_t cmin_stride) {
  FP4S_CHECK(x_in.is_cuda(), "x.device", std::string("a CUDA tensor"), x_in.device().str());
  const c10::cuda::CUDAGuard guard(x_in.device());
  const bool mx = layout == "mxfp4";
  const int block = mx ? 32 : 16;
  const int64_t k = x_in.size(-1);
  at::Tensor packed = at::empty(with_last(x_in.sizes(), k / 2), x_in.options().dtype(at::kByte));
  at::Tensor scales = at::empty(with_last(x_in.sizes(), k / block),
                                x_in.options().dtype(mx ? at::ScalarType::Float8_e8m0fnu : at::ScalarType::Float8_e4m3fn));
  const int64_t n = x_in.numel();
  if (n == 0) return {packed, scales};
  const at::Tensor x = aligned_contiguous(x_in);
  at::Tensor center;
  if (center_in.has_value()) center = aligned_contiguous(*center_in);
  QuantizeParams p{};
  p.x = x.data_ptr();
  p.packed = packed.data_ptr<uint8_t>();
  p.scales = reinterpret_cast<uint8_t*>(scales.data_ptr());
  p.scale = scale.data_ptr<float>();
  p.center = center.defined() ? center.data_ptr<float>() : nullptr;
  p.amax_slot = amax_slot;
  p.cmax = cmax;
  p.cmin = cmin;
  p.cmax_stride = cmax_stride;
  p.cmin_stride = cmin_stride;
  p.k = k;
  p.rows = n / k;
  const InType type = x.scalar_type() == at::ScalarType::Float      ? InType::kF32
                      : x.scalar_type() == at::ScalarType::BFloat16 ? InType::kBF16
                                                                     : InType::kF16;
  CudaLauncher launcher{at::cuda::getCurrentCUDAStream()};
  run_quantize(p, type, mx, launcher);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {packed, scales};
}

std::tuple<at::Tensor, at::Tensor> quantize_fp4_cuda(const at::Tensor& x, const at::Tensor& scale,
                                                     const std::optional<at::Tensor>& center,
                                                     c10::string_view layout) {
  check_quantize_args(x, scale, center, layout);
  return quantize_impl(x, scale, center, layout, nullptr, nullptr, nullptr, 0, 0);
}

std::tuple<at::Tensor, at::Tensor> quantize_fp4_record_amax_cuda(const at::Tensor& x, const at::Tensor& scale,
                                                                 const at::Tensor& amax_pending, int64_t slot,
                                                                 c10::string_view layout) {
  check_quantize_args(x, scale, std::nullopt, layout);
  check_pending(amax_pending, slot, x.device());
  float* cell = amax_pending.data_ptr<float>() + slot * amax_pending.stride(0);
  return quantize_impl(x, scale, std::nullopt, layout, cell, nullptr, nullptr, 0, 0);
}

std::tuple<at::Tensor, at::Tensor> quantize_fp4_centered_record_cuda(
    const at::Tensor& x, const at::Tensor& scale, const at::Tensor& center, const at::Tensor& amax_pending,
    const at::Tensor& center_max, const at::Tensor& center_min, int64_t slot, c10::string_view layout) {
  check_quantize_args(x, scale, center, layout);
  check_pending(amax_pending, slot, x.device());
  check_center_stats(center_max, center_min, slot, x.size(-1), x.device());
  float* cell = amax_pending.data_ptr<float>() + slot * amax_pending.stride(0);
  if (x.numel() == 0) {  // nothing observed: the statistics keep their values
    return quantize_impl(x, scale, center, layout, cell, nullptr, nullptr, 0, 0);
  }
  float* cmax = center_max.data_ptr<float>() + slot * center_max.stride(0);
  float* cmin = center_min.data_ptr<float>() + slot * center_min.stride(0);
  return quantize_impl(x, scale, center, layout, cell, cmax, cmin, center_max.stride(1), center_min.stride(1));
}

at::Tensor dequantize_fp4_cuda(const at::Tensor& packed_in, const at::Tensor& block_scales_in,
                               const at::Tensor& descale, const std::optional<at::Tensor>& center_in,
                               c10::string_view layout, at::ScalarType dtype) {
  const int block = check_layout(layout);
  FP4S_CHECK(packed_in.scalar_type() == at::ScalarType::Byte, "packed.dtype", std::string("torch.uint8"),
             dtype_name(packed_in.scalar_type()));
  FP4S_CHECK(packed_in.dim() >= 1, "packed.dim()", std::string(">= 1"), std::to_string(packed_in.dim()));
  const int64_t k = 2 * packed_in.size(-1);
  FP4S_CHECK(k % block == 0, "2 * packed.shape[-1]",
             "a multiple of " + std::to_string(block) + " (the " + std::string(layout) + " block size)",
             std::to_string(k));
  const bool mx = block == 32;
  const at::ScalarType want = mx ? at::ScalarType::Float8_e8m0fnu : at::ScalarType::Float8_e4m3fn;
  FP4S_CHECK(block_scales_in.scalar_type() == want, "block_scales.dtype", dtype_name(want),
             dtype_name(block_scales_in.scalar_type()));
  const std::vector<int64_t> want_shape = with_last(packed_in.sizes(), k / block);
  FP4S_CHECK(block_scales_in.sizes() == c10::IntArrayRef(want_shape), "block_scales.shape", shape_str(want_shape),
             shape_str(block_scales_in.sizes()));
  FP4S_CHECK(block_scales_in.device() == packed_in.device(), "block_scales.device", packed_in.device().str(),
             block_scales_in.device().str());
  FP4S_CHECK(is_in_dtype(dtype), "dtype", kInDtypes, dtype_name(dtype));
  check_scalar(descale, "descale", packed_in.device());
  check_center(center_in, k, packed_in.device());
  FP4S_CHECK(packed_in.is_cuda(), "packed.device", std::string("a CUDA tensor"), packed_in.device().str());

  const c10::cuda::CUDAGuard guard(packed_in.device());
  at::Tensor out = at::empty(with_last(packed_in.sizes(), k), packed_in.options().dtype(dtype));
  const int64_t n = out.numel();
  if (n == 0) return out;
  const at::Tensor packed = aligned_contiguous(packed_in);
  const at::Tensor scales = block_scales_in.contiguous();
  at::Tensor center;
  if (center_in.has_value()) center = aligned_contiguous(*center_in);
  DequantizeParams p{};
  p.packed = packed.data_ptr<uint8_t>();
  p.scales = reinterpret_cast<const uint8_t*>(scales.data_ptr());
  p.descale = descale.data_ptr<float>();
  p.center = center.defined() ? center.data_ptr<float>() : nullptr;
  p.out = out.data_ptr();
  p.k = k;
  p.rows = n / k;
  const InType type = dtype == at::ScalarType::Float      ? InType::kF32
                      : dtype == at::ScalarType::BFloat16 ? InType::kBF16
                                                          : InType::kF16;
  CudaLauncher launcher{at::cuda::getCurrentCUDAStream()};
  run_dequantize(p, type, mx, launcher);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

void update_centers_cuda(const at::Tensor& center, const at::Tensor& center_max, const at::Tensor& center_min,
                         const at::Tensor& commit_mask, double momentum) {
  FP4S_CHECK(center.dim() == 2, "center.dim()", std::string("2 ([owners, channels])"), std::to_string(center.dim()));
  const int64_t n = center.size(0), c = center.size(1);
  const at::Device device = center.device();
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"center", center},
                                std::pair<const char*, const at::Tensor&>{"center_max", center_max},
                                std::pair<const char*, const at::Tensor&>{"center_min", center_min}}) {
    FP4S_CHECK(t.scalar_type() == at::ScalarType::Float, std::string(name) + ".dtype", std::string("torch.float32"),
               dtype_name(t.scalar_type()));
    FP4S_CHECK(t.device() == device, std::string(name) + ".device", device.str(), t.device().str());
    FP4S_CHECK(t.sizes() == center.sizes(), std::string(name) + ".shape", shape_str(center.sizes()),
               shape_str(t.sizes()));
  }
  FP4S_CHECK(commit_mask.scalar_type() == at::ScalarType::Bool, "commit_mask.dtype", std::string("torch.bool"),
             dtype_name(commit_mask.scalar_type()));
  FP4S_CHECK(commit_mask.dim() == 1 && commit_mask.size(0) == n, "commit_mask.shape", "(" + std::to_string(n) + ",)",
             shape_str(commit_mask.sizes()));
  FP4S_CHECK(commit_mask.device() == device, "commit_mask.device", device.str(), commit_mask.device().str());
  FP4S_CHECK(momentum > 0.0 && momentum <= 1.0, "momentum", std::string("0 < momentum <= 1"), float_str(momentum));
  FP4S_CHECK(center.is_cuda(), "center.device", std::string("a CUDA tensor"), device.str());
  if (n == 0 || c == 0) return;
  const c10::cuda::CUDAGuard guard(device);
  CenterParams p{};
  p.center = center.data_ptr<float>();
  p.cmax = center_max.data_ptr<float>();
  p.cmin = center_min.data_ptr<float>();
  p.mask = commit_mask.data_ptr<bool>();
  p.n = n;
  p.c = c;
  p.s_center[0] = center.stride(0), p.s_center[1] = center.stride(1);
  p.s_max[0] = center_max.stride(0), p.s_max[1] = center_max.stride(1);
  p.s_min[0] = center_min.stride(0), p.s_min[1] = center_min.stride(1);
  p.s_mask = commit_mask.stride(0);
  p.momentum = static_cast<float>(momentum);  // round to nearest, as torch.tensor(momentum, float32)
  CudaLauncher launcher{at::cuda::getCurrentCUDAStream()};
  run_update_centers(p, launcher);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(fp8state, CUDA, m) {
  m.impl("quantize_fp4", &quantize_fp4_cuda);
  m.impl("quantize_fp4_record_amax", &quantize_fp4_record_amax_cuda);
  m.impl("quantize_fp4_centered_record", &quantize_fp4_centered_record_cuda);
  m.impl("dequantize_fp4", &dequantize_fp4_cuda);
  m.impl("update_centers", &update_centers_cuda);
}

#endif  // FP8STATE_FP4_NO_TORCH
#endif  // FP8STATE_FP4_MATH_ONLY
