// Fused prologues: the op before an Fp8Linear written straight as FP8 codes (and its amax
// recorded), in one pass. Schemas: lightning_fp8state/ops/library_fused.py (library_rms.py for
// the RMSNorm); references: ops/reference_fused.py (reference_rms.py) (bit for bit). The GELU is
// the quantize kernel of fp8_encode.cuh with its GELU stage; the LayerNorm and the RMSNorm have
// their own kernels below (the SwiGLU's are in swiglu_ops.cu).

#include "fp8state_common.cuh"
#include "fp8_encode.cuh"

namespace {

at::Tensor gelu_quantize_fp8_cuda(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype) {
  check_input(x, dtype);
  check_scalar(scale, "scale", x);
  return launch_quantize(x, scale, dtype, nullptr, true);
}

at::Tensor gelu_quantize_fp8_record_amax_cuda(const at::Tensor& x, const at::Tensor& scale,
                                              const at::Tensor& amax_pending, int64_t slot, at::ScalarType dtype,
                                              const c10::optional<at::Tensor>& saturation) {
  check_input(x, dtype);
  check_scalar(scale, "scale", x);
  float* cell = pending_cell(amax_pending, slot, x);
  return launch_quantize(x, scale, dtype, cell, true, clip_cells(saturation, slot, amax_pending, x));
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
                               const float* __restrict__ scale_ptr, float* amax_slot, int64_t rows, int d,
                               ClipCells cells) {
  constexpr int V = 16 / sizeof(T);
  __shared__ float s_part[kLnWarps];
  const int nchunks = d / V;
  const float scale = *scale_ptr;
  const float fd = float(d);
  float amax = 0.0f;
  uint32_t clips = 0;
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
          const float s0 = y[i] * scale, s1 = y[i + 1] * scale, s2 = y[i + 2] * scale, s3 = y[i + 3] * scale;
          clips += clips2<E4M3>(s0, s1) + clips2<E4M3>(s2, s3);
          const uint32_t lo = encode2<E4M3>(s0, s1);
          const uint32_t hi = encode2<E4M3>(s2, s3);
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
  block_add_clips<kLnThreads>(clips, cells, rows * int64_t(d));
}

template <typename T, bool E4M3, int K>
void launch_layer_norm(const at::Tensor& x, const float* w, const float* b, float eps, const at::Tensor& out,
                       const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& scale, float* slot,
                       int64_t rows, int d, ClipCells cells) {
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
      mean.data_ptr<float>(), rstd.data_ptr<float>(), scale.data_ptr<float>(), slot, rows, d, cells);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_quantize(const at::Tensor& x_in,
                                                                   const c10::optional<at::Tensor>& weight,
                                                                   const c10::optional<at::Tensor>& bias, double eps,
                                                                   const at::Tensor& scale, at::ScalarType dtype,
                                                                   float* slot, ClipCells cells = {}) {
  check_input(x_in, dtype);
  check_scalar(scale, "scale", x_in);
  FP8S_CHECK(x_in.dim() >= 1, "x.dim()", ">= 1", x_in.dim());
  const int64_t d = x_in.size(-1);
  const int64_t V = 16 / x_in.element_size();
  const int64_t limit = 8 * kLnThreads * V;
  FP8S_CHECK(d > 0 && d % V == 0 && d <= limit, "x.shape[-1]",
             "a positive multiple of " + std::to_string(V) + " up to " + std::to_string(limit) + " for " +
                 fp8s_dtype_name(x_in.scalar_type()),
             d);
  FP8S_CHECK(eps >= 0, "eps", ">= 0", eps);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = contiguous16(x_in);
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
    launch_layer_norm<T, E, 8>(x, w, b, float(eps), out, mean, rstd, scale, slot, rows, int(d), cells);      \
  else                                                                                                         \
    launch_layer_norm<T, E, 2>(x, w, b, float(eps), out, mean, rstd, scale, slot, rows, int(d), cells);
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

// ---------------------------------------------------------------------------------------
// RMSNorm + FP8 quantize (+ amax record). Numerics (ops/reference_rms.py, operation for
// operation): the LayerNorm's row layout and sum order (ln_block_sum) over x * x, one pass;
// rstd = 1 / sqrt(sumsq / d + eps); y = round_T(round_T(x * rstd) * weight) (the Hugging Face
// Llama convention: normalized in float32, rounded to the input's dtype, then scaled).
// ---------------------------------------------------------------------------------------
template <typename T, bool E4M3, int K>
__global__ void __launch_bounds__(kLnThreads)
    rms_norm_quantize_kernel(const T* __restrict__ x, const float* __restrict__ weight, float eps,
                             uint8_t* __restrict__ out, float* __restrict__ rstd_out,
                             const float* __restrict__ scale_ptr, float* amax_slot, int64_t rows, int d,
                             ClipCells cells) {
  constexpr int V = 16 / sizeof(T);
  __shared__ float s_part[kLnWarps];
  const int nchunks = d / V;
  const float scale = *scale_ptr;
  const float fd = float(d);
  float amax = 0.0f;
  uint32_t clips = 0;
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
          acc = __fadd_rn(acc, __fmul_rn(v[k][i], v[k][i]));
        }
      }
    }
    const float ms = __fdiv_rn(ln_block_sum(acc, s_part), fd);
    const float rstd = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));
    if (threadIdx.x == 0) rstd_out[row] = from_f32<float>(rstd);  // a NaN row: the canonical NaN
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = threadIdx.x + k * kLnThreads;
      if (c < nchunks) {
        float y[V];
#pragma unroll
        for (int i = 0; i < V; i += 4) {
          const float4 w4 = weight ? reinterpret_cast<const float4*>(weight)[(c * V + i) / 4] : make_float4(0, 0, 0, 0);
          const float wv[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            float t = round_to<T>(__fmul_rn(v[k][i + j], rstd));
            if (weight) t = round_to<T>(__fmul_rn(t, wv[j]));
            amax = fmax_nan(amax, fabsf(t));
            y[i + j] = t;
          }
        }
        uint32_t words[V / 4];
#pragma unroll
        for (int i = 0; i < V; i += 4) {
          const float s0 = y[i] * scale, s1 = y[i + 1] * scale, s2 = y[i + 2] * scale, s3 = y[i + 3] * scale;
          clips += clips2<E4M3>(s0, s1) + clips2<E4M3>(s2, s3);
          const uint32_t lo = encode2<E4M3>(s0, s1);
          const uint32_t hi = encode2<E4M3>(s2, s3);
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
  block_add_clips<kLnThreads>(clips, cells, rows * int64_t(d));
}

template <typename T, bool E4M3, int K>
void launch_rms_norm(const at::Tensor& x, const float* w, float eps, const at::Tensor& out, const at::Tensor& rstd,
                     const at::Tensor& scale, float* slot, int64_t rows, int d, ClipCells cells) {
  static int resident = -1;
  if (resident < 0) {
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, rms_norm_quantize_kernel<T, E4M3, K>,
                                                                 kLnThreads, 0));
    resident = std::max(1, per_sm) * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  }
  const int grid = int(std::max<int64_t>(1, std::min<int64_t>(rows, resident)));
  rms_norm_quantize_kernel<T, E4M3, K><<<grid, kLnThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const T*>(x.data_ptr()), w, eps, reinterpret_cast<uint8_t*>(out.data_ptr()),
      rstd.data_ptr<float>(), scale.data_ptr<float>(), slot, rows, d, cells);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The checks of library_rms.check_rms_norm_args (x, dtype, scale, the row width, eps; the weight
// in ln_affine), in the same order and message; returns the row width.
int64_t check_rms_norm_input(const at::Tensor& x, double eps, const at::Tensor& scale, at::ScalarType dtype) {
  check_input(x, dtype);
  check_scalar(scale, "scale", x);
  FP8S_CHECK(x.dim() >= 1, "x.dim()", ">= 1", x.dim());
  const int64_t d = x.size(-1);
  const int64_t V = 16 / x.element_size();
  const int64_t limit = 8 * kLnThreads * V;
  FP8S_CHECK(d > 0 && d % V == 0 && d <= limit, "x.shape[-1]",
             "a positive multiple of " + std::to_string(V) + " up to " + std::to_string(limit) + " for " +
                 fp8s_dtype_name(x.scalar_type()),
             d);
  FP8S_CHECK(eps >= 0, "eps", ">= 0", eps);
  return d;
}

// After check_rms_norm_input (and the amax_pending cell's check, for slot).
std::tuple<at::Tensor, at::Tensor> rms_norm_quantize(const at::Tensor& x_in, const c10::optional<at::Tensor>& weight,
                                                     double eps, const at::Tensor& scale, at::ScalarType dtype,
                                                     float* slot, int64_t d, ClipCells cells = {}) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = contiguous16(x_in);
  at::Tensor keep_w;
  const float* w = ln_affine(weight, "weight", x, d, keep_w);
  std::vector<int64_t> stats_shape(x.sizes().begin(), x.sizes().end() - 1);
  stats_shape.push_back(1);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(dtype));
  at::Tensor rstd = at::empty(stats_shape, x.options().dtype(at::kFloat));
  const int64_t rows = x.numel() / d;
  if (rows == 0) return {out, rstd};
  const int64_t V = 16 / x.element_size();
  const bool e4m3 = dtype == at::kFloat8_e4m3fn;
  const bool wide = d / V > 2 * kLnThreads;  // more than 2 chunks a thread: the 8-chunk variant
#define FP8S_RMS(T, E)                                                                   \
  if (wide)                                                                              \
    launch_rms_norm<T, E, 8>(x, w, float(eps), out, rstd, scale, slot, rows, int(d), cells); \
  else                                                                                   \
    launch_rms_norm<T, E, 2>(x, w, float(eps), out, rstd, scale, slot, rows, int(d), cells);
#define FP8S_RMS_T(T)  \
  if (e4m3) {          \
    FP8S_RMS(T, true)  \
  } else {             \
    FP8S_RMS(T, false) \
  }
  switch (x.scalar_type()) {
    case at::kFloat:
      FP8S_RMS_T(float);
      break;
    case at::kBFloat16:
      FP8S_RMS_T(__nv_bfloat16);
      break;
    default:
      FP8S_RMS_T(__half);
      break;
  }
#undef FP8S_RMS_T
#undef FP8S_RMS
  return {out, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_quantize_fp8_cuda(const at::Tensor& x,
                                                              const c10::optional<at::Tensor>& weight, double eps,
                                                              const at::Tensor& scale, at::ScalarType dtype) {
  const int64_t d = check_rms_norm_input(x, eps, scale, dtype);
  return rms_norm_quantize(x, weight, eps, scale, dtype, nullptr, d);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_quantize_fp8_record_amax_cuda(
    const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps, const at::Tensor& scale,
    const at::Tensor& amax_pending, int64_t slot, at::ScalarType dtype, const c10::optional<at::Tensor>& saturation) {
  const int64_t d = check_rms_norm_input(x, eps, scale, dtype);
  at::Tensor keep_w;
  ln_affine(weight, "weight", x, d, keep_w);  // (checked before the amax_pending cell, as library_rms does)
  float* cell = pending_cell(amax_pending, slot, x);
  return rms_norm_quantize(x, weight, eps, scale, dtype, cell, d, clip_cells(saturation, slot, amax_pending, x));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_quantize_fp8_cuda(
    const at::Tensor& x, const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias, double eps,
    const at::Tensor& scale, at::ScalarType dtype) {
  return layer_norm_quantize(x, weight, bias, eps, scale, dtype, nullptr);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_quantize_fp8_record_amax_cuda(
    const at::Tensor& x, const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias, double eps,
    const at::Tensor& scale, const at::Tensor& amax_pending, int64_t slot, at::ScalarType dtype,
    const c10::optional<at::Tensor>& saturation) {
  check_input(x, dtype);
  float* cell = pending_cell(amax_pending, slot, x);
  return layer_norm_quantize(x, weight, bias, eps, scale, dtype, cell, clip_cells(saturation, slot, amax_pending, x));
}

}  // namespace

TORCH_LIBRARY_IMPL(fp8state, CUDA, m) {
  m.impl("gelu_quantize_fp8", &gelu_quantize_fp8_cuda);
  m.impl("gelu_quantize_fp8_record_amax", &gelu_quantize_fp8_record_amax_cuda);
  m.impl("layer_norm_quantize_fp8", &layer_norm_quantize_fp8_cuda);
  m.impl("layer_norm_quantize_fp8_record_amax", &layer_norm_quantize_fp8_record_amax_cuda);
  m.impl("rms_norm_quantize_fp8", &rms_norm_quantize_fp8_cuda);
  m.impl("rms_norm_quantize_fp8_record_amax", &rms_norm_quantize_fp8_record_amax_cuda);
}
