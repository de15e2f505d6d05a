// FP8 encoding shared by fp8_ops.cu, fused_ops.cu and ln_ops.cu: element conversions, the quantize
// kernel (with its GELU-prologue variant), its launcher and the input checks, so that the
// plain and the fused encodes compile from one definition. Numerics: see fp8_ops.cu.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>
#include <type_traits>

#include "fp8state_common.cuh"

namespace {

using fp8state_common::block_fold_amax;
using fp8state_common::fmax_nan;
using fp8state_common::kCanonicalNanF32;

constexpr uint8_t kCanonicalNanFp8 = 0x7f;
constexpr int kThreads = 256;
constexpr int kUnroll = 4;

// Error text is assembled from strings only: streaming an integer through an ostream from
// this extension crashed on the H200 image (a libstdc++ num_put mismatch), so integers and
// shapes go through std::to_string.
//
// Values are shown as the Python checks show them (config.require_that: str() of a dtype, a
// device, a shape tuple), so that a bad call raises the same message on the CPU and on the GPU.
inline std::string fp8s_dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    case at::kFloat8_e4m3fn: return "torch.float8_e4m3fn";
    case at::kFloat8_e5m2: return "torch.float8_e5m2";
    default: return std::string("torch.") + c10::toString(t);
  }
}

// Python's repr of a float: the shortest digits that read back to the same double, in fixed
// notation for exponents in [-4, 16), else as d.ddde+XX.
inline std::string fp8s_float_str(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  int digits = 1;
  for (; digits < 17; ++digits) {
    std::snprintf(buf, sizeof(buf), "%.*e", digits - 1, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::snprintf(buf, sizeof(buf), "%.*e", digits - 1, v);
  const int exp10 = std::atoi(std::strchr(buf, 'e') + 1);
  if (exp10 < -4 || exp10 >= 16) return buf;
  std::snprintf(buf, sizeof(buf), "%.*f", std::max(digits - 1 - exp10, 0), v);
  std::string s(buf);
  return s.find('.') == std::string::npos ? s + ".0" : s;
}

template <typename X>
std::string fp8s_str(const X& v) {
  if constexpr (std::is_same_v<X, bool>) {
    return v ? "True" : "False";
  } else if constexpr (std::is_integral_v<X>) {
    return std::to_string(v);
  } else if constexpr (std::is_floating_point_v<X>) {
    return fp8s_float_str(double(v));
  } else if constexpr (std::is_same_v<X, at::ScalarType>) {
    return fp8s_dtype_name(v);
  } else if constexpr (std::is_same_v<X, c10::IntArrayRef>) {
    std::string s = "(";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + (v.size() == 1 ? ",)" : ")");
  } else {
    return c10::str(v);
  }
}

// The package's one argument-check message (config.require_that): "<key>=<found> is not
// allowed: expected <what is>", bit for bit the CPU reference's.
#define FP8S_CHECK(cond, what, expected, found) \
  TORCH_CHECK_VALUE(cond, what, "=", fp8s_str(found), " is not allowed: expected ", fp8s_str(expected))

// ---------------------------------------------------------------------------------------
// element conversions
// ---------------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) {
  return isnan(v) ? __uint_as_float(kCanonicalNanF32) : v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return isnan(v) ? __ushort_as_bfloat16(0x7fc0) : __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) {
  return isnan(v) ? __ushort_as_half(0x7e00) : __float2half_rn(v);
}

template <bool E4M3>
struct Fp8Traits;
template <>
struct Fp8Traits<true> {
  static constexpr float kMax = 448.0f;
  static constexpr __nv_fp8_interpretation_t kKind = __NV_E4M3;
};
template <>
struct Fp8Traits<false> {
  static constexpr float kMax = 57344.0f;
  static constexpr __nv_fp8_interpretation_t kKind = __NV_E5M2;
};

// Two floats (already multiplied by the scale) -> two FP8 codes, low byte first.
// The satfinite conversion rounds to nearest even and saturates |v| > max (inf included)
// to ±max, which is exactly clamp-then-round; NaN codes are canonicalized by nan_fix4.
template <bool E4M3>
__device__ __forceinline__ uint32_t encode2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, Fp8Traits<E4M3>::kKind);
}

// Replace every NaN code among four packed codes by the canonical 0x7F.
// E4M3: the NaN codes are 0x7F and 0xFF. E5M2: 0x7D-0x7F and 0xFD-0xFF (satfinite never
// produces the infinities 0x7C/0xFC).
template <bool E4M3>
__device__ __forceinline__ uint32_t nan_fix4(uint32_t w) {
  const uint32_t mag = w & 0x7f7f7f7fu;
  const uint32_t is_nan = E4M3 ? __vcmpeq4(mag, 0x7f7f7f7fu) : __vcmpgtu4(mag, 0x7c7c7c7cu);
  return (w & ~is_nan) | (0x7f7f7f7fu & is_nan);
}

// One encoded code for a single float (tails).
template <bool E4M3>
__device__ __forceinline__ uint8_t encode1(float v) {
  return uint8_t(nan_fix4<E4M3>(encode2<E4M3>(v, 0.0f)) & 0xffu);
}

// How many of a and b (already multiplied by the scale) the encode clips to ±max: |v| > max,
// an infinity included, a NaN not (it gets the NaN code). The saturation count of the reference
// (ops/reference.py, clip_count_reference) is the same comparison on the same float32 values.
template <bool E4M3>
__device__ __forceinline__ uint32_t clips2(float a, float b) {
  return uint32_t(fabsf(a) > Fp8Traits<E4M3>::kMax) + uint32_t(fabsf(b) > Fp8Traits<E4M3>::kMax);
}

template <bool E4M3>
__device__ __forceinline__ float decode1(uint8_t code) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(code, Fp8Traits<E4M3>::kKind);
  return __half2float(__half(h));
}

// ---------------------------------------------------------------------------------------
// quantize (+ amax record): 16-byte loads, kUnroll loads in flight per thread
// ---------------------------------------------------------------------------------------
// Per input type: how a 16-byte load is encoded (4 words of packed codes per 16 bf16/fp16
// elements, 1 word per 4 fp32 elements) and how |x| is folded into a running max.
// The running max is kept in the input type where that is exact (the max of bf16/fp16
// magnitudes is one of them), with NaN-propagating packed max: one instruction per pair.
template <typename T>
struct Codec;

template <>
struct Codec<__nv_bfloat16> {
  static constexpr int kPerLoad = 8;
  using Acc = __nv_bfloat162;
  static __device__ __forceinline__ Acc zero() { return __floats2bfloat162_rn(0.0f, 0.0f); }
  template <bool E4M3, bool RECORD>
  static __device__ __forceinline__ void encode(const uint4& raw, float scale, uint32_t* words, Acc& m,
                                                uint32_t& clips) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; k += 2) {
      if (RECORD) {
        m = __hmax2_nan(m, __habs2(*reinterpret_cast<const __nv_bfloat162*>(&w[k])));
        m = __hmax2_nan(m, __habs2(*reinterpret_cast<const __nv_bfloat162*>(&w[k + 1])));
      }
      const float a0 = __uint_as_float(w[k] << 16) * scale, a1 = __uint_as_float(w[k] & 0xffff0000u) * scale;
      const float b0 = __uint_as_float(w[k + 1] << 16) * scale, b1 = __uint_as_float(w[k + 1] & 0xffff0000u) * scale;
      if (RECORD) clips += clips2<E4M3>(a0, a1) + clips2<E4M3>(b0, b1);
      const uint32_t lo = encode2<E4M3>(a0, a1);
      const uint32_t hi = encode2<E4M3>(b0, b1);
      words[k / 2] = nan_fix4<E4M3>(lo | (hi << 16));
    }
  }
  static __device__ __forceinline__ float finish(Acc m) { return fmax_nan(__low2float(m), __high2float(m)); }
};

template <>
struct Codec<__half> {
  static constexpr int kPerLoad = 8;
  using Acc = __half2;
  static __device__ __forceinline__ Acc zero() { return __floats2half2_rn(0.0f, 0.0f); }
  template <bool E4M3, bool RECORD>
  static __device__ __forceinline__ void encode(const uint4& raw, float scale, uint32_t* words, Acc& m,
                                                uint32_t& clips) {
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int k = 0; k < 4; k += 2) {
      if (RECORD) {
        m = __hmax2_nan(m, __habs2(h[k]));
        m = __hmax2_nan(m, __habs2(h[k + 1]));
      }
      const float2 a = __half22float2(h[k]), b = __half22float2(h[k + 1]);
      const float a0 = a.x * scale, a1 = a.y * scale, b0 = b.x * scale, b1 = b.y * scale;
      if (RECORD) clips += clips2<E4M3>(a0, a1) + clips2<E4M3>(b0, b1);
      const uint32_t lo = encode2<E4M3>(a0, a1);
      const uint32_t hi = encode2<E4M3>(b0, b1);
      words[k / 2] = nan_fix4<E4M3>(lo | (hi << 16));
    }
  }
  static __device__ __forceinline__ float finish(Acc m) { return fmax_nan(__low2float(m), __high2float(m)); }
};

template <>
struct Codec<float> {
  static constexpr int kPerLoad = 4;
  using Acc = float;
  static __device__ __forceinline__ Acc zero() { return 0.0f; }
  template <bool E4M3, bool RECORD>
  static __device__ __forceinline__ void encode(const uint4& raw, float scale, uint32_t* words, Acc& m,
                                                uint32_t& clips) {
    const float f[4] = {__uint_as_float(raw.x), __uint_as_float(raw.y), __uint_as_float(raw.z),
                        __uint_as_float(raw.w)};
    if (RECORD) m = fmax_nan(m, fmax_nan(fmax_nan(fabsf(f[0]), fabsf(f[1])), fmax_nan(fabsf(f[2]), fabsf(f[3]))));
    const float v0 = f[0] * scale, v1 = f[1] * scale, v2 = f[2] * scale, v3 = f[3] * scale;
    if (RECORD) clips += clips2<E4M3>(v0, v1) + clips2<E4M3>(v2, v3);
    const uint32_t lo = encode2<E4M3>(v0, v1);
    const uint32_t hi = encode2<E4M3>(v2, v3);
    words[0] = nan_fix4<E4M3>(lo | (hi << 16));
  }
  static __device__ __forceinline__ float finish(Acc m) { return m; }
};

// Where a quantize adds its saturation count: the owner's two int64 cells of the bank's
// ``saturation [2, n]`` counter, clipped elements and elements quantized (nullptr: not counted).
struct ClipCells {
  unsigned long long* clipped = nullptr;
  unsigned long long* elements = nullptr;
};

// Adds the CTA's clip count (each thread's ``c``) to cells.clipped: a warp reduce, one atomicAdd
// per CTA (none when nothing clipped; integer sums are exact in any order, so the count is the
// same bit for bit whatever the grid), and the first CTA adds the ``n`` elements quantized to
// cells.elements. Every thread of the CTA calls it; the CTA has exactly kBlock threads.
template <int kBlock>
__device__ __forceinline__ void block_add_clips(uint32_t c, ClipCells cells, int64_t n) {
  static_assert(kBlock % 32 == 0 && kBlock <= 1024, "block_add_clips: kBlock must be whole warps, at most 1024");
  if (cells.clipped == nullptr) return;  // (the same for the whole CTA)
  constexpr int kWarps = kBlock / 32;
  __shared__ uint32_t s_clips[kWarps];
  c = __reduce_add_sync(0xffffffffu, c);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) s_clips[warp] = c;
  __syncthreads();
  if (warp == 0) {
    c = __reduce_add_sync(0xffffffffu, lane < kWarps ? s_clips[lane] : 0u);
    if (lane == 0) {
      if (c != 0) atomicAdd(cells.clipped, static_cast<unsigned long long>(c));
      if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0)
        atomicAdd(cells.elements, static_cast<unsigned long long>(n));
    }
  }
}

// The GELU prologue (erf form): the same float32 expression as torch's CUDA GELU kernel,
// ``(x * 0.5) * (1 + erf(x * M_SQRT1_2))``, rounded to the input type, so that quantizing
// its result equals F.gelu followed by quantize_fp8 bit for bit.
__device__ __forceinline__ float gelu_f32(float v) {
  constexpr float kSqrtHalf = 0.70710678118654752440f;
  return (v * 0.5f) * (1.0f + erff(v * kSqrtHalf));
}

template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_f32<T>(from_f32<T>(v));
}

// GELU applied in place to the elements of one 16-byte load (each rounded to T).
template <typename T>
__device__ __forceinline__ uint4 gelu16(uint4 raw) {
  T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < int(16 / sizeof(T)); ++i) v[i] = from_f32<T>(gelu_f32(to_f32<T>(v[i])));
  return raw;
}

// One work item = 16 elements: G 16-byte loads in, one 16-byte store of 16 codes out.
// Each thread keeps kUnroll work items (kUnroll * G loads) in flight. With GELU, each loaded
// element is first replaced by GELU(element) in the input type (the fused prologue).
template <typename T, bool E4M3, bool RECORD, bool GELU = false>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const T* __restrict__ x, uint8_t* __restrict__ out,
                                                            const float* __restrict__ scale_ptr, float* amax_slot,
                                                            int64_t n, ClipCells cells) {
  using C = Codec<T>;
  constexpr int G = 16 / C::kPerLoad;
  constexpr int kWordsPerLoad = C::kPerLoad / 4;
  const float scale = *scale_ptr;
  typename C::Acc m = C::zero();
  uint32_t clips = 0;
  const int64_t nitems = n / 16;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  uint4* ov = reinterpret_cast<uint4*>(out);
  for (int64_t base = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; base < nitems; base += stride * kUnroll) {
    uint4 raw[kUnroll][G];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * stride;
      if (i < nitems) {
#pragma unroll
        for (int g = 0; g < G; ++g) raw[u][g] = __ldcs(xv + i * G + g);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * stride;
      if (i < nitems) {
        uint32_t words[4];
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const uint4 v = GELU ? gelu16<T>(raw[u][g]) : raw[u][g];
          C::template encode<E4M3, RECORD>(v, scale, words + g * kWordsPerLoad, m, clips);
        }
        __stcs(ov + i, make_uint4(words[0], words[1], words[2], words[3]));
      }
    }
  }
  float amax = RECORD ? C::finish(m) : 0.0f;
  // tail (n % 16 elements), handled by the first threads of block 0
  if (blockIdx.x == 0) {
    const int64_t t = nitems * 16 + threadIdx.x;
    if (t < n) {
      const float a = GELU ? round_to<T>(gelu_f32(to_f32(x[t]))) : to_f32(x[t]);
      if (RECORD) amax = fmax_nan(amax, fabsf(a));
      const float v = a * scale;
      if (RECORD) clips += clips2<E4M3>(v, 0.0f);
      out[t] = encode1<E4M3>(v);
    }
  }
  if (RECORD) block_fold_amax<kThreads>(amax, amax_slot);  // fp8state_common.cuh
  if (RECORD) block_add_clips<kThreads>(clips, cells, n);
}

template <typename T, bool E4M3, bool RECORD, bool GELU>
int grid_for_quantize(int64_t items) {
  static int resident = -1;  // blocks that fit on the whole device at once
  if (resident < 0) {
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, quantize_kernel<T, E4M3, RECORD, GELU>,
                                                                 kThreads, 0));
    resident = std::max(1, per_sm) * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  }
  const int64_t needed = (items + int64_t(kThreads) * kUnroll - 1) / (int64_t(kThreads) * kUnroll);
  return int(std::max<int64_t>(1, std::min<int64_t>(needed, resident)));
}

inline int grid_for(int64_t work_items) {
  static int sms = -1;
  if (sms < 0) sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t needed = (work_items + int64_t(kThreads) * kUnroll - 1) / (int64_t(kThreads) * kUnroll);
  return int(std::max<int64_t>(1, std::min<int64_t>(needed, int64_t(sms) * 8)));
}

inline void check_scalar(const at::Tensor& t, const char* name, const at::Tensor& like) {
  FP8S_CHECK(t.scalar_type() == at::kFloat, std::string(name) + ".dtype", "torch.float32", t.scalar_type());
  FP8S_CHECK(t.numel() == 1, std::string(name) + ".numel()", "1", t.numel());
  FP8S_CHECK(t.device() == like.device(), std::string(name) + ".device", like.device(), t.device());
}

inline void check_slot(int64_t slot, int64_t numel) {
  TORCH_CHECK_VALUE(slot >= 0 && slot < numel, "slot=", std::to_string(slot), " is not allowed: expected 0 <= slot < ",
                    std::to_string(numel));
}

inline void check_input(const at::Tensor& x, at::ScalarType dtype) {
  FP8S_CHECK(x.is_cuda(), "x.device", "a CUDA tensor", x.device());
  const auto st = x.scalar_type();
  FP8S_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "x.dtype",
             "one of [torch.float32, torch.bfloat16, torch.float16]", st);
  FP8S_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2, "dtype",
             "one of [torch.float8_e4m3fn, torch.float8_e5m2]", dtype);
}

inline at::Tensor launch_quantize(const at::Tensor& x_in, const at::Tensor& scale, at::ScalarType dtype, float* slot,
                           bool gelu = false, ClipCells cells = {}) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(dtype));
  const int64_t n = x.numel();
  if (n == 0) return out;
  const bool aligned = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  auto stream = at::cuda::getCurrentCUDAStream();
  const bool e4m3 = dtype == at::kFloat8_e4m3fn;
  const bool record = slot != nullptr;
  // A misaligned view (storage offset) is copied to an aligned buffer first.
  const at::Tensor xa = aligned ? x : x.clone();
#define FP8S_LAUNCH_G(T, E, R, G)                                                                     \
  quantize_kernel<T, E, R, G><<<grid_for_quantize<T, E, R, G>(n / 16), kThreads, 0, stream>>>(           \
      reinterpret_cast<const T*>(xa.data_ptr()), reinterpret_cast<uint8_t*>(out.data_ptr()),             \
      scale.data_ptr<float>(), slot, n, cells)
#define FP8S_LAUNCH(T, E, R)       \
  if (gelu)                        \
    FP8S_LAUNCH_G(T, E, R, true);  \
  else                             \
    FP8S_LAUNCH_G(T, E, R, false)
#define FP8S_BY_FLAGS(T)            \
  if (e4m3 && record)               \
    FP8S_LAUNCH(T, true, true);     \
  else if (e4m3)                    \
    FP8S_LAUNCH(T, true, false);    \
  else if (record)                  \
    FP8S_LAUNCH(T, false, true);    \
  else                              \
    FP8S_LAUNCH(T, false, false);
  switch (x.scalar_type()) {
    case at::kFloat:
      FP8S_BY_FLAGS(float);
      break;
    case at::kBFloat16:
      FP8S_BY_FLAGS(__nv_bfloat16);
      break;
    default:
      FP8S_BY_FLAGS(__half);
      break;
  }
#undef FP8S_BY_FLAGS
#undef FP8S_LAUNCH
#undef FP8S_LAUNCH_G
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// The amax_pending cell of ``slot``, after checking the buffer against x.
inline float* pending_cell(const at::Tensor& amax_pending, int64_t slot, const at::Tensor& x) {
  FP8S_CHECK(amax_pending.scalar_type() == at::kFloat, "amax_pending.dtype", "torch.float32",
             amax_pending.scalar_type());
  FP8S_CHECK(amax_pending.dim() == 1, "amax_pending.dim()", "1", amax_pending.dim());
  FP8S_CHECK(amax_pending.device() == x.device(), "amax_pending.device", x.device(), amax_pending.device());
  check_slot(slot, amax_pending.numel());
  return amax_pending.data_ptr<float>() + slot * amax_pending.stride(0);
}

// The owner's cells of the ``saturation [2, owners]`` int64 counter (column ``slot``, the
// same slot as its amax_pending cell), after checking it against amax_pending and x; no cells
// when the op was called without one.
inline ClipCells clip_cells(const c10::optional<at::Tensor>& saturation, int64_t slot, const at::Tensor& amax_pending,
                            const at::Tensor& x) {
  if (!saturation.has_value() || !saturation->defined()) return {};
  const at::Tensor& s = *saturation;
  FP8S_CHECK(s.scalar_type() == at::kLong, "saturation.dtype", "torch.int64", s.scalar_type());
  FP8S_CHECK(s.dim() == 2, "saturation.dim()", "2", s.dim());
  const std::string want = "(2, " + std::to_string(amax_pending.numel()) + ")";
  FP8S_CHECK(s.size(0) == 2 && s.size(1) == amax_pending.numel(), "saturation.shape", want, s.sizes());
  FP8S_CHECK(s.device() == x.device(), "saturation.device", x.device(), s.device());
  auto* base = reinterpret_cast<unsigned long long*>(s.data_ptr<int64_t>());
  return {base + slot * s.stride(1), base + s.stride(0) + slot * s.stride(1)};
}

// ``t`` contiguous and 16-byte aligned (the vector loads' requirement): a misaligned view
// (storage offset) is copied to a fresh buffer.
inline at::Tensor contiguous16(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

// A LayerNorm's optional float32 affine parameter of d values, checked against x and made
// contiguous16 into ``keep``; nullptr when absent.
inline const float* ln_affine(const c10::optional<at::Tensor>& t, const char* name, const at::Tensor& x, int64_t d,
                              at::Tensor& keep) {
  if (!t.has_value() || !t->defined()) return nullptr;
  FP8S_CHECK(t->scalar_type() == at::kFloat, std::string(name) + ".dtype", "torch.float32", t->scalar_type());
  FP8S_CHECK(t->dim() == 1 && t->size(0) == d, std::string(name) + ".shape",
             "(" + std::to_string(d) + ",) (one value per channel of x)", t->sizes());
  FP8S_CHECK(t->device() == x.device(), std::string(name) + ".device", x.device(), t->device());
  keep = contiguous16(*t);
  return keep.data_ptr<float>();
}

// ---------------------------------------------------------------------------------------
// A 128 x 128 tile of FP8 codes in shared memory, written out transposed (transpose_fp8, the
// quantize + transpose kernels of fp8_ops.cu and dynamic_ops.cu's colwise kernel).
// ---------------------------------------------------------------------------------------
constexpr int kTile = 128;

// Writes a 128 x 128 tile of codes (in shared memory, swizzled as the kernels below store it: word
// w ^ ((row / 16) % 8) * 4 of each 32-word row) transposed to out[c0.., r0..] (row pitch R):
// thread t owns input rows 16 rg .. 16 rg + 15 and input columns 4 cw .. 4 cw + 3, reads them as
// 16 words, transposes 4 x 4 byte blocks with byte permutes and writes four 16-byte runs.
// Called by all 256 threads of the CTA, after the barrier that completes the tile.
__device__ __forceinline__ void store_tile_transposed(const uint32_t* tile, uint8_t* __restrict__ out, int64_t R,
                                                      int64_t r0, int64_t c0) {
  const int t = threadIdx.x;
  const int rg = t & 7, cw = t >> 3;
  uint32_t w[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) w[i] = tile[(rg * 16 + i) * 32 + (cw ^ (rg << 2))];
  uint32_t o[4][4];  // o[k][m]: output row 4 cw + k, bytes of input rows 16 rg + 4 m .. + 3
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const uint32_t a = w[4 * m], b = w[4 * m + 1], c = w[4 * m + 2], d = w[4 * m + 3];
    const uint32_t t0 = __byte_perm(a, b, 0x5140), t1 = __byte_perm(c, d, 0x5140);
    const uint32_t t2 = __byte_perm(a, b, 0x7362), t3 = __byte_perm(c, d, 0x7362);
    o[0][m] = __byte_perm(t0, t1, 0x5410);
    o[1][m] = __byte_perm(t0, t1, 0x7632);
    o[2][m] = __byte_perm(t2, t3, 0x5410);
    o[3][m] = __byte_perm(t2, t3, 0x7632);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    *reinterpret_cast<uint4*>(out + (c0 + cw * 4 + k) * R + r0 + rg * 16) =
        make_uint4(o[k][0], o[k][1], o[k][2], o[k][3]);
  }
}

// The byte at (row, col) of a 128 x 128 tile of codes in shared memory, swizzled as
// store_tile_transposed reads it (word col / 4 of the row, XOR ((row / 16) % 8) * 4).
__device__ __forceinline__ int tile_byte(int row, int col) {
  return (row * 32 + ((col >> 2) ^ (((row >> 4) & 7) << 2))) * 4 + (col & 3);
}

// A tile that is not full (at an edge of x[R, C], or of a shape the 16-byte stores cannot
// take), written transposed to out[c0.., r0..] element by element, what lies outside x skipped.
// Called by all 256 threads of the CTA, after the barrier that completes the tile.
__device__ __forceinline__ void store_tile_transposed_partial(const uint32_t* tile, uint8_t* __restrict__ out,
                                                              int64_t R, int64_t C, int64_t r0, int64_t c0) {
  const uint8_t* tile_bytes = reinterpret_cast<const uint8_t*>(tile);
  for (int k = 0; k < kTile * kTile / 256; ++k) {
    const int idx = int(threadIdx.x) + 256 * k, cc = idx / kTile, rr = idx % kTile;
    if (c0 + cc < C && r0 + rr < R) out[(c0 + cc) * R + r0 + rr] = tile_bytes[tile_byte(rr, cc)];
  }
}

}  // namespace
