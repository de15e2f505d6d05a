// CUDA kernels for the fp8state ops. Schemas are defined in Python
// (lightning_fp8state/ops/library.py); this file only adds CUDA implementations.
// Every kernel is bit-identical to the pure-torch reference in ops/reference.py:
//   encode: v = float(x) * scale (one fp32 multiply), NaN -> canonical code 0x7F,
//           else clamp to [-max, max] and round to nearest even;
//   decode: float(q) * descale (one fp32 multiply), one rounding to the output dtype,
//           NaN -> the dtype's canonical quiet NaN;
//   amax:   max |x| in fp32, folded into the owner's pending slot; NaN -> canonical NaN
//           (which orders above +inf as an integer, so one atomicMax folds it);
//   update: history roll, max|most_recent, scale = fmax / amax / 2^margin, descale = 1/scale
//           (IEEE divisions), guarded against zero or non-finite amax.
// Every launch runs on the current stream; no kernel or wrapper synchronizes the host.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <torch/library.h>

#include <cstdint>
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
template <typename X>
std::string fp8s_str(const X& v) {
  if constexpr (std::is_integral_v<X>) {
    return std::to_string(v);
  } else if constexpr (std::is_same_v<X, c10::IntArrayRef>) {
    std::string s = "(";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + ")";
  } else {
    return c10::str(v);
  }
}

#define FP8S_CHECK(cond, what, expected, found) \
  TORCH_CHECK_VALUE(cond, "fp8state: ", what, ": expected ", fp8s_str(expected), ", got ", fp8s_str(found))

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
  static __device__ __forceinline__ void encode(const uint4& raw, float scale, uint32_t* words, Acc& m) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; k += 2) {
      if (RECORD) {
        m = __hmax2_nan(m, __habs2(*reinterpret_cast<const __nv_bfloat162*>(&w[k])));
        m = __hmax2_nan(m, __habs2(*reinterpret_cast<const __nv_bfloat162*>(&w[k + 1])));
      }
      const uint32_t lo = encode2<E4M3>(__uint_as_float(w[k] << 16) * scale, __uint_as_float(w[k] & 0xffff0000u) * scale);
      const uint32_t hi = encode2<E4M3>(__uint_as_float(w[k + 1] << 16) * scale,
                                        __uint_as_float(w[k + 1] & 0xffff0000u) * scale);
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
  static __device__ __forceinline__ void encode(const uint4& raw, float scale, uint32_t* words, Acc& m) {
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int k = 0; k < 4; k += 2) {
      if (RECORD) {
        m = __hmax2_nan(m, __habs2(h[k]));
        m = __hmax2_nan(m, __habs2(h[k + 1]));
      }
      const float2 a = __half22float2(h[k]), b = __half22float2(h[k + 1]);
      const uint32_t lo = encode2<E4M3>(a.x * scale, a.y * scale);
      const uint32_t hi = encode2<E4M3>(b.x * scale, b.y * scale);
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
  static __device__ __forceinline__ void encode(const uint4& raw, float scale, uint32_t* words, Acc& m) {
    const float f[4] = {__uint_as_float(raw.x), __uint_as_float(raw.y), __uint_as_float(raw.z),
                        __uint_as_float(raw.w)};
    if (RECORD) m = fmax_nan(m, fmax_nan(fmax_nan(fabsf(f[0]), fabsf(f[1])), fmax_nan(fabsf(f[2]), fabsf(f[3]))));
    const uint32_t lo = encode2<E4M3>(f[0] * scale, f[1] * scale);
    const uint32_t hi = encode2<E4M3>(f[2] * scale, f[3] * scale);
    words[0] = nan_fix4<E4M3>(lo | (hi << 16));
  }
  static __device__ __forceinline__ float finish(Acc m) { return m; }
};

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
                                                            int64_t n) {
  using C = Codec<T>;
  constexpr int G = 16 / C::kPerLoad;
  constexpr int kWordsPerLoad = C::kPerLoad / 4;
  const float scale = *scale_ptr;
  typename C::Acc m = C::zero();
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
          C::template encode<E4M3, RECORD>(v, scale, words + g * kWordsPerLoad, m);
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
      out[t] = encode1<E4M3>(a * scale);
    }
  }
  if (RECORD) block_fold_amax<kThreads>(amax, amax_slot);  // fp8state_common.cuh
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

int grid_for(int64_t work_items) {
  static int sms = -1;
  if (sms < 0) sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t needed = (work_items + int64_t(kThreads) * kUnroll - 1) / (int64_t(kThreads) * kUnroll);
  return int(std::max<int64_t>(1, std::min<int64_t>(needed, int64_t(sms) * 8)));
}

void check_scalar(const at::Tensor& t, const char* name, const at::Tensor& like) {
  FP8S_CHECK(t.scalar_type() == at::kFloat, std::string(name) + ".dtype", "torch.float32", t.scalar_type());
  FP8S_CHECK(t.numel() == 1, std::string(name) + ".numel()", "1", t.numel());
  FP8S_CHECK(t.device() == like.device(), std::string(name) + ".device", like.device(), t.device());
}

void check_slot(int64_t slot, int64_t numel) {
  TORCH_CHECK_VALUE(slot >= 0 && slot < numel, "fp8state: slot: expected 0 <= slot < ", std::to_string(numel),
                    ", got ", std::to_string(slot));
}

void check_input(const at::Tensor& x, at::ScalarType dtype) {
  FP8S_CHECK(x.is_cuda(), "x.device", "a CUDA tensor", x.device());
  const auto st = x.scalar_type();
  FP8S_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "x.dtype",
             "one of [torch.float32, torch.bfloat16, torch.float16]", st);
  FP8S_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2, "dtype",
             "one of [torch.float8_e4m3fn, torch.float8_e5m2]", dtype);
}

at::Tensor launch_quantize(const at::Tensor& x_in, const at::Tensor& scale, at::ScalarType dtype, float* slot,
                           bool gelu = false) {
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
      scale.data_ptr<float>(), slot, n)
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

at::Tensor quantize_fp8_cuda(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype) {
  check_input(x, dtype);
  check_scalar(scale, "scale", x);
  return launch_quantize(x, scale, dtype, nullptr);
}

// The amax_pending cell of ``slot``, after checking the buffer against x.
float* pending_cell(const at::Tensor& amax_pending, int64_t slot, const at::Tensor& x) {
  FP8S_CHECK(amax_pending.scalar_type() == at::kFloat, "amax_pending.dtype", "torch.float32",
             amax_pending.scalar_type());
  FP8S_CHECK(amax_pending.dim() == 1, "amax_pending.dim()", "1", amax_pending.dim());
  FP8S_CHECK(amax_pending.device() == x.device(), "amax_pending.device", x.device(), amax_pending.device());
  check_slot(slot, amax_pending.numel());
  return amax_pending.data_ptr<float>() + slot * amax_pending.stride(0);
}

at::Tensor quantize_fp8_record_amax_cuda(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& amax_pending,
                                         int64_t slot, at::ScalarType dtype) {
  check_input(x, dtype);
  check_scalar(scale, "scale", x);
  return launch_quantize(x, scale, dtype, pending_cell(amax_pending, slot, x));
}

at::Tensor gelu_quantize_fp8_cuda(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype) {
  check_input(x, dtype);
  check_scalar(scale, "scale", x);
  return launch_quantize(x, scale, dtype, nullptr, true);
}

at::Tensor gelu_quantize_fp8_record_amax_cuda(const at::Tensor& x, const at::Tensor& scale,
                                              const at::Tensor& amax_pending, int64_t slot, at::ScalarType dtype) {
  check_input(x, dtype);
  check_scalar(scale, "scale", x);
  return launch_quantize(x, scale, dtype, pending_cell(amax_pending, slot, x), true);
}

// ---------------------------------------------------------------------------------------
// dequantize: 16 FP8 codes per 16-byte load
// ---------------------------------------------------------------------------------------
template <typename T, bool E4M3>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const uint8_t* __restrict__ q, T* __restrict__ out,
                                                              const float* __restrict__ descale_ptr, int64_t n) {
  const float descale = *descale_ptr;
  const int64_t nvec = n / 16;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const uint4* qv = reinterpret_cast<const uint4*>(q);
  constexpr int kOutPer16B = 16 / sizeof(T);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < nvec; i += stride) {
    const uint4 raw = __ldcs(qv + i);
    const uint8_t* c = reinterpret_cast<const uint8_t*>(&raw);
    alignas(16) T vals[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) vals[k] = from_f32<T>(decode1<E4M3>(c[k]) * descale);
    uint4* o = reinterpret_cast<uint4*>(out + i * 16);
#pragma unroll
    for (int k = 0; k < 16 / kOutPer16B; ++k) __stcs(o + k, reinterpret_cast<const uint4*>(vals)[k]);
  }
  if (blockIdx.x == 0) {
    const int64_t t = nvec * 16 + threadIdx.x;
    if (t < n) out[t] = from_f32<T>(decode1<E4M3>(q[t]) * descale);
  }
}

at::Tensor dequantize_fp8_cuda(const at::Tensor& q_in, const at::Tensor& descale, at::ScalarType dtype) {
  FP8S_CHECK(q_in.is_cuda(), "q.device", "a CUDA tensor", q_in.device());
  const auto qt = q_in.scalar_type();
  FP8S_CHECK(qt == at::kFloat8_e4m3fn || qt == at::kFloat8_e5m2, "q.dtype",
             "one of [torch.float8_e4m3fn, torch.float8_e5m2]", qt);
  FP8S_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "dtype",
             "one of [torch.float32, torch.bfloat16, torch.float16]", dtype);
  check_scalar(descale, "descale", q_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  at::Tensor q = q_in.contiguous();
  if (reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 != 0) q = q.clone();
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(dtype));
  const int64_t n = q.numel();
  if (n == 0) return out;
  auto stream = at::cuda::getCurrentCUDAStream();
  const int grid = grid_for(std::max<int64_t>(n / 16, 1) * kUnroll);
  const bool e4m3 = qt == at::kFloat8_e4m3fn;
#define FP8S_DQ(T)                                                                                                \
  if (e4m3)                                                                                                       \
    dequantize_kernel<T, true><<<grid, kThreads, 0, stream>>>(reinterpret_cast<const uint8_t*>(q.data_ptr()),   \
                                                              reinterpret_cast<T*>(out.data_ptr()),             \
                                                              descale.data_ptr<float>(), n);                    \
  else                                                                                                            \
    dequantize_kernel<T, false><<<grid, kThreads, 0, stream>>>(reinterpret_cast<const uint8_t*>(q.data_ptr()),  \
                                                               reinterpret_cast<T*>(out.data_ptr()),            \
                                                               descale.data_ptr<float>(), n);
  switch (dtype) {
    case at::kFloat:
      FP8S_DQ(float);
      break;
    case at::kBFloat16:
      FP8S_DQ(__nv_bfloat16);
      break;
    default:
      FP8S_DQ(__half);
      break;
  }
#undef FP8S_DQ
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// ---------------------------------------------------------------------------------------
// batched scale update: one thread per owner, all owners in one launch
// ---------------------------------------------------------------------------------------
__global__ void update_scales_kernel(float* __restrict__ hist, float* __restrict__ scale,
                                     float* __restrict__ descale, float* __restrict__ pending,
                                     int32_t* __restrict__ nonfinite, const bool* __restrict__ mask,
                                     const float* __restrict__ fmax, int64_t H, int64_t n, int64_t hist_stride,
                                     bool use_max, float pow2_margin) {
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= n || !mask[j]) return;
  const float p = pending[j];
  pending[j] = 0.0f;
  if (!isfinite(p)) {
    nonfinite[j] += 1;
    return;
  }
  float carry = p, amax = p;
  for (int64_t r = 0; r < H; ++r) {
    float* cell = hist + r * hist_stride + j;
    const float old = *cell;
    *cell = carry;
    amax = fmaxf(amax, carry);
    carry = old;
  }
  if (!use_max) amax = p;
  const float candidate = __fdiv_rn(__fdiv_rn(fmax[j], amax), pow2_margin);
  if (amax > 0.0f && isfinite(candidate)) {
    scale[j] = candidate;
    descale[j] = __fdiv_rn(1.0f, candidate);
  }
}

void update_scales_cuda(const at::Tensor& amax_history, const at::Tensor& scale, const at::Tensor& descale,
                        const at::Tensor& amax_pending, const at::Tensor& nonfinite_count,
                        const at::Tensor& commit_mask, const at::Tensor& fmax, c10::string_view amax_algo,
                        int64_t margin) {
  FP8S_CHECK(amax_history.is_cuda(), "amax_history.device", "a CUDA tensor", amax_history.device());
  FP8S_CHECK(amax_history.dim() == 2, "amax_history.dim()", "2 ([history_len, owners])", amax_history.dim());
  const int64_t H = amax_history.size(0), n = amax_history.size(1);
  struct Arg {
    const at::Tensor& t;
    const char* name;
    at::ScalarType dtype;
  };
  const Arg args[] = {{scale, "scale", at::kFloat},          {descale, "descale", at::kFloat},
                      {amax_pending, "amax_pending", at::kFloat}, {nonfinite_count, "nonfinite_count", at::kInt},
                      {commit_mask, "commit_mask", at::kBool},   {fmax, "fmax", at::kFloat}};
  FP8S_CHECK(amax_history.scalar_type() == at::kFloat, "amax_history.dtype", "torch.float32",
             amax_history.scalar_type());
  FP8S_CHECK(amax_history.stride(1) == 1, "amax_history.stride(1)", "1 (rows contiguous)", amax_history.stride(1));
  for (const Arg& a : args) {
    FP8S_CHECK(a.t.scalar_type() == a.dtype, std::string(a.name) + ".dtype", a.dtype, a.t.scalar_type());
    FP8S_CHECK(a.t.device() == amax_history.device(), std::string(a.name) + ".device", amax_history.device(),
               a.t.device());
    FP8S_CHECK(a.t.dim() == 1 && a.t.size(0) == n, std::string(a.name) + ".shape",
               "(" + std::to_string(n) + ",)", a.t.sizes());
    FP8S_CHECK(a.t.stride(0) == 1, std::string(a.name) + ".stride(0)", "1", a.t.stride(0));
  }
  FP8S_CHECK(amax_algo == "max" || amax_algo == "most_recent", "amax_algo", "one of ['max', 'most_recent']",
             std::string(amax_algo));
  FP8S_CHECK(margin >= 0 && margin < 127, "margin", "an integer in [0, 127)", margin);
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(amax_history.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const int threads = 128;
  const int blocks = int((n + threads - 1) / threads);
  update_scales_kernel<<<blocks, threads, 0, stream>>>(
      amax_history.data_ptr<float>(), scale.data_ptr<float>(), descale.data_ptr<float>(),
      amax_pending.data_ptr<float>(), nonfinite_count.data_ptr<int32_t>(), commit_mask.data_ptr<bool>(),
      fmax.data_ptr<float>(), H, n, amax_history.stride(0), amax_algo == "max", ldexpf(1.0f, int(margin)));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---------------------------------------------------------------------------------------
// FP8 transpose: out[C, R] = q[R, C]^T, byte-exact (the codes are moved, never decoded).
// cuBLASLt's FP8 GEMM takes only the TN layout, so the backward needs grad_output, input
// and weight re-laid out; torch's generic strided copy moves single bytes at a fraction of
// the bandwidth. Here one block moves a 128 x 128 byte tile: 16-byte coalesced loads into
// shared memory (XOR-swizzled so the column reads below are bank-conflict free), each thread
// reads a 16-row x 4-column strip as 16 words, transposes 4 x 4 byte blocks with byte
// permutes, and writes four 16-byte runs, so every warp store covers 128 contiguous bytes of
// four output rows. Tiles that are not full (or shapes not multiples of 16) take a simple
// 32 x 32 shared-memory kernel.
// ---------------------------------------------------------------------------------------
constexpr int kTile = 128;

__global__ void __launch_bounds__(256) transpose_tile128_kernel(const uint8_t* __restrict__ in,
                                                                 uint8_t* __restrict__ out, int64_t R, int64_t C) {
  __shared__ uint32_t tile[kTile * kTile / 4];  // 128 rows x 32 words, swizzled
  const int t = threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.x) * kTile, c0 = int64_t(blockIdx.y) * kTile;
  // load: thread t moves 16 bytes of rows (t / 8) + 32 j, bytes 16 (t % 8) ..
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int row = (t >> 3) + 32 * j, col16 = t & 7;
    const uint4 v = *reinterpret_cast<const uint4*>(in + (r0 + row) * C + c0 + col16 * 16);
    const int word = (col16 * 4) ^ (((row >> 4) & 7) << 2);
    *reinterpret_cast<uint4*>(&tile[row * 32 + word]) = v;
  }
  __syncthreads();
  // transpose: thread t owns input rows 16 rg .. 16 rg + 15 and input columns 4 cw .. 4 cw + 3
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

// Any shape, any region [row_begin, row_end) x [col_begin, col_end) of q[R, C]: 32 x 32 tiles
// through shared memory, one byte per access.
__global__ void transpose_simple_kernel(const uint8_t* __restrict__ in, uint8_t* __restrict__ out, int64_t R,
                                        int64_t C, int64_t row_begin, int64_t row_end, int64_t col_begin,
                                        int64_t col_end) {
  __shared__ uint8_t tile[32][33];
  const int64_t r0 = row_begin + int64_t(blockIdx.x) * 32, c0 = col_begin + int64_t(blockIdx.y) * 32;
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    const int64_t r = r0 + i, c = c0 + threadIdx.x;
    if (r < row_end && c < col_end) tile[i][threadIdx.x] = in[r * C + c];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    const int64_t c = c0 + i, r = r0 + threadIdx.x;
    if (r < row_end && c < col_end) out[c * R + r] = tile[threadIdx.x][i];
  }
}

void launch_transpose_simple(const uint8_t* in, uint8_t* out, int64_t R, int64_t C, int64_t row_begin,
                             int64_t row_end, int64_t col_begin, int64_t col_end, cudaStream_t stream) {
  if (row_begin >= row_end || col_begin >= col_end) return;
  const int64_t col_tiles = (col_end - col_begin + 31) / 32;
  TORCH_CHECK(col_tiles <= 65535, "fp8state: transpose_fp8: q.shape[1] too large (more than 2^21 columns)");
  const dim3 grid(unsigned((row_end - row_begin + 31) / 32), unsigned(col_tiles));
  transpose_simple_kernel<<<grid, dim3(32, 8), 0, stream>>>(in, out, R, C, row_begin, row_end, col_begin, col_end);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor transpose_fp8_cuda(const at::Tensor& q) {
  FP8S_CHECK(q.is_cuda(), "q.device", "a CUDA tensor", q.device());
  const auto st = q.scalar_type();
  FP8S_CHECK(st == at::kFloat8_e4m3fn || st == at::kFloat8_e5m2, "q.dtype",
             "one of [torch.float8_e4m3fn, torch.float8_e5m2]", st);
  FP8S_CHECK(q.dim() == 2, "q.dim()", "2", q.dim());
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t R = q.size(0), C = q.size(1);
  at::Tensor out = at::empty({C, R}, q.options());
  if (R == 0 || C == 0) return out;
  if (!q.is_contiguous()) {  // e.g. already a transposed view: a plain strided copy is right
    out.copy_(q.t());
    return out;
  }
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto* in = reinterpret_cast<const uint8_t*>(q.data_ptr());
  auto* dst = reinterpret_cast<uint8_t*>(out.data_ptr());
  const bool vec = R % 16 == 0 && C % 16 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0;
  const int64_t Rt = vec ? R / kTile * kTile : 0, Ct = vec ? C / kTile * kTile : 0;
  if (Rt > 0 && Ct > 0) {
    TORCH_CHECK(Ct / kTile <= 65535, "fp8state: transpose_fp8: q.shape[1] too large (more than 2^23 columns)");
    transpose_tile128_kernel<<<dim3(unsigned(Rt / kTile), unsigned(Ct / kTile)), 256, 0, stream>>>(in, dst, R, C);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    launch_transpose_simple(in, dst, R, C, 0, R, Ct, C, stream);   // right strip, full height
    launch_transpose_simple(in, dst, R, C, Rt, R, 0, Ct, stream);  // bottom strip, left of it
  } else {
    launch_transpose_simple(in, dst, R, C, 0, R, 0, C, stream);
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// LayerNorm + FP8 quantize (+ amax record): a Linear's input written straight as codes.
// Numerics (ops/reference_fused.py reproduces them operation for operation): one CTA of
// kLnThreads per row at a time; thread t holds chunks t, t + kLnThreads, ... of 16 bytes
// (V elements) in registers and sums them in order; warps combine by XOR butterfly, warps
// in order; two passes (mean, then the sum of squared deviations); every float32 operation
// rounded on its own (explicit _rn intrinsics: no fused multiply-add), y rounded to T.
// The CTAs stride over rows and fold their amax into the owner's slot once, at the end.
// ---------------------------------------------------------------------------------------
constexpr int kLnThreads = 256;
constexpr int kLnWarps = kLnThreads / 32;

// Sum over the CTA in the fixed order above; every thread gets the total.
__device__ __forceinline__ float ln_block_sum(float v, float* s_part) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, off));
  if ((threadIdx.x & 31) == 0) s_part[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = s_part[0];
#pragma unroll
  for (int w = 1; w < kLnWarps; ++w) total = __fadd_rn(total, s_part[w]);
  __syncthreads();  // s_part is reused by the next sum
  return total;
}

template <typename T, bool E4M3, int K>
__global__ void __launch_bounds__(kLnThreads)
    layer_norm_quantize_kernel(const T* __restrict__ x, const float* __restrict__ weight,
                               const float* __restrict__ bias, float eps, uint8_t* __restrict__ out,
                               float* __restrict__ mean_out, float* __restrict__ rstd_out,
                               const float* __restrict__ scale_ptr, float* amax_slot, int64_t rows, int d) {
  constexpr int V = 16 / sizeof(T);
  __shared__ float s_part[kLnWarps];
  const int nchunks = d / V;
  const float scale = *scale_ptr;
  const float fd = float(d);
  float amax = 0.0f;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const uint4* xr = reinterpret_cast<const uint4*>(x + row * d);
    float v[K][V];
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = threadIdx.x + k * kLnThreads;
      if (c < nchunks) {
        uint4 raw = __ldcs(xr + c);
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          v[k][i] = to_f32<T>(e[i]);
          acc = __fadd_rn(acc, v[k][i]);
        }
      }
    }
    const float mean = __fdiv_rn(ln_block_sum(acc, s_part), fd);
    float acc2 = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (threadIdx.x + k * kLnThreads < nchunks) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          v[k][i] = __fsub_rn(v[k][i], mean);
          acc2 = __fadd_rn(acc2, __fmul_rn(v[k][i], v[k][i]));
        }
      }
    }
    const float var = __fdiv_rn(ln_block_sum(acc2, s_part), fd);
    const float rstd = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
    if (threadIdx.x == 0) {
      mean_out[row] = from_f32<float>(mean);  // a NaN row: the canonical NaN
      rstd_out[row] = from_f32<float>(rstd);
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = threadIdx.x + k * kLnThreads;
      if (c < nchunks) {
        float y[V];
#pragma unroll
        for (int i = 0; i < V; i += 4) {
          const float4 w4 = weight ? reinterpret_cast<const float4*>(weight)[(c * V + i) / 4] : make_float4(0, 0, 0, 0);
          const float4 b4 = bias ? reinterpret_cast<const float4*>(bias)[(c * V + i) / 4] : make_float4(0, 0, 0, 0);
          const float wv[4] = {w4.x, w4.y, w4.z, w4.w}, bv[4] = {b4.x, b4.y, b4.z, b4.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            float t = __fmul_rn(v[k][i + j], rstd);
            if (weight) t = __fmul_rn(t, wv[j]);
            if (bias) t = __fadd_rn(t, bv[j]);
            t = round_to<T>(t);
            amax = fmax_nan(amax, fabsf(t));
            y[i + j] = t;
          }
        }
        uint32_t words[V / 4];
#pragma unroll
        for (int i = 0; i < V; i += 4) {
          const uint32_t lo = encode2<E4M3>(y[i] * scale, y[i + 1] * scale);
          const uint32_t hi = encode2<E4M3>(y[i + 2] * scale, y[i + 3] * scale);
          words[i / 4] = nan_fix4<E4M3>(lo | (hi << 16));
        }
        uint8_t* o = out + row * d + int64_t(c) * V;
        if constexpr (V == 4) {
          *reinterpret_cast<uint32_t*>(o) = words[0];
        } else {
          *reinterpret_cast<uint2*>(o) = make_uint2(words[0], words[1]);
        }
      }
    }
  }
  if (amax_slot != nullptr) block_fold_amax<kLnThreads>(amax, amax_slot);  // fp8state_common.cuh
}

template <typename T, bool E4M3, int K>
void launch_layer_norm(const at::Tensor& x, const float* w, const float* b, float eps, const at::Tensor& out,
                       const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& scale, float* slot,
                       int64_t rows, int d) {
  static int resident = -1;
  if (resident < 0) {
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, layer_norm_quantize_kernel<T, E4M3, K>,
                                                                 kLnThreads, 0));
    resident = std::max(1, per_sm) * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  }
  const int grid = int(std::max<int64_t>(1, std::min<int64_t>(rows, resident)));
  layer_norm_quantize_kernel<T, E4M3, K><<<grid, kLnThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const T*>(x.data_ptr()), w, b, eps, reinterpret_cast<uint8_t*>(out.data_ptr()),
      mean.data_ptr<float>(), rstd.data_ptr<float>(), scale.data_ptr<float>(), slot, rows, d);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

const float* ln_affine(const c10::optional<at::Tensor>& t, const char* name, const at::Tensor& x, int64_t d,
                       at::Tensor& keep) {
  if (!t.has_value() || !t->defined()) return nullptr;
  FP8S_CHECK(t->scalar_type() == at::kFloat, std::string(name) + ".dtype", "torch.float32", t->scalar_type());
  FP8S_CHECK(t->dim() == 1 && t->size(0) == d, std::string(name) + ".shape", "(" + std::to_string(d) + ",)",
             t->sizes());
  FP8S_CHECK(t->device() == x.device(), std::string(name) + ".device", x.device(), t->device());
  keep = t->contiguous();
  if (reinterpret_cast<uintptr_t>(keep.data_ptr()) % 16 != 0) keep = keep.clone();
  return keep.data_ptr<float>();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_quantize(const at::Tensor& x_in,
                                                                   const c10::optional<at::Tensor>& weight,
                                                                   const c10::optional<at::Tensor>& bias, double eps,
                                                                   const at::Tensor& scale, at::ScalarType dtype,
                                                                   float* slot) {
  check_input(x_in, dtype);
  check_scalar(scale, "scale", x_in);
  FP8S_CHECK(x_in.dim() >= 1, "x.dim()", ">= 1", x_in.dim());
  const int64_t d = x_in.size(-1);
  const int64_t V = 16 / x_in.element_size();
  const int64_t limit = 8 * kLnThreads * V;
  FP8S_CHECK(d > 0 && d % V == 0 && d <= limit, "x.shape[-1]",
             "a positive multiple of " + std::to_string(V) + " up to " + std::to_string(limit), d);
  FP8S_CHECK(eps >= 0, "eps", ">= 0", std::to_string(eps));
  const c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor x = x_in.contiguous();
  if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) x = x.clone();
  at::Tensor keep_w, keep_b;
  const float* w = ln_affine(weight, "weight", x, d, keep_w);
  const float* b = ln_affine(bias, "bias", x, d, keep_b);
  std::vector<int64_t> stats_shape(x.sizes().begin(), x.sizes().end() - 1);
  stats_shape.push_back(1);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(dtype));
  at::Tensor mean = at::empty(stats_shape, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty(stats_shape, x.options().dtype(at::kFloat));
  const int64_t rows = x.numel() / d;
  if (rows == 0) return {out, mean, rstd};
  const bool e4m3 = dtype == at::kFloat8_e4m3fn;
  const bool wide = d / V > 2 * kLnThreads;  // more than 2 chunks a thread: the 8-chunk variant
#define FP8S_LN(T, E)                                                                                          \
  if (wide)                                                                                                    \
    launch_layer_norm<T, E, 8>(x, w, b, float(eps), out, mean, rstd, scale, slot, rows, int(d));             \
  else                                                                                                         \
    launch_layer_norm<T, E, 2>(x, w, b, float(eps), out, mean, rstd, scale, slot, rows, int(d));
#define FP8S_LN_T(T) \
  if (e4m3) {        \
    FP8S_LN(T, true) \
  } else {           \
    FP8S_LN(T, false)\
  }
  switch (x.scalar_type()) {
    case at::kFloat:
      FP8S_LN_T(float);
      break;
    case at::kBFloat16:
      FP8S_LN_T(__nv_bfloat16);
      break;
    default:
      FP8S_LN_T(__half);
      break;
  }
#undef FP8S_LN_T
#undef FP8S_LN
  return {out, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_quantize_fp8_cuda(
    const at::Tensor& x, const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias, double eps,
    const at::Tensor& scale, at::ScalarType dtype) {
  return layer_norm_quantize(x, weight, bias, eps, scale, dtype, nullptr);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_quantize_fp8_record_amax_cuda(
    const at::Tensor& x, const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias, double eps,
    const at::Tensor& scale, const at::Tensor& amax_pending, int64_t slot, at::ScalarType dtype) {
  check_input(x, dtype);
  return layer_norm_quantize(x, weight, bias, eps, scale, dtype, pending_cell(amax_pending, slot, x));
}

}  // namespace

TORCH_LIBRARY_IMPL(fp8state, CUDA, m) {
  m.impl("quantize_fp8", &quantize_fp8_cuda);
  m.impl("quantize_fp8_record_amax", &quantize_fp8_record_amax_cuda);
  m.impl("dequantize_fp8", &dequantize_fp8_cuda);
  m.impl("update_scales", &update_scales_cuda);
  m.impl("transpose_fp8", &transpose_fp8_cuda);
  m.impl("gelu_quantize_fp8", &gelu_quantize_fp8_cuda);
  m.impl("gelu_quantize_fp8_record_amax", &gelu_quantize_fp8_record_amax_cuda);
  m.impl("layer_norm_quantize_fp8", &layer_norm_quantize_fp8_cuda);
  m.impl("layer_norm_quantize_fp8_record_amax", &layer_norm_quantize_fp8_record_amax_cuda);
}
