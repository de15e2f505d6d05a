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
// quantize_fp8_tile (1x128 tiles of x[R, C]): where rows take 16-byte loads (C a multiple of
//   16 / sizeof(T)), tile_vec_kernel: each lane loads 16 bytes of a tile (a tile is 16 lanes of
//   bf16/fp16 or 32 of fp32), kTileLoads loads in flight per thread before the first reduction,
//   each tile's amax by shuffles over its lanes, its codes from registers (Codec, as
//   fp8_rowwise's kernel): one read, one write, the row and tile of each load stepped without a
//   division. Otherwise tile_scalar_kernel: four elements per lane and tile, element loads.
// quantize_fp8_tile_t (128x1 tiles, codes written transposed [C, R]) and quantize_fp8_block
//   (128x128 blocks, codes [R, C] and transposed [C, R]): one CTA of 256 threads per 128 x 128
//   tile of x. A whole tile of a row-aligned x (tile128_vec): as dynamic_ops.cu's colwise kernel
//   reads it, thread t loads 16 bytes of columns (t % LPR) * EPL .. in rows t / LPR + RPP j (every
//   warp load reads whole 256-byte rows), folds its rows per column in registers, then the column
//   maxima over the CTA in shared memory (tile_t: one scale per column, computed by the first 128
//   threads; block: one over the CTA); the codes go into the swizzled shared tile that
//   store_tile_transposed writes out as 16-byte runs of the transpose (the block kernel also
//   writes x's own layout from registers, 8 or 4 bytes a thread and row). A tile at an edge, or an
//   x whose rows are not 16-byte aligned (tile128_scalar): thread t holds column t % 128, rows 64
//   (t / 128) .. + 63, element loads, the codes packed four rows to a word in a padded shared tile.
// Every launch runs on the current stream; no kernel or wrapper synchronizes the host.

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

// ---------------------------------------------------------------------------------------
// 1x128 tiles
// ---------------------------------------------------------------------------------------
constexpr int kTileLoads = 4;  // 16-byte loads in flight per thread (tile_vec_kernel)

// Rows of 16-byte aligned loads: lane l of a warp loads elements (l % LPT) * EPL .. + EPL - 1 of
// tile w0 + l / LPT, then of the tiles TPL, 2 TPL, .. further on (the row-major [R, tpr] grid of
// tiles); a lane past x's columns loads zeros (they leave the max as it is) and stores nothing.
template <typename T, bool E4M3>
__global__ void __launch_bounds__(256) tile_vec_kernel(const T* __restrict__ x, uint8_t* __restrict__ q,
                                                       float* __restrict__ scale_out, float* __restrict__ descale_out,
                                                       float* __restrict__ amax_out, int64_t R, int64_t C, int64_t tpr,
                                                       float fmax, float pow2_margin, bool pow2) {
  using Cd = Codec<T>;
  constexpr int EPL = 16 / sizeof(T);  // elements a load
  constexpr int LPT = kBlk / EPL;      // lanes a tile: 16 (bf16, fp16) or 32 (fp32)
  constexpr int TPL = 32 / LPT;        // tiles a warp load
  constexpr int WPL = EPL / 4;         // words of codes a load
  const int lane = threadIdx.x & 31, tl = lane % LPT;
  const int64_t total = R * tpr;
  int64_t w = (int64_t(blockIdx.x) * (256 / 32) + (threadIdx.x >> 5)) * (kTileLoads * TPL) + lane / LPT;
  int64_t row = w / tpr, tc = w - row * tpr;
  uint4 raw[kTileLoads];
  int64_t off[kTileLoads], tile[kTileLoads];
#pragma unroll
  for (int u = 0; u < kTileLoads; ++u) {
    const int64_t c = tc * kBlk + tl * EPL;
    tile[u] = w;
    off[u] = w < total && c < C ? row * C + c : -1;
    raw[u] = off[u] >= 0 ? __ldcs(reinterpret_cast<const uint4*>(x + off[u])) : make_uint4(0u, 0u, 0u, 0u);
    w += TPL, tc += TPL;
    while (tc >= tpr) tc -= tpr, ++row;
  }
  typename Cd::Acc unused = Cd::zero();
  uint32_t no_clips = 0;  // (a tile's own scale: nothing clips)
#pragma unroll
  for (int u = 0; u < kTileLoads; ++u) {
    const T* e = reinterpret_cast<const T*>(&raw[u]);
    float m = 0.0f;
#pragma unroll
    for (int k = 0; k < EPL; ++k) m = fmax_nan(m, fabsf(to_f32<T>(e[k])));
#pragma unroll
    for (int s = LPT / 2; s > 0; s >>= 1) m = fmax_nan(m, __shfl_xor_sync(0xffffffffu, m, s));
    const float amax = amax_canonical(m);
    float scale, descale;
    tile_scale(amax, fmax, pow2_margin, pow2, &scale, &descale);
    if (tl == 0 && tile[u] < total) {
      scale_out[tile[u]] = scale;  // [row, tile] of the row-major [R, tpr]
      descale_out[tile[u]] = descale;
      amax_out[tile[u]] = amax;
    }
    if (off[u] >= 0) {
      uint32_t words[WPL];
      Cd::template encode<E4M3, false>(raw[u], scale, words, unused, no_clips);
      if constexpr (WPL == 2) {
        *reinterpret_cast<uint2*>(q + off[u]) = make_uint2(words[0], words[1]);
      } else {
        *reinterpret_cast<uint32_t*>(q + off[u]) = words[0];
      }
    }
  }
}

// Rows that 16-byte loads cannot take: a warp per kScalarTiles consecutive tiles, four elements
// per lane and tile, element loads.
constexpr int kScalarTiles = 4;

template <typename T, bool E4M3>
__global__ void __launch_bounds__(256) tile_scalar_kernel(const T* __restrict__ x, uint8_t* __restrict__ q,
                                                          float* __restrict__ scale_out,
                                                          float* __restrict__ descale_out,
                                                          float* __restrict__ amax_out, int64_t R, int64_t C,
                                                          int64_t tpr, float fmax, float pow2_margin, bool pow2) {
  const int lane = threadIdx.x & 31;
  const int64_t first = (int64_t(blockIdx.x) * (256 / 32) + (threadIdx.x >> 5)) * kScalarTiles;
  const int64_t total = R * tpr;
  float v[kScalarTiles][4];
#pragma unroll
  for (int u = 0; u < kScalarTiles; ++u) {  // the loads (the same tiles for every lane of the warp)
    const int64_t w = first + u;
    if (w >= total) break;
    const int64_t row = w / tpr, c = (w % tpr) * kBlk + lane * 4;
#pragma unroll
    for (int k = 0; k < 4; ++k) v[u][k] = c + k < C ? to_f32<T>(x[row * C + c + k]) : 0.0f;
  }
#pragma unroll
  for (int u = 0; u < kScalarTiles; ++u) {
    const int64_t w = first + u;
    if (w >= total) break;
    const int64_t row = w / tpr, c = (w % tpr) * kBlk + lane * 4;
    const float m = fmax_nan(fmax_nan(fabsf(v[u][0]), fabsf(v[u][1])), fmax_nan(fabsf(v[u][2]), fabsf(v[u][3])));
    const float amax = amax_canonical(fp8state_common::warp_max_nan(m));
    float scale, descale;
    tile_scale(amax, fmax, pow2_margin, pow2, &scale, &descale);
    if (lane == 0) {
      scale_out[w] = scale;
      descale_out[w] = descale;
      amax_out[w] = amax;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (c + k < C) q[row * C + c + k] = encode1<E4M3>(v[u][k] * scale);
    }
  }
}

// ---------------------------------------------------------------------------------------
// 128 x 128 tiles of x. Outputs: q (block, pair) and descale_t (block: [n_ct, n_rt]; pair: the
// column tiles' [C, n_rt]); scale, descale, amax [C, n_rt] per column (tile_t), [n_rt, n_ct] per
// block, [R, n_ct] per row tile (pair).
// ---------------------------------------------------------------------------------------
// What a 128 x 128 tile of x gives: its 128x1 column tiles written transposed (quantize_fp8_tile_t),
// one 128x128 block in both layouts (quantize_fp8_block), or its 1x128 row tiles in x's layout and
// its column tiles transposed (quantize_fp8_tile_pair: a gradient's two encodes from one read).
enum Tile128Mode { kColumns = 0, kBlock = 1, kPair = 2 };

struct Tile128Out {
  uint8_t* q;
  uint8_t* qt;
  float* scale;
  float* descale;
  float* amax;
  float* descale_t;
};

// The scale of a block (BLOCK) or of column col of the tile, from the thread the caller names.
template <bool BLOCK>
__device__ __forceinline__ void store_tile_scales(const Tile128Out& o, float amax, float scale, float descale,
                                                  int64_t bx, int64_t by, int64_t n_rt, int64_t n_ct, int64_t col,
                                                  bool writer) {
  if (!writer) return;
  if constexpr (BLOCK) {
    o.scale[bx * n_ct + by] = scale;
    o.descale[bx * n_ct + by] = descale;
    o.amax[bx * n_ct + by] = amax;
    o.descale_t[by * n_rt + bx] = descale;
  } else {
    o.scale[col * n_rt + bx] = scale;  // [column, row tile] of [C, n_rt]
    o.descale[col * n_rt + bx] = descale;
    o.amax[col * n_rt + bx] = amax;
  }
}

// A tile at an edge of x, or of an x whose rows are not 16-byte aligned: thread t holds column
// t % 128, rows 64 (t / 128) .. + 63, element loads; smem as codes_t[128][33] (four rows' codes a
// word, [column][row / 4]).
template <typename T, bool E4M3, bool BLOCK>
__device__ __forceinline__ void tile128_scalar(const T* __restrict__ x, const Tile128Out& o, uint32_t* smem,
                                               float (*s_max)[kBlk], int64_t R, int64_t C, bool word_stores,
                                               float fmax, float pow2_margin, bool pow2) {
  uint32_t(*codes_t)[kBlk / 4 + 1] = reinterpret_cast<uint32_t(*)[kBlk / 4 + 1]>(smem);
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
  store_tile_scales<BLOCK>(o, amax, scale, descale, bx, by, n_rt, n_ct, col, BLOCK ? t == 0 : h == 0 && col_in);
#pragma unroll
  for (int i = 0; i < kHalf; i += 4) {
    uint32_t word = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint8_t code = encode1<E4M3>(v[i + k] * scale);
      word |= uint32_t(code) << (8 * k);
      if constexpr (BLOCK) {
        const int64_t r = r0 + h * kHalf + i + k;
        if (col_in && r < R) o.q[r * C + col] = code;
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
    uint8_t* dst = o.qt + out_row * R + r;
    if (word_stores && r + 4 <= R) {
      *reinterpret_cast<uint32_t*>(dst) = word;
    } else {
      for (int k = 0; k < 4 && r + k < R; ++k) dst[k] = uint8_t(word >> (8 * k));
    }
  }
}

// A whole 128 x 128 tile of a row-aligned x: thread t loads 16 bytes (EPL elements) of columns
// g EPL .. of rows i + RPP j (g = t % LPR, i = t / LPR, j < P); smem as the swizzled tile of
// store_tile_transposed. kPair: o.scale, o.descale, o.amax are the row tiles' [R, C / 128],
// o.descale_t the column tiles' [C, R / 128].
template <typename T, bool E4M3, int MODE>
__device__ __forceinline__ void tile128_vec(const T* __restrict__ x, const Tile128Out& o, uint32_t* tile,
                                            float (*s_max)[kBlk], float* s_scale, int64_t R, int64_t C, bool vec_t,
                                            float fmax, float pow2_margin, bool pow2) {
  constexpr int EPL = 16 / sizeof(T), LPR = kBlk / EPL, RPP = kTileThreads / LPR, P = kBlk / RPP, WPL = EPL / 4;
  const int t = threadIdx.x, i = t / LPR, g = t % LPR, lane = t & 31, warp = t >> 5;
  const int64_t bx = blockIdx.x, by = blockIdx.y, n_rt = gridDim.x, n_ct = gridDim.y;
  const int64_t r0 = bx * kBlk, c0 = by * kBlk;
  uint4 raw[P];
#pragma unroll
  for (int j = 0; j < P; ++j) raw[j] = __ldcs(reinterpret_cast<const uint4*>(x + (r0 + i + RPP * j) * C + c0 + g * EPL));
  float cm[EPL];  // the max of each of this thread's columns over its P rows
#pragma unroll
  for (int e = 0; e < EPL; ++e) cm[e] = 0.0f;
#pragma unroll
  for (int j = 0; j < P; ++j) {
    const T* v = reinterpret_cast<const T*>(&raw[j]);
#pragma unroll
    for (int e = 0; e < EPL; ++e) cm[e] = fmax_nan(cm[e], fabsf(to_f32<T>(v[e])));
  }
  float scale = 1.0f, descale = 1.0f;
  if constexpr (MODE == kBlock) {  // over the whole CTA
    float m = cm[0];
#pragma unroll
    for (int e = 1; e < EPL; ++e) m = fmax_nan(m, cm[e]);
    m = fp8state_common::warp_max_nan(m);
    if (lane == 0) s_max[0][warp] = m;
    __syncthreads();
    m = 0.0f;
#pragma unroll
    for (int k = 0; k < kTileThreads / 32; ++k) m = fmax_nan(m, s_max[0][k]);
    const float amax = amax_canonical(m);
    tile_scale(amax, fmax, pow2_margin, pow2, &scale, &descale);
    store_tile_scales<true>(o, amax, scale, descale, bx, by, n_rt, n_ct, 0, t == 0);
  } else {  // per column: the warps' row slots, then the 128 columns' scales by threads 0..127
#pragma unroll
    for (int s = 16; s >= LPR; s >>= 1) {
#pragma unroll
      for (int e = 0; e < EPL; ++e) cm[e] = fmax_nan(cm[e], __shfl_xor_sync(0xffffffffu, cm[e], s));
    }
    if (lane < LPR) {
#pragma unroll
      for (int e = 0; e < EPL; ++e) s_max[warp][g * EPL + e] = cm[e];
    }
    __syncthreads();
    if (t < kBlk) {
      float m = 0.0f;
#pragma unroll
      for (int k = 0; k < kTileThreads / 32; ++k) m = fmax_nan(m, s_max[k][t]);
      const float amax = amax_canonical(m);
      tile_scale(amax, fmax, pow2_margin, pow2, &scale, &descale);
      s_scale[t] = scale;
      if constexpr (MODE == kPair) {
        o.descale_t[(c0 + t) * n_rt + bx] = descale;  // [column, row tile] of [C, n_rt]
      } else {
        store_tile_scales<false>(o, amax, scale, descale, bx, by, n_rt, n_ct, c0 + t, true);
      }
    }
    __syncthreads();
  }
  typename Codec<T>::Acc unused = Codec<T>::zero();
  uint32_t no_clips = 0;  // (a tile's own scale: nothing clips)
#pragma unroll
  for (int j = 0; j < P; ++j) {
    const int row = i + RPP * j;
    if constexpr (MODE == kPair) {  // row r0 + row's 1x128 tile: the max over its LPR threads
      float m = 0.0f;
      const T* v = reinterpret_cast<const T*>(&raw[j]);
#pragma unroll
      for (int e = 0; e < EPL; ++e) m = fmax_nan(m, fabsf(to_f32<T>(v[e])));
#pragma unroll
      for (int s = LPR / 2; s > 0; s >>= 1) m = fmax_nan(m, __shfl_xor_sync(0xffffffffu, m, s));
      const float amax = amax_canonical(m);
      tile_scale(amax, fmax, pow2_margin, pow2, &scale, &descale);
      if (g == 0) {
        const int64_t at = (r0 + row) * n_ct + by;  // [row, tile] of [R, C / 128]
        o.scale[at] = scale;
        o.descale[at] = descale;
        o.amax[at] = amax;
      }
    }
    uint32_t words[WPL];
    if constexpr (MODE != kColumns) {  // x's own layout: the block's or the row tile's scale
      Codec<T>::template encode<E4M3, false>(raw[j], scale, words, unused, no_clips);
      uint8_t* dst = o.q + (r0 + row) * C + c0 + g * EPL;
      if constexpr (WPL == 2) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
      } else {
        *reinterpret_cast<uint32_t*>(dst) = words[0];
      }
    }
    if constexpr (MODE != kBlock) {  // the transpose's: each column's own scale
      const T* v = reinterpret_cast<const T*>(&raw[j]);
#pragma unroll
      for (int w = 0; w < WPL; ++w) {
        uint32_t word = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          word |= uint32_t(encode1<E4M3>(to_f32<T>(v[4 * w + k]) * s_scale[g * EPL + 4 * w + k])) << (8 * k);
        }
        words[w] = word;
      }
    }
    const int word = (g * WPL) ^ (((row >> 4) & 7) << 2);
#pragma unroll
    for (int w = 0; w < WPL; ++w) tile[row * 32 + word + w] = words[w];
  }
  __syncthreads();
  if (vec_t) {
    store_tile_transposed(tile, o.qt, R, r0, c0);
  } else {
    store_tile_transposed_partial(tile, o.qt, R, C, r0, c0);
  }
}

template <typename T, bool E4M3, int MODE>
__global__ void __launch_bounds__(kTileThreads)
    tile128_kernel(const T* __restrict__ x, Tile128Out o, int64_t R, int64_t C, bool vec, bool word_stores,
                   bool vec_t, float fmax, float pow2_margin, bool pow2) {
  __shared__ uint32_t smem[kBlk * (kBlk / 4 + 1)];  // the codes of the tile (either layout)
  __shared__ float s_max[kTileThreads / 32][kBlk];
  __shared__ float s_scale[kBlk];
  const int64_t r0 = int64_t(blockIdx.x) * kBlk, c0 = int64_t(blockIdx.y) * kBlk;
  if (MODE == kPair || (vec && r0 + kBlk <= R && c0 + kBlk <= C)) {  // kPair: whole tiles only (the host's test)
    tile128_vec<T, E4M3, MODE>(x, o, smem, s_max, s_scale, R, C, vec_t, fmax, pow2_margin, pow2);
  } else if constexpr (MODE != kPair) {
    tile128_scalar<T, E4M3, MODE == kBlock>(x, o, smem, s_max, R, C, word_stores, fmax, pow2_margin, pow2);
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
  const int64_t epl = 16 / int64_t(x.element_size());
  const bool vec = C % epl == 0;  // contiguous16: every row then starts 16-byte aligned
  // a CTA: 8 warps of kTileLoads loads, each load 16 / LPT tiles (tile_vec_kernel); 8 warps of
  // kScalarTiles tiles (tile_scalar_kernel)
  const int64_t per_cta = vec ? 8 * kTileLoads * (32 / (kBlk / epl)) : 8 * kScalarTiles;
  const int64_t blocks = (R * tiles + per_cta - 1) / per_cta;
  TORCH_CHECK(blocks <= 0x7fffffff, "fp8state: quantize_fp8_tile: x too large");
  const bool e4m3 = dtype == at::kFloat8_e4m3fn;
  const float fmax = e4m3 ? Fp8Traits<true>::kMax : Fp8Traits<false>::kMax;
  const float p2m = ldexpf(1.0f, int(margin));
  auto stream = at::cuda::getCurrentCUDAStream();
  auto* qp = reinterpret_cast<uint8_t*>(q.data_ptr());
#define FP8S_TILE(T, E)                                                                                             \
  if (vec)                                                                                                          \
    tile_vec_kernel<T, E><<<unsigned(blocks), 256, 0, stream>>>(reinterpret_cast<const T*>(x.data_ptr()), qp,       \
                                                                scale.data_ptr<float>(), descale.data_ptr<float>(), \
                                                                amax.data_ptr<float>(), R, C, tiles, fmax, p2m, pow2); \
  else                                                                                                              \
    tile_scalar_kernel<T, E><<<unsigned(blocks), 256, 0, stream>>>(                                                 \
        reinterpret_cast<const T*>(x.data_ptr()), qp, scale.data_ptr<float>(), descale.data_ptr<float>(),           \
        amax.data_ptr<float>(), R, C, tiles, fmax, p2m, pow2)
#define FP8S_TILE_BY_FORMAT(T) \
  if (e4m3) {                  \
    FP8S_TILE(T, true);        \
  } else {                     \
    FP8S_TILE(T, false);       \
  }
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

// One launch of tile128_kernel over x's 128 x 128 tiles (what each output holds: Tile128Mode).
template <int MODE>
void launch_tile128(const at::Tensor& x, at::ScalarType dtype, int64_t margin, bool pow2, const Tile128Out& out) {
  const int64_t R = x.size(0), C = x.size(1);
  TORCH_CHECK(n_tiles(C) <= 65535, "fp8state: block-scaled quantize: x.shape[1] too large (more than 2^23 columns)");
  TORCH_CHECK(n_tiles(R) <= 0x7fffffff, "fp8state: block-scaled quantize: x.shape[0] too large");
  const dim3 grid{unsigned(n_tiles(R)), unsigned(n_tiles(C)), 1u};
  const bool vec = C % (16 / int64_t(x.element_size())) == 0;  // contiguous16: every row 16-byte aligned
  const bool word_stores = R % 4 == 0;  // every row of the transpose then starts word-aligned
  const bool vec_t = R % 16 == 0;       // ... and takes the whole tile's 16-byte stores
  const bool e4m3 = dtype == at::kFloat8_e4m3fn;
  const float fmax = e4m3 ? Fp8Traits<true>::kMax : Fp8Traits<false>::kMax;
  const float p2m = ldexpf(1.0f, int(margin));
  auto stream = at::cuda::getCurrentCUDAStream();
#define FP8S_T128(T, E)                                                                                     \
  tile128_kernel<T, E, MODE><<<grid, kTileThreads, 0, stream>>>(reinterpret_cast<const T*>(x.data_ptr()), \
                                                                 out, R, C, vec, word_stores, vec_t, fmax, p2m, pow2)
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
  const at::Tensor x = contiguous16(x_in);
  const int64_t R = x.size(0), C = x.size(1), tiles = n_tiles(R);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor qt = at::empty({C, R}, x.options().dtype(dtype));
  at::Tensor scale = at::empty({C, tiles}, f32), descale = at::empty({C, tiles}, f32), amax = at::empty({C, tiles}, f32);
  if (R == 0 || C == 0) return {qt, scale, descale, amax};
  launch_tile128<kColumns>(x, dtype, margin, pow2,
                        {nullptr, reinterpret_cast<uint8_t*>(qt.data_ptr()), scale.data_ptr<float>(),
                         descale.data_ptr<float>(), amax.data_ptr<float>(), nullptr});
  return {qt, scale, descale, amax};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_fp8_block_cuda(
    const at::Tensor& x_in, at::ScalarType dtype, int64_t margin, bool pow2) {
  check_blockwise_args(x_in, dtype, margin);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = contiguous16(x_in);
  const int64_t R = x.size(0), C = x.size(1), rt = n_tiles(R), ct = n_tiles(C);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor q = at::empty({R, C}, x.options().dtype(dtype));
  at::Tensor qt = at::empty({C, R}, x.options().dtype(dtype));
  at::Tensor scale = at::empty({rt, ct}, f32), descale = at::empty({rt, ct}, f32), amax = at::empty({rt, ct}, f32);
  at::Tensor descale_t = at::empty({ct, rt}, f32);
  if (R == 0 || C == 0) return {q, scale, descale, amax, qt, descale_t};
  launch_tile128<kBlock>(x, dtype, margin, pow2,
                       {reinterpret_cast<uint8_t*>(q.data_ptr()), reinterpret_cast<uint8_t*>(qt.data_ptr()),
                        scale.data_ptr<float>(), descale.data_ptr<float>(), amax.data_ptr<float>(),
                        descale_t.data_ptr<float>()});
  return {q, scale, descale, amax, qt, descale_t};
}

// A gradient's 1x128 tiles (its codes in its own layout) and 128x1 tiles (codes transposed) from one
// read where x is whole 128 x 128 tiles of 16-byte aligned rows; otherwise the two kernels.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_fp8_tile_pair_cuda(
    const at::Tensor& x_in, at::ScalarType dtype, int64_t margin, bool pow2) {
  check_blockwise_args(x_in, dtype, margin);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = contiguous16(x_in);
  const int64_t R = x.size(0), C = x.size(1);
  if (R % kBlk != 0 || C % kBlk != 0 || R == 0 || C == 0) {
    auto [q, scale, descale, amax] = quantize_fp8_tile_cuda(x, dtype, margin, pow2);
    auto [qt, unused_scale, descale_t, unused_amax] = quantize_fp8_tile_t_cuda(x, dtype, margin, pow2);
    return {q, scale, descale, amax, qt, descale_t};
  }
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor q = at::empty({R, C}, x.options().dtype(dtype));
  at::Tensor qt = at::empty({C, R}, x.options().dtype(dtype));
  const int64_t rt = R / kBlk, ct = C / kBlk;
  at::Tensor scale = at::empty({R, ct}, f32), descale = at::empty({R, ct}, f32), amax = at::empty({R, ct}, f32);
  at::Tensor descale_t = at::empty({C, rt}, f32);
  launch_tile128<kPair>(x, dtype, margin, pow2,
                        {reinterpret_cast<uint8_t*>(q.data_ptr()), reinterpret_cast<uint8_t*>(qt.data_ptr()),
                         scale.data_ptr<float>(), descale.data_ptr<float>(), amax.data_ptr<float>(),
                         descale_t.data_ptr<float>()});
  return {q, scale, descale, amax, qt, descale_t};
}

}  // namespace

TORCH_LIBRARY_IMPL(fp8state, CUDA, m) {
  m.impl("quantize_fp8_tile", &quantize_fp8_tile_cuda);
  m.impl("quantize_fp8_tile_t", &quantize_fp8_tile_t_cuda);
  m.impl("quantize_fp8_block", &quantize_fp8_block_cuda);
  m.impl("quantize_fp8_tile_pair", &quantize_fp8_tile_pair_cuda);
}
