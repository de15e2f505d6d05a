// The SwiGLU's scalar float32 math (exp, silu, the product and its gradients), the one
// definition the kernels of swiglu_ops.cu use and the CPU reference (ops/reference_swiglu.py)
// reproduces operation for operation: every operation one correctly rounded IEEE float32
// operation (the _rn intrinsics on the device: never contracted into a fused multiply-add).
//
// No torch here, and host-compilable (with -ffp-contract=off): tests/ops/swiglu_math_host_check.cu
// builds it for the host and writes its results for tests/unit/test_prologue_rms_swiglu.py to
// compare with the reference bit for bit. Shipped with the package next to the .cu files.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace fp8state_swiglu {

__host__ __device__ __forceinline__ float fadd_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

__host__ __device__ __forceinline__ float fsub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

__host__ __device__ __forceinline__ float fmul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

__host__ __device__ __forceinline__ float fdiv_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// 2^k for an integer k in [-126, 127] (its bits, exactly).
__host__ __device__ __forceinline__ float pow2(int k) {
  const uint32_t bits = uint32_t(k + 127) << 23;
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// reference_swiglu: LOG2E, LN2_HI, LN2_LO, TAYLOR (1/n!, n = 7 .. 2), EXP_LOW, EXP_HIGH
constexpr float kLog2e = 0x1.715476p+0f;
constexpr float kLn2Hi = 0x1.62e4p-1f;  // 15 significant bits: k * kLn2Hi is exact for |k| <= 150
constexpr float kLn2Lo = 0x1.7f7d1cp-20f;
constexpr float kC7 = 0x1.a01a02p-13f, kC6 = 0x1.6c16c2p-10f, kC5 = 0x1.111112p-7f, kC4 = 0x1.555556p-5f,
                kC3 = 0x1.555556p-3f, kC2 = 0x1p-1f;
constexpr float kExpLow = -104.0f, kExpHigh = 89.0f;

// exp(v) in float32 (reference_swiglu.exp_f32): Cody-Waite reduction v = k ln2 + r, the degree-7
// Taylor polynomial of exp(r) in Horner form, scaled by 2^(k / 2) then 2^(k - k / 2).
__host__ __device__ __forceinline__ float exp_f32(float v) {
  if (v != v) return v;  // NaN
  const float w = v < kExpLow ? kExpLow : (v > kExpHigh ? kExpHigh : v);
  const float k = rintf(fmul_rn(w, kLog2e));  // round half to even
  const float r = fsub_rn(fsub_rn(w, fmul_rn(k, kLn2Hi)), fmul_rn(k, kLn2Lo));
  float p = fadd_rn(fmul_rn(r, kC7), kC6);
  p = fadd_rn(fmul_rn(p, r), kC5);
  p = fadd_rn(fmul_rn(p, r), kC4);
  p = fadd_rn(fmul_rn(p, r), kC3);
  p = fadd_rn(fmul_rn(p, r), kC2);
  p = fadd_rn(fmul_rn(p, r), 1.0f);
  p = fadd_rn(fmul_rn(p, r), 1.0f);
  const int ki = int(k);
  const int k1 = ki / 2;  // truncated, as the reference's rounding_mode="trunc"
  return fmul_rn(fmul_rn(p, pow2(k1)), pow2(ki - k1));
}

// silu(g) * u: the value the fused forward encodes (float32, never rounded to the input's dtype).
__host__ __device__ __forceinline__ float swiglu(float g, float u) {
  const float silu = fdiv_rn(g, fadd_rn(exp_f32(-g), 1.0f));
  return fmul_rn(silu, u);
}

// The gradients of silu(g) * u with respect to g and u, from dy (reference_swiglu's backward).
__host__ __device__ __forceinline__ void swiglu_grad(float g, float u, float dy, float& dg, float& du) {
  const float den = fadd_rn(exp_f32(-g), 1.0f);
  const float sig = fdiv_rn(1.0f, den);
  const float silu = fdiv_rn(g, den);
  const float dsilu = fmul_rn(sig, fadd_rn(fmul_rn(g, fsub_rn(1.0f, sig)), 1.0f));
  dg = fmul_rn(fmul_rn(dy, u), dsilu);
  du = fmul_rn(dy, silu);
}

}  // namespace fp8state_swiglu
