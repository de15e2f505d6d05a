// Device helpers shared by fp8state_ops.cu and fp4_ops.cu: the NaN-propagating max and the
// CTA reduction that folds a recorded amax into an owner's pending slot. Both files' kernels
// must give the same amax bit for bit, so they use this one definition.
//
// No torch here, and host-compilable: fp4_ops.cu includes it in its scalar part, which
// tests/ops/fp4_math_host_check.cu builds for the host, and tests/ops/fp4_emulate.cpp runs the
// CTA reduction on the host (emulated shuffles, barriers and atomics declared before this
// file is included). Shipped with the package next to the .cu files; ops/cuda.py folds every
// file of csrc/ into the build cache's tag, so an edit here rebuilds the extension.
#pragma once

#include <cstdint>

namespace fp8state_common {

// The one NaN every kernel writes for a float32 (as an unsigned integer it orders above +inf,
// so an atomicMax on the bits folds it like any larger amax).
constexpr uint32_t kCanonicalNanF32 = 0x7fc00000u;

// NaN-propagating max (PTX max.NaN, sm_80+); on the host, a NaN argument gives a NaN.
__host__ __device__ __forceinline__ float fmax_nan(float a, float b) {
#ifdef __CUDA_ARCH__
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  if (a != a || b != b) {
    const uint32_t nan = 0x7fffffffu;
    float r;
    __builtin_memcpy(&r, &nan, 4);
    return r;
  }
  return a > b ? a : b;
#endif
}

// NaN-propagating max over the 32 lanes of a full warp (every lane gets the result).
__device__ __forceinline__ float warp_max_nan(float m) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmax_nan(m, __shfl_xor_sync(0xffffffffu, m, off));
  return m;
}

// Folds the CTA's amax into *slot with one atomicMax on the fp32 bit pattern (non-negative
// floats order like their bits; the canonical NaN orders above +inf). Every thread of the CTA
// calls it, and the CTA has exactly kBlock threads (the kernel's launch size).
template <int kBlock>
__device__ __forceinline__ void block_fold_amax(float m, float* slot) {
  static_assert(kBlock % 32 == 0 && kBlock <= 1024, "block_fold_amax: kBlock must be whole warps, at most 1024");
  constexpr int kWarps = kBlock / 32;
  __shared__ float s_max[kWarps];
  m = warp_max_nan(m);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) s_max[warp] = m;
  __syncthreads();
  if (warp == 0) {
    m = warp_max_nan(lane < kWarps ? s_max[lane] : 0.0f);
    if (lane == 0) {
      const bool nan = (__float_as_uint(m) & 0x7fffffffu) > 0x7f800000u;
      atomicMax(reinterpret_cast<unsigned int*>(slot), nan ? kCanonicalNanF32 : __float_as_uint(m));
    }
  }
}

}  // namespace fp8state_common
