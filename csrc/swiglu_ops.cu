// The SwiGLU prologue: silu(gate) * up of a fused gate/up projection's output h [rows, 2I]
// written straight as FP8 codes [rows, I] (and its amax recorded) in one pass, and its backward
// (the gradient of h). Schemas: lightning_fp8state/ops/library_swiglu.py; reference:
// ops/reference_swiglu.py (bit for bit); the float32 math: swiglu_math.cuh.
//
// Elementwise: one work item is W consecutive columns of a row, read from the gate and the up
// half: W = 16 bytes of T (4 float32, 8 bfloat16/float16) when I is a multiple of it (16-byte
// loads), else one element (any even width; the same numerics). Items are strided over a grid
// of at most 8 CTAs an SM; the forward's CTAs fold their amax into the owner's slot once, at the
// end. No host synchronization, allocations sized by the shape only: capturable in a CUDA graph.

#include "fp8state_common.cuh"
#include "fp8_encode.cuh"
#include "swiglu_math.cuh"

namespace {

// W elements of T at p (one 16-byte load when W * sizeof(T) == 16) as float32.
template <typename T, int W>
__device__ __forceinline__ void load_f32(const T* __restrict__ p, float (&f)[W]) {
  if constexpr (W == 1) {
    f[0] = to_f32<T>(p[0]);
  } else {
    static_assert(W * sizeof(T) == 16, "load_f32: W elements must fill 16 bytes");
    uint4 raw = __ldcs(reinterpret_cast<const uint4*>(p));
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < W; ++i) f[i] = to_f32<T>(e[i]);
  }
}

// W float32 values rounded to T (a NaN to the canonical NaN) at p.
template <typename T, int W>
__device__ __forceinline__ void store_t(T* __restrict__ p, const float (&f)[W]) {
  if constexpr (W == 1) {
    p[0] = from_f32<T>(f[0]);
  } else {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < W; ++i) e[i] = from_f32<T>(f[i]);
    __stcs(reinterpret_cast<uint4*>(p), raw);
  }
}

// The W codes of y * scale at p (one byte, or 4 / 8 bytes packed low byte first).
// Adds to ``clips`` how many of them clip (clips2).
template <bool E4M3, int W>
__device__ __forceinline__ void store_codes(uint8_t* __restrict__ p, const float (&y)[W], float scale,
                                            uint32_t& clips) {
  if constexpr (W == 1) {
    const float v = y[0] * scale;
    clips += clips2<E4M3>(v, 0.0f);
    p[0] = encode1<E4M3>(v);
  } else {
    static_assert(W == 4 || W == 8, "store_codes: 1, 4 or 8 codes");
    uint32_t words[W / 4];
#pragma unroll
    for (int i = 0; i < W; i += 4) {
      const float s0 = y[i] * scale, s1 = y[i + 1] * scale, s2 = y[i + 2] * scale, s3 = y[i + 3] * scale;
      clips += clips2<E4M3>(s0, s1) + clips2<E4M3>(s2, s3);
      const uint32_t lo = encode2<E4M3>(s0, s1);
      const uint32_t hi = encode2<E4M3>(s2, s3);
      words[i / 4] = nan_fix4<E4M3>(lo | (hi << 16));
    }
    if constexpr (W == 4) {
      *reinterpret_cast<uint32_t*>(p) = words[0];
    } else {
      *reinterpret_cast<uint2*>(p) = make_uint2(words[0], words[1]);
    }
  }
}

// items = rows * per_row, per_row = I / W; item i covers columns (i % per_row) * W .. + W - 1 of
// row i / per_row, whose codes are out[i * W ..] (out is [rows, I], contiguous).
template <typename T, bool E4M3, bool RECORD, int W>
__global__ void __launch_bounds__(kThreads)
    swiglu_quantize_kernel(const T* __restrict__ h, uint8_t* __restrict__ out, const float* __restrict__ scale_ptr,
                           float* amax_slot, int64_t items, int64_t per_row, int64_t inter, ClipCells cells) {
  const float scale = *scale_ptr;
  float amax = 0.0f;
  uint32_t clips = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < items; i += stride) {
    const int64_t row = i / per_row;
    const T* gate = h + row * 2 * inter + (i - row * per_row) * W;
    float g[W], u[W], y[W];
    load_f32<T, W>(gate, g);
    load_f32<T, W>(gate + inter, u);
#pragma unroll
    for (int e = 0; e < W; ++e) {
      y[e] = fp8state_swiglu::swiglu(g[e], u[e]);
      if (RECORD) amax = fmax_nan(amax, fabsf(y[e]));
    }
    store_codes<E4M3, W>(out + i * W, y, scale, clips);
  }
  if (RECORD) block_fold_amax<kThreads>(amax, amax_slot);  // fp8state_common.cuh
  if (RECORD) block_add_clips<kThreads>(clips, cells, items * W);
}

// The same items; dy is [rows, I], dh [rows, 2I] like h.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ h, T* __restrict__ dh, int64_t items,
                           int64_t per_row, int64_t inter) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < items; i += stride) {
    const int64_t row = i / per_row;
    const int64_t base = row * 2 * inter + (i - row * per_row) * W;
    float g[W], u[W], d[W], dg[W], du[W];
    load_f32<T, W>(h + base, g);
    load_f32<T, W>(h + base + inter, u);
    load_f32<T, W>(dy + i * W, d);
#pragma unroll
    for (int e = 0; e < W; ++e) fp8state_swiglu::swiglu_grad(g[e], u[e], d[e], dg[e], du[e]);
    store_t<T, W>(dh + base, dg);
    store_t<T, W>(dh + base + inter, du);
  }
}

template <typename T, bool E4M3, bool RECORD>
void launch_swiglu_quantize(const at::Tensor& h, const at::Tensor& out, const at::Tensor& scale, float* slot,
                            int64_t rows, int64_t inter, cudaStream_t stream, ClipCells cells) {
  constexpr int W = 16 / sizeof(T);
  const T* hp = reinterpret_cast<const T*>(h.data_ptr());
  uint8_t* op = reinterpret_cast<uint8_t*>(out.data_ptr());
  const float* sp = scale.data_ptr<float>();
  if (inter % W == 0) {
    const int64_t items = rows * (inter / W);
    swiglu_quantize_kernel<T, E4M3, RECORD, W><<<grid_for(items), kThreads, 0, stream>>>(hp, op, sp, slot, items,
                                                                                          inter / W, inter, cells);
  } else {
    const int64_t items = rows * inter;
    swiglu_quantize_kernel<T, E4M3, RECORD, 1><<<grid_for(items), kThreads, 0, stream>>>(hp, op, sp, slot, items,
                                                                                          inter, inter, cells);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_swiglu_backward(const at::Tensor& dy, const at::Tensor& h, const at::Tensor& dh, int64_t rows,
                            int64_t inter, cudaStream_t stream) {
  constexpr int W = 16 / sizeof(T);
  const T* dp = reinterpret_cast<const T*>(dy.data_ptr());
  const T* hp = reinterpret_cast<const T*>(h.data_ptr());
  T* out = reinterpret_cast<T*>(dh.data_ptr());
  if (inter % W == 0) {
    const int64_t items = rows * (inter / W);
    swiglu_backward_kernel<T, W><<<grid_for(items), kThreads, 0, stream>>>(dp, hp, out, items, inter / W, inter);
  } else {
    const int64_t items = rows * inter;
    swiglu_backward_kernel<T, 1><<<grid_for(items), kThreads, 0, stream>>>(dp, hp, out, items, inter, inter);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The checks of library_swiglu.swiglu_width (h.dtype, h.dim(), h.shape[-1]), in the same order
// and message; returns I, the width of h's halves.
int64_t check_swiglu_input(const at::Tensor& h) {
  FP8S_CHECK(h.is_cuda(), "h.device", "a CUDA tensor", h.device());
  const auto st = h.scalar_type();
  FP8S_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "h.dtype",
             "one of [torch.float32, torch.bfloat16, torch.float16]", st);
  FP8S_CHECK(h.dim() >= 1, "h.dim()", ">= 1", h.dim());
  const int64_t width = h.size(-1);
  FP8S_CHECK(width > 0 && width % 2 == 0, "h.shape[-1]", "a positive even number (gate and up halves)", width);
  return width / 2;
}

// library_swiglu.check_swiglu_args: h, then dtype and scale. Returns I.
int64_t check_swiglu_args(const at::Tensor& h, const at::Tensor& scale, at::ScalarType dtype) {
  const int64_t inter = check_swiglu_input(h);
  FP8S_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2, "dtype",
             "one of [torch.float8_e4m3fn, torch.float8_e5m2]", dtype);
  check_scalar(scale, "scale", h);
  return inter;
}

// After check_swiglu_args (and the amax_pending cell's check, for slot).
at::Tensor swiglu_quantize(const at::Tensor& h_in, const at::Tensor& scale, at::ScalarType dtype, float* slot,
                           int64_t inter, ClipCells cells = {}) {
  const c10::cuda::CUDAGuard guard(h_in.device());
  const at::Tensor h = contiguous16(h_in);
  std::vector<int64_t> shape(h.sizes().begin(), h.sizes().end() - 1);
  shape.push_back(inter);
  at::Tensor out = at::empty(shape, h.options().dtype(dtype));
  const int64_t rows = h.numel() / (2 * inter);
  if (rows == 0) return out;
  auto stream = at::cuda::getCurrentCUDAStream();
  const bool e4m3 = dtype == at::kFloat8_e4m3fn, record = slot != nullptr;
#define FP8S_SWIGLU(T)                                                              \
  if (e4m3 && record)                                                               \
    launch_swiglu_quantize<T, true, true>(h, out, scale, slot, rows, inter, stream, cells);   \
  else if (e4m3)                                                                    \
    launch_swiglu_quantize<T, true, false>(h, out, scale, slot, rows, inter, stream, cells);  \
  else if (record)                                                                  \
    launch_swiglu_quantize<T, false, true>(h, out, scale, slot, rows, inter, stream, cells);  \
  else                                                                              \
    launch_swiglu_quantize<T, false, false>(h, out, scale, slot, rows, inter, stream, cells);
  switch (h.scalar_type()) {
    case at::kFloat:
      FP8S_SWIGLU(float);
      break;
    case at::kBFloat16:
      FP8S_SWIGLU(__nv_bfloat16);
      break;
    default:
      FP8S_SWIGLU(__half);
      break;
  }
#undef FP8S_SWIGLU
  return out;
}

at::Tensor swiglu_quantize_fp8_cuda(const at::Tensor& h, const at::Tensor& scale, at::ScalarType dtype) {
  const int64_t inter = check_swiglu_args(h, scale, dtype);
  return swiglu_quantize(h, scale, dtype, nullptr, inter);
}

at::Tensor swiglu_quantize_fp8_record_amax_cuda(const at::Tensor& h, const at::Tensor& scale,
                                                const at::Tensor& amax_pending, int64_t slot, at::ScalarType dtype,
                                                const c10::optional<at::Tensor>& saturation) {
  const int64_t inter = check_swiglu_args(h, scale, dtype);
  float* cell = pending_cell(amax_pending, slot, h);
  return swiglu_quantize(h, scale, dtype, cell, inter, clip_cells(saturation, slot, amax_pending, h));
}

at::Tensor swiglu_backward_cuda(const at::Tensor& grad_y_in, const at::Tensor& h_in) {
  const int64_t inter = check_swiglu_input(h_in);
  const auto st = h_in.scalar_type();
  FP8S_CHECK(grad_y_in.scalar_type() == st, "grad_y.dtype", st, grad_y_in.scalar_type());
  std::vector<int64_t> want(h_in.sizes().begin(), h_in.sizes().end() - 1);
  want.push_back(inter);
  FP8S_CHECK(grad_y_in.sizes() == c10::IntArrayRef(want), "grad_y.shape", c10::IntArrayRef(want), grad_y_in.sizes());
  FP8S_CHECK(grad_y_in.device() == h_in.device(), "grad_y.device", h_in.device(), grad_y_in.device());
  const c10::cuda::CUDAGuard guard(h_in.device());
  const at::Tensor h = contiguous16(h_in), dy = contiguous16(grad_y_in);
  at::Tensor dh = at::empty(h.sizes(), h.options());
  const int64_t rows = h.numel() / (2 * inter);
  if (rows == 0) return dh;
  auto stream = at::cuda::getCurrentCUDAStream();
  switch (st) {
    case at::kFloat:
      launch_swiglu_backward<float>(dy, h, dh, rows, inter, stream);
      break;
    case at::kBFloat16:
      launch_swiglu_backward<__nv_bfloat16>(dy, h, dh, rows, inter, stream);
      break;
    default:
      launch_swiglu_backward<__half>(dy, h, dh, rows, inter, stream);
      break;
  }
  return dh;
}

}  // namespace

TORCH_LIBRARY_IMPL(fp8state, CUDA, m) {
  m.impl("swiglu_quantize_fp8", &swiglu_quantize_fp8_cuda);
  m.impl("swiglu_quantize_fp8_record_amax", &swiglu_quantize_fp8_record_amax_cuda);
  m.impl("swiglu_backward", &swiglu_backward_cuda);
}
