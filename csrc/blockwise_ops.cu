// CUDA kernels of block-scaled FP8 (quant.recipe fp8_blockwise): one scale per 1x128 tile of an
// activation or gradient, per 128x128 block of a weight, each from its own tile's amax.
// Schemas: lightning_fp8state/ops/library_blockwise.py; the oracle, bit for bit:
// ops/reference_blockwise.py (tests/ops/test_cuda_blockwise.py). Numerics as in fp8_ops.cu and
// dynamic_ops.cu, per tile:
//   amax = max |x| over the tile's own elements (a partial tile at an edge: only those; the
//   loads pad with zeros, which leave the max as it is), NaN-propagating, the canonical NaN;
//   scale = fmax / amax / 2^margin (two IEEE float32 divisions), descale = 1 / scale, unless the
//   amax is zero or not finite or the scale would not be finite: then scale = descale = 1;
//   pow2: the scale's mantissa bits cleared (a subnormal keeps its highest set bit), descale =
//   1 / scale;
//   codes: float32(x) * scale, saturated to +-fmax, rounded to nearest even, NaN -> 0x7F.
//
// quantize_fp8_tile (1x128 tiles of x[R, C]): a warp per four tiles, four elements per lane and
//   tile (a 16-byte or 8-byte load where the row allows it), each tile's amax by shuffles, its
//   codes from registers: one read, one write.
// quantize_fp8_tile_t (128x1 tiles, codes written transposed [C, R]) and quantize_fp8_block
//   (128x128 blocks, codes [R, C] and transposed [C, R]): one CTA of 256 threads per 128 x 128
//   tile of x; thread t holds column t % 128, rows 64 (t / 128) .. + 63 in registers (each warp
//   load reads 32 consecutive elements of a row); the amax per column (tile_t) or over the CTA
//   (block); the codes packed four rows to a word into a shared tile [column][row / 4] (padded
//   to 33 words a row: no bank conflicts either way), then written out as rows of the transpose,
//   consecutive words by consecutive threads. The block kernel also writes the codes in x's own
//   layout from registers (32 consecutive bytes a warp).
// Every launch runs on the current stream; no kernel or wrapper synchronizes the host.
// Status: written without a GPU at hand; not yet run (the test is tests/ops/test_cuda_blockwise.py).

#include "fp8state_common.cuh"
#include "fp8_encode.cuh"

namespace {

constexpr int kBlk = 128;
constexpr int kTileThreads = 256;
constexpr int kHalf = kBlk / (kTileThreads / kBlk);  // rows of the tile a thread holds: 64

__device__ __forceinline__ float amax_canonical(float m) {
  return (__float_as_uint(m) & 0x7fffffffu) > 0x7f800000u ? __uint_as_float(kCanonicalNanF32) : m;
}

// The largest power of two <= s (s >= +0, finite): ops/reference_blockwise.floor_pow2_reference.
__device__ __forceinline__ float floor_pow2(float s) {
  const uint32_t bits = __float_as_uint(s);
  const uint32_t normal = bits & 0x7f800000u;
  if (normal != 0u) return __uint_as_float(normal);
  return bits == 0u ? s : __uint_as_float(1u << (31 - __clz(int(bits))));
}

__device__ __forceinline__ void tile_scale(float amax, float fmax, float pow2_margin, bool pow2, float* scale,
                                           float* descale) {
  const float candidate = __fdiv_rn(__fdiv_rn(fmax, amax), pow2_margin);
  const bool ok = amax > 0.0f && isfinite(amax) && isfinite(candidate);
  float s = ok ? candidate : 1.0f;
  float d = ok ? __fdiv_rn(1.0f, candidate) : 1.0f;
  if (pow2) {
    s = floor_pow2(s);
    d = __fdiv_rn(1.0f, s);
  }
  *scale = s;
  *descale = d;
}

// Four consecutive elements as float32 (p aligned to four elements' bytes).
template <typename T>
__device__ __forceinline__ void load4(const T* p, float* v) {
  if constexpr (sizeof(T) == 4) {
    const uint4 raw = __ldcs(reinterpret_cast<const uint4*>(p));
    v[0] = __uint_as_float(raw.x), v[1] = __uint_as_float(raw.y), v[2] = __uint_as_float(raw.z);
    v[3] = __uint_as_float(raw.w);
  } else {
    const uint2 raw = __ldcs(reinterpret_cast<const uint2*>(p));
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = to_f32<T>(e[k]);
  }
}

// ---------------------------------------------------------------------------------------
// 1x128 tiles: a warp takes kTilesPerWarp consecutive tiles (of the row-major [R, tiles] grid),
// all their loads issued before the first reduction (more bytes in flight per thread)
// ---------------------------------------------------------------------------------------
constexpr int kTilesPerWarp = 4;

template <typename T, bool E4M3>
__global__ void __launch_bounds__(256) tile_kernel(const T* __restrict__ x, uint8_t* __restrict__ q,
                                                   float* __restrict__ scale_out, float* __restrict__ descale_out,
                                                   float* __restrict__ amax_out, int64_t R, int64_t C,
                                                   int64_t tiles_per_row, bool vec, float fmax, float pow2_margin,
                                                   bool pow2) {
  const int lane = threadIdx.x & 31;
  const int64_t first = (int64_t(blockIdx.x) * (256 / 32) + (threadIdx.x >> 5)) * kTilesPerWarp;
  const int64_t total = R * tiles_per_row;
  float v[kTilesPerWarp][4];
#pragma unroll
  for (int u = 0; u < kTilesPerWarp; ++u) {  // the loads (the same tiles for every lane of the warp)
    const int64_t w = first + u;
    if (w >= total) break;
    const int64_t row = w / tiles_per_row, c = (w % tiles_per_row) * kBlk + lane * 4;
    const T* xr = x + row * C;
    if (vec && c + 4 <= C) {
      load4<T>(xr + c, v[u]);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) v[u][k] = c + k < C ? to_f32<T>(xr[c + k]) : 0.0f;
    }
  }
#pragma unroll
  for (int u = 0; u < kTilesPerWarp; ++u) {
    const int64_t w = first + u;
    if (w >= total) break;
    const int64_t row = w / tiles_per_row, c = (w % tiles_per_row) * kBlk + lane * 4;
    const float m = fmax_nan(fmax_nan(fabsf(v[u][0]), fabsf(v[u][1])), fmax_nan(fabsf(v[u][2]), fabsf(v[u][3])));
    const float amax = amax_canonical(fp8state_common::warp_max_nan(m));
    float scale, descale;
    tile_scale(amax, fmax, pow2_margin, pow2, &scale, &descale);
    if (lane == 0) {
      scale_out[w] = scale;  // [row, tile] of the row-major [R, tiles_per_row]
      descale_out[w] = descale;
      amax_out[w] = amax;
    }
    uint8_t* qr = q + row * C;
    if (vec && c + 4 <= C) {
      uint32_t word = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) word |= uint32_t(encode1<E4M3>(v[u][k] * scale)) << (8 * k);
      *reinterpret_cast<uint32_t*>(qr + c) = word;
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (c + k < C) qr[c + k] = encode1<E4M3>(v[u][k] * scale);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// 128 x 128 tiles of x: 128x1 tiles written transposed (BLOCK false) or one 128x128 block in
// both layouts (BLOCK true)
// ---------------------------------------------------------------------------------------
template <typename T, bool E4M3, bool BLOCK>
__global__ void __launch_bounds__(kTileThreads) tile128_kernel(const T* __restrict__ x, uint8_t* __restrict__ q,
                                                               uint8_t* __restrict__ qt, float* __restrict__ scale_out,
                                                               float* __restrict__ descale_out,
                                                               float* __restrict__ amax_out,
                                                               float* __restrict__ descale_t_out, int64_t R, int64_t C,
                                                               bool word_stores, float fmax, float pow2_margin,
                                                               bool pow2) {
  __shared__ uint32_t codes_t[kBlk][kBlk / 4 + 1];  // [column][row / 4], four rows' codes a word
  __shared__ float s_max[2][kBlk];  // per column and half (tile_t); [0][warp] (block)
  const int t = threadIdx.x, cl = t % kBlk, h = t / kBlk;
  const int64_t bx = blockIdx.x, by = blockIdx.y, n_rt = gridDim.x, n_ct = gridDim.y;
  const int64_t r0 = bx * kBlk, c0 = by * kBlk, col = c0 + cl;
  const bool col_in = col < C;
  float v[kHalf];
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    const int64_t r = r0 + h * kHalf + i;
    v[i] = col_in && r < R ? to_f32<T>(x[r * C + col]) : 0.0f;
    m = fmax_nan(m, fabsf(v[i]));
  }
  float amax;
  if constexpr (BLOCK) {  // over the whole CTA
    m = fp8state_common::warp_max_nan(m);
    if ((t & 31) == 0) s_max[0][t >> 5] = m;
    __syncthreads();
    m = 0.0f;
#pragma unroll
    for (int k = 0; k < kTileThreads / 32; ++k) m = fmax_nan(m, s_max[0][k]);
    amax = amax_canonical(m);
  } else {  // per column: the two halves
    s_max[h][cl] = m;
    __syncthreads();
    amax = amax_canonical(fmax_nan(s_max[0][cl], s_max[1][cl]));
  }
  float scale, descale;
  tile_scale(amax, fmax, pow2_margin, pow2, &scale, &descale);
  if constexpr (BLOCK) {
    if (t == 0) {
      scale_out[bx * n_ct + by] = scale;
      descale_out[bx * n_ct + by] = descale;
      amax_out[bx * n_ct + by] = amax;
      descale_t_out[by * n_rt + bx] = descale;
    }
  } else if (h == 0 && col_in) {
    scale_out[col * n_rt + bx] = scale;  // [column, row tile] of [C, n_rt]
    descale_out[col * n_rt + bx] = descale;
    amax_out[col * n_rt + bx] = amax;
  }
#pragma unroll
  for (int i = 0; i < kHalf; i += 4) {
    uint32_t word = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint8_t code = encode1<E4M3>(v[i + k] * scale);
      word |= uint32_t(code) << (8 * k);
      if constexpr (BLOCK) {
        const int64_t r = r0 + h * kHalf + i + k;
        if (col_in && r < R) q[r * C + col] = code;
      }
    }
    codes_t[cl][(h * kHalf + i) / 4] = word;
  }
  __syncthreads();
  // rows c0 .. c0 + 127 of the transpose [C, R], columns r0 .. r0 + 127
  for (int idx = t; idx < kBlk * (kBlk / 4); idx += kTileThreads) {
    const int j = idx / (kBlk / 4), wk = idx % (kBlk / 4);
    const int64_t out_row = c0 + j, r = r0 + int64_t(wk) * 4;
    if (out_row >= C || r >= R) continue;
    const uint32_t word = codes_t[j][wk];
    uint8_t* dst = qt + out_row * R + r;
    if (word_stores && r + 4 <= R) {
      *reinterpret_cast<uint32_t*>(dst) = word;
    } else {
      for (int k = 0; k < 4 && r + k < R; ++k) dst[k] = uint8_t(word >> (8 * k));
    }
  }
}

void check_blockwise_args(const at::Tensor& x, at::ScalarType dtype, int64_t margin) {
  check_input(x, dtype);  // fp8_encode.cuh
  FP8S_CHECK(margin >= 0 && margin <= 126, "margin", "an integer >= 0 and <= 126", margin);
  FP8S_CHECK(x.dim() == 2, "x.dim()", "2", x.dim());
}

inline int64_t n_tiles(int64_t n) { return (n + kBlk - 1) / kBlk; }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_fp8_tile_cuda(const at::Tensor& x_in,
                                                                                  at::ScalarType dtype, int64_t margin,
                                                                                  bool pow2) {
  check_blockwise_args(x_in, dtype, margin);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = contiguous16(x_in);
  const int64_t R = x.size(0), C = x.size(1), tiles = n_tiles(C);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor q = at::empty({R, C}, x.options().dtype(dtype));
  at::Tensor scale = at::empty({R, tiles}, f32), descale = at::empty({R, tiles}, f32), amax = at::empty({R, tiles}, f32);
  if (R == 0 || C == 0) return {q, scale, descale, amax};
  const int64_t blocks = (R * tiles + 8 * kTilesPerWarp - 1) / (8 * kTilesPerWarp);
  TORCH_CHECK(blocks <= 0x7fffffff, "fp8state: quantize_fp8_tile: x too large");
  const bool vec = C % 4 == 0;  // contiguous16: every row then starts aligned for four elements
  const bool e4m3 = dtype == at::kFloat8_e4m3fn;
  const float fmax = e4m3 ? Fp8Traits<true>::kMax : Fp8Traits<false>::kMax;
  const float p2m = ldexpf(1.0f, int(margin));
  auto stream = at::cuda::getCurrentCUDAStream();
  auto* qp = reinterpret_cast<uint8_t*>(q.data_ptr());
#define FP8S_TILE(T, E)                                                                                           \
  tile_kernel<T, E><<<unsigned(blocks), 256, 0, stream>>>(reinterpret_cast<const T*>(x.data_ptr()), qp,           \
                                                          scale.data_ptr<float>(), descale.data_ptr<float>(),     \
                                                          amax.data_ptr<float>(), R, C, tiles, vec, fmax, p2m, pow2)
#define FP8S_TILE_BY_FORMAT(T) \
  if (e4m3)                    \
    FP8S_TILE(T, true);        \
  else                         \
    FP8S_TILE(T, false);
  switch (x.scalar_type()) {
    case at::kFloat:
      FP8S_TILE_BY_FORMAT(float);
      break;
    case at::kBFloat16:
      FP8S_TILE_BY_FORMAT(__nv_bfloat16);
      break;
    default:
      FP8S_TILE_BY_FORMAT(__half);
      break;
  }
#undef FP8S_TILE_BY_FORMAT
#undef FP8S_TILE
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q, scale, descale, amax};
}

// One launch of tile128_kernel over x's 128 x 128 tiles (q, descale_t: the block kernel's only).
template <bool BLOCK>
void launch_tile128(const at::Tensor& x, at::ScalarType dtype, int64_t margin, bool pow2, uint8_t* q, uint8_t* qt,
                    const at::Tensor& scale, const at::Tensor& descale, const at::Tensor& amax, float* descale_t) {
  const int64_t R = x.size(0), C = x.size(1);
  TORCH_CHECK(n_tiles(C) <= 65535, "fp8state: block-scaled quantize: x.shape[1] too large (more than 2^23 columns)");
  TORCH_CHECK(n_tiles(R) <= 0x7fffffff, "fp8state: block-scaled quantize: x.shape[0] too large");
  const dim3 grid{unsigned(n_tiles(R)), unsigned(n_tiles(C)), 1u};
  const bool word_stores = R % 4 == 0;  // every row of the transpose then starts word-aligned
  const bool e4m3 = dtype == at::kFloat8_e4m3fn;
  const float fmax = e4m3 ? Fp8Traits<true>::kMax : Fp8Traits<false>::kMax;
  const float p2m = ldexpf(1.0f, int(margin));
  auto stream = at::cuda::getCurrentCUDAStream();
#define FP8S_T128(T, E)                                                                                           \
  tile128_kernel<T, E, BLOCK><<<grid, kTileThreads, 0, stream>>>(                                                 \
      reinterpret_cast<const T*>(x.data_ptr()), q, qt, scale.data_ptr<float>(), descale.data_ptr<float>(),        \
      amax.data_ptr<float>(), descale_t, R, C, word_stores, fmax, p2m, pow2)
#define FP8S_T128_BY_FORMAT(T) \
  if (e4m3)                    \
    FP8S_T128(T, true);        \
  else                         \
    FP8S_T128(T, false);
  switch (x.scalar_type()) {
    case at::kFloat:
      FP8S_T128_BY_FORMAT(float);
      break;
    case at::kBFloat16:
      FP8S_T128_BY_FORMAT(__nv_bfloat16);
      break;
    default:
      FP8S_T128_BY_FORMAT(__half);
      break;
  }
#undef FP8S_T128_BY_FORMAT
#undef FP8S_T128
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_fp8_tile_t_cuda(const at::Tensor& x_in,
                                                                                    at::ScalarType dtype,
                                                                                    int64_t margin, bool pow2) {
  check_blockwise_args(x_in, dtype, margin);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const int64_t R = x.size(0), C = x.size(1), tiles = n_tiles(R);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor qt = at::empty({C, R}, x.options().dtype(dtype));
  at::Tensor scale = at::empty({C, tiles}, f32), descale = at::empty({C, tiles}, f32), amax = at::empty({C, tiles}, f32);
  if (R == 0 || C == 0) return {qt, scale, descale, amax};
  launch_tile128<false>(x, dtype, margin, pow2, nullptr, reinterpret_cast<uint8_t*>(qt.data_ptr()), scale, descale,
                        amax, nullptr);
  return {qt, scale, descale, amax};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_fp8_block_cuda(
    const at::Tensor& x_in, at::ScalarType dtype, int64_t margin, bool pow2) {
  check_blockwise_args(x_in, dtype, margin);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const int64_t R = x.size(0), C = x.size(1), rt = n_tiles(R), ct = n_tiles(C);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor q = at::empty({R, C}, x.options().dtype(dtype));
  at::Tensor qt = at::empty({C, R}, x.options().dtype(dtype));
  at::Tensor scale = at::empty({rt, ct}, f32), descale = at::empty({rt, ct}, f32), amax = at::empty({rt, ct}, f32);
  at::Tensor descale_t = at::empty({ct, rt}, f32);
  if (R == 0 || C == 0) return {q, scale, descale, amax, qt, descale_t};
  launch_tile128<true>(x, dtype, margin, pow2, reinterpret_cast<uint8_t*>(q.data_ptr()),
                       reinterpret_cast<uint8_t*>(qt.data_ptr()), scale, descale, amax, descale_t.data_ptr<float>());
  return {q, scale, descale, amax, qt, descale_t};
}

}  // namespace

TORCH_LIBRARY_IMPL(fp8state, CUDA, m) {
  m.impl("quantize_fp8_tile", &quantize_fp8_tile_cuda);
  m.impl("quantize_fp8_tile_t", &quantize_fp8_tile_t_cuda);
  m.impl("quantize_fp8_block", &quantize_fp8_block_cuda);
}
