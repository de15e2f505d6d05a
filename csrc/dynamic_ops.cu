// CUDA kernels of the stateless FP8 scalings (quant.recipe fp8_current and fp8_rowwise): the
// scale comes from the call's own amax. Schemas: lightning_fp8state/ops/library_dynamic.py;
// the oracle, bit for bit: ops/reference_dynamic.py. Numerics as in fp8_ops.cu, and
//   scale = fmax / amax / 2^margin (two IEEE float32 divisions, in that order), descale =
//   1 / scale, unless the amax is zero or not finite or the scale would not be finite: then
//   scale = descale = 1 (a stateless call has no earlier scale to keep).
//
// fp8_current (one scale per tensor) needs the whole tensor's amax before its first code, so
// it is two passes: an amax kernel (default-cached loads, so that a tensor the size of an
// activation is still in the 50 MB L2 for the second read), a one-thread kernel that derives
// the scale on the device, and the quantize kernel of fp8_encode.cuh reading that scale.
//
// fp8_rowwise (one scale per row) is one pass: a group of TPR threads (32..256, a power of
// two chosen per shape) owns a row and holds up to K 16-byte loads each in registers, so a
// row of up to TPR * K * 16 bytes (16 Ki bf16 elements at TPR 256) is read from memory once:
// its amax is reduced across the group, the scale derived, and the codes encoded from the
// registers. Longer rows re-read the row (from L2) for the encode; rows that the 16-byte
// loads cannot take (a width not a multiple of 16 bytes, a misaligned base) go element by
// element in the same order.
// Every launch runs on the current stream; no kernel or wrapper synchronizes the host.

#include "fp8state_common.cuh"
#include "fp8_encode.cuh"

namespace {

__device__ __forceinline__ void dynamic_scale(float amax, float fmax, float pow2_margin, float* scale,
                                              float* descale) {
  const float candidate = __fdiv_rn(__fdiv_rn(fmax, amax), pow2_margin);
  const bool ok = amax > 0.0f && isfinite(amax) && isfinite(candidate);
  *scale = ok ? candidate : 1.0f;
  *descale = ok ? __fdiv_rn(1.0f, candidate) : 1.0f;
}

__device__ __forceinline__ float canonical_amax(float m) {
  return (__float_as_uint(m) & 0x7fffffffu) > 0x7f800000u ? __uint_as_float(kCanonicalNanF32) : m;
}

// max |x| over 16 bytes of T, NaN-propagating.
template <typename T>
__device__ __forceinline__ float abs_max16(const uint4& raw, float m) {
  const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int e = 0; e < int(16 / sizeof(T)); ++e) m = fmax_nan(m, fabsf(to_f32<T>(v[e])));
  return m;
}

// ---------------------------------------------------------------------------------------
// fp8_current: amax of the whole tensor into *amax_slot (zeroed by the caller)
// ---------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kThreads) amax_kernel(const T* __restrict__ x, float* amax_slot, int64_t n) {
  constexpr int EPL = 16 / sizeof(T);
  const int64_t nvec = n / EPL;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  float m = 0.0f;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; base < nvec; base += stride * kUnroll) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * stride;
      if (i < nvec) raw[u] = xv[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * stride < nvec) m = abs_max16<T>(raw[u], m);
    }
  }
  if (blockIdx.x == 0) {  // the tail: fewer than EPL elements
    const int64_t t = nvec * EPL + threadIdx.x;
    if (t < n) m = fmax_nan(m, fabsf(to_f32<T>(x[t])));
  }
  block_fold_amax<kThreads>(m, amax_slot);  // fp8state_common.cuh
}

__global__ void current_scale_kernel(const float* __restrict__ amax, float* __restrict__ scale,
                                     float* __restrict__ descale, float fmax, float pow2_margin) {
  dynamic_scale(*amax, fmax, pow2_margin, scale, descale);
}

// The amax of x (one read) and the scale it gives, on the device: (scale, descale, amax), 0-d.
std::tuple<at::Tensor, at::Tensor, at::Tensor> current_scale_cuda(const at::Tensor& x_in, at::ScalarType dtype,
                                                                  int64_t margin) {
  check_input(x_in, dtype);
  FP8S_CHECK(margin >= 0 && margin < 127, "margin", "an integer in [0, 127)", margin);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = contiguous16(x_in);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor amax = at::zeros(c10::IntArrayRef(), f32);
  at::Tensor scale = at::empty(c10::IntArrayRef(), f32), descale = at::empty(c10::IntArrayRef(), f32);
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t n = x.numel();
  if (n > 0) {
    const int grid = grid_for(std::max<int64_t>(n * int64_t(x.element_size()) / 16, 1));
    switch (x.scalar_type()) {
      case at::kFloat:
        amax_kernel<float><<<grid, kThreads, 0, stream>>>(x.data_ptr<float>(), amax.data_ptr<float>(), n);
        break;
      case at::kBFloat16:
        amax_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(
            reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), amax.data_ptr<float>(), n);
        break;
      default:
        amax_kernel<__half><<<grid, kThreads, 0, stream>>>(reinterpret_cast<const __half*>(x.data_ptr()),
                                                           amax.data_ptr<float>(), n);
        break;
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const float fmax = dtype == at::kFloat8_e4m3fn ? Fp8Traits<true>::kMax : Fp8Traits<false>::kMax;
  current_scale_kernel<<<1, 1, 0, stream>>>(amax.data_ptr<float>(), scale.data_ptr<float>(),
                                            descale.data_ptr<float>(), fmax, ldexpf(1.0f, int(margin)));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {scale, descale, amax};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_fp8_current_cuda(const at::Tensor& x,
                                                                                     at::ScalarType dtype,
                                                                                     int64_t margin) {
  auto [scale, descale, amax] = current_scale_cuda(x, dtype, margin);
  at::Tensor q = launch_quantize(x, scale, dtype, nullptr);
  return {q, scale, descale, amax};
}

// ---------------------------------------------------------------------------------------
// fp8_rowwise: one group of tpr threads per row, the row's amax then its codes
// ---------------------------------------------------------------------------------------
// The per-row and per-column ops' argument checks, and their outputs: x made contiguous16, the
// codes ([R, C], or [C, R] transposed), and the scale, descale and amax of each row (column) [n, 1].
void check_scaled_args(const at::Tensor& x, at::ScalarType dtype, int64_t margin) {
  check_input(x, dtype);
  FP8S_CHECK(x.dim() == 2, "x.dim()", "2", x.dim());
  FP8S_CHECK(margin >= 0 && margin < 127, "margin", "an integer in [0, 127)", margin);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> scaled_outputs(const at::Tensor& x_in,
                                                                                      at::ScalarType dtype,
                                                                                      bool transposed) {
  at::Tensor x = contiguous16(x_in);
  const int64_t R = x.size(0), C = x.size(1), n = transposed ? C : R;
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor q = transposed ? at::empty({C, R}, x.options().dtype(dtype)) : at::empty({R, C}, x.options().dtype(dtype));
  return {x, q, at::empty({n, 1}, f32), at::empty({n, 1}, f32), at::empty({n, 1}, f32)};
}

constexpr int kRowThreads = 256;
constexpr int kRowRegs = 8;  // 16-byte loads held in registers per thread

template <typename T, bool E4M3>
__global__ void __launch_bounds__(kRowThreads) rowwise_kernel(const T* __restrict__ x, uint8_t* __restrict__ q,
                                                              float* __restrict__ scale_out,
                                                              float* __restrict__ descale_out,
                                                              float* __restrict__ amax_out, int64_t R, int64_t C,
                                                              int tpr, bool vec, float fmax, float pow2_margin) {
  using Cd = Codec<T>;
  constexpr int EPL = 16 / sizeof(T);
  constexpr int WPL = EPL / 4;  // words of codes per 16-byte load
  __shared__ float s_max[kRowThreads / 32];
  const int rows_per_block = kRowThreads / tpr;
  const int lane = threadIdx.x % tpr;
  const int64_t row = int64_t(blockIdx.x) * rows_per_block + threadIdx.x / tpr;
  const bool active = row < R;
  const int64_t nvec = vec ? C / EPL : 0;
  const bool resident = vec && nvec <= int64_t(tpr) * kRowRegs;
  const T* xr = x + (active ? row : 0) * C;
  uint8_t* qr = q + (active ? row : 0) * C;
  const uint4* xv = reinterpret_cast<const uint4*>(xr);
  uint4 reg[kRowRegs];
  float m = 0.0f;
  if (active) {
    if (resident) {
#pragma unroll
      for (int k = 0; k < kRowRegs; ++k) {
        const int64_t i = lane + int64_t(k) * tpr;
        if (i < nvec) reg[k] = xv[i];
      }
#pragma unroll
      for (int k = 0; k < kRowRegs; ++k) {
        if (lane + int64_t(k) * tpr < nvec) m = abs_max16<T>(reg[k], m);
      }
    } else if (vec) {
      for (int64_t i = lane; i < nvec; i += tpr) m = abs_max16<T>(xv[i], m);
    } else {
      for (int64_t c = lane; c < C; c += tpr) m = fmax_nan(m, fabsf(to_f32<T>(xr[c])));
    }
  }
  // the row's amax: over each warp, then over the tpr / 32 warps of the row's group
  m = fp8state_common::warp_max_nan(m);
  const int warp = threadIdx.x >> 5, first = (threadIdx.x / tpr) * (tpr >> 5);
  if ((threadIdx.x & 31) == 0) s_max[warp] = m;
  __syncthreads();
  m = 0.0f;
  for (int w = 0; w < (tpr >> 5); ++w) m = fmax_nan(m, s_max[first + w]);
  if (!active) return;
  const float amax = canonical_amax(m);
  float scale, descale;
  dynamic_scale(amax, fmax, pow2_margin, &scale, &descale);
  if (lane == 0) {
    amax_out[row] = amax;
    scale_out[row] = scale;
    descale_out[row] = descale;
  }
  typename Cd::Acc unused = Cd::zero();
  uint32_t no_clips = 0;  // (a row's own scale: nothing clips, and nothing is counted)
  auto emit = [&](const uint4& raw, int64_t i) {
    uint32_t words[WPL];
    Cd::template encode<E4M3, false>(raw, scale, words, unused, no_clips);
    if constexpr (WPL == 2) {
      *reinterpret_cast<uint2*>(qr + i * EPL) = make_uint2(words[0], words[1]);
    } else {
      *reinterpret_cast<uint32_t*>(qr + i * EPL) = words[0];
    }
  };
  if (resident) {  // the codes from the registers
#pragma unroll
    for (int k = 0; k < kRowRegs; ++k) {
      const int64_t i = lane + int64_t(k) * tpr;
      if (i < nvec) emit(reg[k], i);
    }
  } else if (vec) {  // a row longer than tpr * kRowRegs loads: read again (from L2)
    for (int64_t i = lane; i < nvec; i += tpr) emit(xv[i], i);
  } else {
    for (int64_t c = lane; c < C; c += tpr) qr[c] = encode1<E4M3>(to_f32<T>(xr[c]) * scale);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_fp8_rowwise_cuda(const at::Tensor& x_in,
                                                                                     at::ScalarType dtype,
                                                                                     int64_t margin) {
  check_scaled_args(x_in, dtype, margin);
  const c10::cuda::CUDAGuard guard(x_in.device());
  auto [x, q, scale, descale, amax] = scaled_outputs(x_in, dtype, /*transposed=*/false);
  const int64_t R = x.size(0), C = x.size(1);
  if (R == 0) return {q, scale, descale, amax};
  const int64_t epl = 16 / int64_t(x.element_size());
  const bool vec = C % epl == 0;  // contiguous16: the base is aligned, so is every row then
  const int64_t per_row = vec ? (C / epl + kRowRegs - 1) / kRowRegs : (C + kRowRegs - 1) / kRowRegs;
  int tpr = 32;
  while (tpr < kRowThreads && tpr < per_row) tpr *= 2;
  const int64_t rows_per_block = kRowThreads / tpr;
  const int64_t blocks = (R + rows_per_block - 1) / rows_per_block;
  TORCH_CHECK(blocks <= 0x7fffffff, "fp8state: quantize_fp8_rowwise: x.shape[0] too large");
  auto stream = at::cuda::getCurrentCUDAStream();
  const bool e4m3 = dtype == at::kFloat8_e4m3fn;
  const float fmax = e4m3 ? Fp8Traits<true>::kMax : Fp8Traits<false>::kMax;
  const float pow2 = ldexpf(1.0f, int(margin));
  auto* qp = reinterpret_cast<uint8_t*>(q.data_ptr());
#define FP8S_ROW(T, E)                                                                                             \
  rowwise_kernel<T, E><<<unsigned(blocks), kRowThreads, 0, stream>>>(                                              \
      reinterpret_cast<const T*>(x.data_ptr()), qp, scale.data_ptr<float>(), descale.data_ptr<float>(),            \
      amax.data_ptr<float>(), R, C, tpr, vec, fmax, pow2)
#define FP8S_ROW_BY_FORMAT(T) \
  if (e4m3)                   \
    FP8S_ROW(T, true);        \
  else                        \
    FP8S_ROW(T, false);
  switch (x.scalar_type()) {
    case at::kFloat:
      FP8S_ROW_BY_FORMAT(float);
      break;
    case at::kBFloat16:
      FP8S_ROW_BY_FORMAT(__nv_bfloat16);
      break;
    default:
      FP8S_ROW_BY_FORMAT(__half);
      break;
  }
#undef FP8S_ROW_BY_FORMAT
#undef FP8S_ROW
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q, scale, descale, amax};
}

// ---------------------------------------------------------------------------------------
// fp8_rowwise's backward operands scaled per column, written transposed: codes of x^T [C, R]
// with one scale per column of x, i.e. quantize_fp8_rowwise(x^T) without materializing x^T in
// high precision (cuBLASLt's FP8 GEMM takes K-major operands only, and the weight gradient's
// K is the token dimension). Three launches:
//   colwise_amax_kernel: blocks of 256 threads over a 128-column strip and a chunk of rows,
//     16-byte loads along the row; each column's max over the chunk reduced in shared memory
//     and folded into amax_bits[c] with atomicMax on the float's bits (every value is >= +0 or
//     the canonical NaN, whose bits order as the floats do: the result does not depend on the
//     order of the folds);
//   colwise_scale_kernel: each column's scale and descale from its amax (dynamic_scale);
//   colwise_t_kernel: 128 x 128 tiles as quantize_t_kernel (fp8_ops.cu) reads them, each
//     element encoded with its column's scale, the codes written transposed from a swizzled
//     shared tile (store_tile_transposed).
// ---------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(256) colwise_amax_kernel(const T* __restrict__ x, unsigned* __restrict__ amax_bits,
                                                           int64_t R, int64_t C, int64_t rows_per_block, bool vec) {
  constexpr int EPL = 16 / sizeof(T);
  constexpr int LPR = kTile / EPL;
  constexpr int RPP = 256 / LPR;
  __shared__ float s_max[RPP][kTile];
  const int t = threadIdx.x, i = t / LPR, g = t % LPR;
  const int64_t c0 = int64_t(blockIdx.y) * kTile;
  const int64_t rb = int64_t(blockIdx.x) * rows_per_block;
  const int64_t re = rb + rows_per_block < R ? rb + rows_per_block : R;
  float m[EPL];
#pragma unroll
  for (int e = 0; e < EPL; ++e) m[e] = 0.0f;
  if (vec && c0 + kTile <= C) {
    for (int64_t r = rb + i; r < re; r += RPP) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(x + r * C + c0 + g * EPL));
      const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int e = 0; e < EPL; ++e) m[e] = fmax_nan(m[e], fabsf(to_f32<T>(v[e])));
    }
  } else {
    for (int64_t r = rb + i; r < re; r += RPP) {
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        const int64_t c = c0 + g * EPL + e;
        if (c < C) m[e] = fmax_nan(m[e], fabsf(to_f32<T>(x[r * C + c])));
      }
    }
  }
#pragma unroll
  for (int e = 0; e < EPL; ++e) s_max[i][g * EPL + e] = m[e];
  __syncthreads();
  if (t < kTile && c0 + t < C) {
    float mm = 0.0f;
#pragma unroll
    for (int k = 0; k < RPP; ++k) mm = fmax_nan(mm, s_max[k][t]);
    atomicMax(amax_bits + c0 + t, __float_as_uint(canonical_amax(mm)));
  }
}

__global__ void colwise_scale_kernel(const unsigned* __restrict__ amax_bits, float* __restrict__ scale,
                                     float* __restrict__ descale, float* __restrict__ amax_out, int64_t C, float fmax,
                                     float pow2_margin) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const float amax = __uint_as_float(amax_bits[c]);
  amax_out[c] = amax;
  dynamic_scale(amax, fmax, pow2_margin, scale + c, descale + c);
}

template <typename T, bool E4M3>
__global__ void __launch_bounds__(256) colwise_t_kernel(const T* __restrict__ x, uint8_t* __restrict__ qt,
                                                        const float* __restrict__ col_scale, int64_t R, int64_t C,
                                                        bool vec_ok, bool vec_t) {
  constexpr int EPL = 16 / sizeof(T);
  constexpr int LPR = kTile / EPL;
  constexpr int RPP = 256 / LPR;
  constexpr int P = kTile / RPP;
  constexpr int WPL = EPL / 4;  // words of codes per load
  __shared__ uint32_t tile[kTile * kTile / 4];  // 128 rows x 32 words of codes, swizzled
  const int t = threadIdx.x, i = t / LPR, g = t % LPR;
  const int64_t r0 = int64_t(blockIdx.x) * kTile, c0 = int64_t(blockIdx.y) * kTile;
  const bool full = vec_ok && r0 + kTile <= R && c0 + kTile <= C;
  if (full) {
    float sc[EPL];
#pragma unroll
    for (int e = 0; e < EPL; ++e) sc[e] = col_scale[c0 + g * EPL + e];
    uint4 raw[P];
#pragma unroll
    for (int j = 0; j < P; ++j) raw[j] = __ldcs(reinterpret_cast<const uint4*>(x + (r0 + i + RPP * j) * C + c0 + g * EPL));
#pragma unroll
    for (int j = 0; j < P; ++j) {
      const int row = i + RPP * j;
      const T* v = reinterpret_cast<const T*>(&raw[j]);
      uint32_t words[WPL];
#pragma unroll
      for (int w = 0; w < WPL; ++w) {
        uint32_t word = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          word |= uint32_t(encode1<E4M3>(to_f32<T>(v[4 * w + k]) * sc[4 * w + k])) << (8 * k);
        }
        words[w] = word;
      }
      const int word = (g * WPL) ^ (((row >> 4) & 7) << 2);
#pragma unroll
      for (int w = 0; w < WPL; ++w) tile[row * 32 + word + w] = words[w];
    }
  } else {
    uint8_t* tile_bytes = reinterpret_cast<uint8_t*>(tile);
    for (int j = 0; j < P; ++j) {
      const int row = i + RPP * j;
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        const int col = g * EPL + e;
        const bool in = r0 + row < R && c0 + col < C;
        const float v = in ? to_f32<T>(x[(r0 + row) * C + c0 + col]) : 0.0f;
        const float scale = c0 + col < C ? col_scale[c0 + col] : 1.0f;
        tile_bytes[tile_byte(row, col)] = encode1<E4M3>(v * scale);
      }
    }
  }
  __syncthreads();
  if (full && vec_t) {
    store_tile_transposed(tile, qt, R, r0, c0);
  } else {
    store_tile_transposed_partial(tile, qt, R, C, r0, c0);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_fp8_colwise_cuda(const at::Tensor& x_in,
                                                                                     at::ScalarType dtype,
                                                                                     int64_t margin) {
  check_scaled_args(x_in, dtype, margin);
  const c10::cuda::CUDAGuard guard(x_in.device());
  auto [x, qt, scale, descale, amax] = scaled_outputs(x_in, dtype, /*transposed=*/true);
  const int64_t R = x.size(0), C = x.size(1);
  if (C == 0) return {qt, scale, descale, amax};
  const int64_t col_tiles = (C + kTile - 1) / kTile, row_tiles = (R + kTile - 1) / kTile;
  TORCH_CHECK(col_tiles <= 65535, "fp8state: quantize_fp8_colwise: x.shape[1] too large (more than 2^23 columns)");
  TORCH_CHECK(row_tiles <= 0x7fffffff, "fp8state: quantize_fp8_colwise: x.shape[0] too large");
  auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor bits = at::zeros({C}, x.options().dtype(at::kInt));  // +0.0 in every column
  auto* bp = reinterpret_cast<unsigned*>(bits.data_ptr<int>());
  const int64_t epl = 16 / int64_t(x.element_size());
  const bool vec = C % epl == 0;  // contiguous16: the base is aligned, so is every row then
  if (R > 0) {
    // about 1024 blocks: each a 128-column strip and a chunk of rows (a multiple of 16 rows)
    int64_t chunks = (1024 + col_tiles - 1) / col_tiles;
    const int64_t max_chunks = (R + 15) / 16;
    chunks = chunks < max_chunks ? chunks : max_chunks;
    int64_t rows_per_block = (R + chunks - 1) / chunks;
    rows_per_block = (rows_per_block + 15) / 16 * 16;
    chunks = (R + rows_per_block - 1) / rows_per_block;
    const dim3 grid{unsigned(chunks), unsigned(col_tiles), 1u};
    switch (x.scalar_type()) {
      case at::kFloat:
        colwise_amax_kernel<float><<<grid, 256, 0, stream>>>(x.data_ptr<float>(), bp, R, C, rows_per_block, vec);
        break;
      case at::kBFloat16:
        colwise_amax_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(
            reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), bp, R, C, rows_per_block, vec);
        break;
      default:
        colwise_amax_kernel<__half><<<grid, 256, 0, stream>>>(reinterpret_cast<const __half*>(x.data_ptr()), bp, R,
                                                             C, rows_per_block, vec);
        break;
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const bool e4m3 = dtype == at::kFloat8_e4m3fn;
  const float fmax = e4m3 ? Fp8Traits<true>::kMax : Fp8Traits<false>::kMax;
  colwise_scale_kernel<<<unsigned((C + 255) / 256), 256, 0, stream>>>(
      bp, scale.data_ptr<float>(), descale.data_ptr<float>(), amax.data_ptr<float>(), C, fmax,
      ldexpf(1.0f, int(margin)));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (R == 0) return {qt, scale, descale, amax};
  const bool vec_t = R % 16 == 0;  // the transposed tile's 16-byte stores (else byte by byte)
  const dim3 grid{unsigned(row_tiles), unsigned(col_tiles), 1u};
  auto* qp = reinterpret_cast<uint8_t*>(qt.data_ptr());
  const float* sp = scale.data_ptr<float>();
#define FP8S_COL(T, E) \
  colwise_t_kernel<T, E><<<grid, 256, 0, stream>>>(reinterpret_cast<const T*>(x.data_ptr()), qp, sp, R, C, vec, vec_t)
#define FP8S_COL_BY_FORMAT(T) \
  if (e4m3)                   \
    FP8S_COL(T, true);        \
  else                        \
    FP8S_COL(T, false);
  switch (x.scalar_type()) {
    case at::kFloat:
      FP8S_COL_BY_FORMAT(float);
      break;
    case at::kBFloat16:
      FP8S_COL_BY_FORMAT(__nv_bfloat16);
      break;
    default:
      FP8S_COL_BY_FORMAT(__half);
      break;
  }
#undef FP8S_COL_BY_FORMAT
#undef FP8S_COL
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {qt, scale, descale, amax};
}

}  // namespace

TORCH_LIBRARY_IMPL(fp8state, CUDA, m) {
  m.impl("quantize_fp8_current", &quantize_fp8_current_cuda);
  m.impl("quantize_fp8_rowwise", &quantize_fp8_rowwise_cuda);
  m.impl("current_scale", &current_scale_cuda);
  m.impl("quantize_fp8_colwise", &quantize_fp8_colwise_cuda);
}
