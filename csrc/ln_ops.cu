// LayerNorm backward of the fused prologue: dx, dgamma, dbeta from the saved (mean, rstd), in
// one pass over x and dy plus a small second kernel. Schema: lightning_fp8state/ops/library_fused.py;
// reference: ops/reference_ln.py (bit for bit: it documents the order, and its
// backward_geometry() is ln_bwd_geometry() below). Deterministic (fixed reduction orders, no
// float atomics), no host synchronization, allocations sized by the shape only: capturable in
// a CUDA graph.
//
// Stage one (ln_bwd_kernel): one CTA per tile of R consecutive rows, G groups of P threads; a
// group handles one row at a time (rows g, g + G, ... of the tile), thread t holding chunks
// t, t + P, ... (16 bytes each) of the row; the row's two sums are taken like the forward's
// (per thread in order, XOR butterfly, the group's warps in order). Each thread also sums
// dy * xhat and dy of its columns over its group's rows; the CTA adds its groups in order
// into a float32 partial row of dgamma and of dbeta. Stage two (ln_bwd_sum_kernel): per 32
// columns, kSumWarps warps each sum partials w, w + kSumWarps, ... and the warps are added in order.
//
// The RMSNorm's backward (rms_norm_backward; schema: ops/library_rms.py, reference:
// ops/reference_rms.py) is the same kernel without the mean (kRms): xhat = x * rstd, no s1 term
// in dx, dgamma is the weight's gradient and no dbeta is summed.

#include "fp8state_common.cuh"
#include "fp8_encode.cuh"

namespace {

constexpr int kBwdTiles = 528;        // reference_ln.BWD_TILES
constexpr int kBwdMaxThreads = 512;   // reference_ln.BWD_MAX_THREADS
constexpr int kSumWarps = 16;         // reference_ln.SUM_WARPS
constexpr int kBwdMaxChunks = 2048;   // widest row: 8192 float32, 16384 16-bit (the forward's limit)
constexpr int kBwdMaxWarps = kBwdMaxThreads / 32;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct BwdGeometry {
  int width;      // V: elements of a 16-byte chunk
  int rounds;     // K: chunks a thread holds in a row
  int threads;    // P: threads a row (whole warps)
  int groups;     // G: row groups of a CTA
  int64_t rows;   // R: rows of a tile, a multiple of G
  int64_t tiles;  // B: CTAs
};

// reference_ln.backward_geometry: the shape alone decides (every device gives the same bits).
BwdGeometry ln_bwd_geometry(int64_t m, int64_t n, int64_t elem_size) {
  BwdGeometry g;
  g.width = int(16 / elem_size);
  const int64_t chunks = n / g.width;
  g.rounds = int(ceil_div(chunks, kBwdMaxThreads));
  g.threads = int(ceil_div(ceil_div(chunks, g.rounds), 32) * 32);
  g.groups = std::max(1, kBwdMaxThreads / g.threads);
  g.rows = std::max<int64_t>(1, ceil_div(ceil_div(m, kBwdTiles), g.groups)) * g.groups;
  g.tiles = ceil_div(m, g.rows);
  return g;
}

// The two row sums of a group, every thread of the group gets both (s_part: this row's buffer).
__device__ __forceinline__ void group_sum2(float& a, float& b, float (*s_part)[2], int first_warp, int warps) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, off));
    b = __fadd_rn(b, __shfl_xor_sync(0xffffffffu, b, off));
  }
  if ((threadIdx.x & 31) == 0) {
    s_part[threadIdx.x >> 5][0] = a;
    s_part[threadIdx.x >> 5][1] = b;
  }
  __syncthreads();
  a = s_part[first_warp][0];
  b = s_part[first_warp][1];
  for (int w = 1; w < warps; ++w) {
    a = __fadd_rn(a, s_part[first_warp + w][0]);
    b = __fadd_rn(b, s_part[first_warp + w][1]);
  }
}

// One row's data for a thread: its K chunks of x and dy (raw 16-byte words) and the statistics.
template <int K>
struct RowChunks {
  uint4 x[K], dy[K];
  float mean, rstd;
};

template <typename T, int K>
__device__ __forceinline__ void load_row(RowChunks<K>& r, const T* __restrict__ x, const T* __restrict__ dy,
                                         const float* __restrict__ mean, const float* __restrict__ rstd, int64_t row,
                                         bool valid, int t, int P, int nchunks, int n) {
  r.mean = valid && mean != nullptr ? mean[row] : 0.0f;  // (the RMSNorm has none)
  r.rstd = valid ? rstd[row] : 0.0f;
  const uint4* xr = reinterpret_cast<const uint4*>(x + row * n);
  const uint4* dr = reinterpret_cast<const uint4*>(dy + row * n);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = t + k * P;
    if (valid && c < nchunks) {
      r.x[k] = __ldcs(xr + c);
      r.dy[k] = __ldcs(dr + c);
    } else {
      r.x[k] = r.dy[k] = make_uint4(0, 0, 0, 0);
    }
  }
}

template <typename T>
__device__ __forceinline__ float elem(const uint4& raw, int i) {
  return to_f32<T>(reinterpret_cast<const T*>(&raw)[i]);
}

// The normalized element: (x - mean) * rstd for the LayerNorm, x * rstd for the RMSNorm.
template <bool kRms>
__device__ __forceinline__ float normalized(float x, float mean, float rstd) {
  return kRms ? __fmul_rn(x, rstd) : __fmul_rn(__fsub_rn(x, mean), rstd);
}

// kRms: the RMSNorm's backward (no mean: no s1 term in dx, no dbeta; dgamma is dweight).
template <typename T, int K, bool kRms>
__global__ void __launch_bounds__(kBwdMaxThreads)
    ln_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mean,
                  const float* __restrict__ rstd, const float* __restrict__ weight, T* __restrict__ dx,
                  float* __restrict__ partial, int64_t m, int n, int P, int G, int64_t R) {
  constexpr int V = 16 / sizeof(T);
  constexpr bool kPrefetch = K == 1;  // the next row's loads in flight during this row's sums
  __shared__ float s_part[2][kBwdMaxWarps][2];
  extern __shared__ float s_acc[];  // [2][n] when G > 1: the groups' column sums, added in order
  const int nchunks = n / V;
  const int group = threadIdx.x / P;
  const int t = threadIdx.x - group * P;
  const int first_warp = group * (P >> 5);
  const int warps = P >> 5;
  const float fn = float(n);
  const int64_t row0 = int64_t(blockIdx.x) * R;
  const int64_t row_end = row0 + R < m ? row0 + R : m;
  const int64_t per_group = R / G;

  // Without weight, g = dy * 1.0: the same bits as dy (a NaN's payload aside, and every NaN
  // output is canonicalized), so one code path serves both.
  float wv[K][V], dg[K][V], db[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = t + k * P;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      wv[k][i] = weight != nullptr && c < nchunks ? weight[c * V + i] : 1.0f;
      dg[k][i] = db[k][i] = 0.0f;
    }
  }

  RowChunks<K> next;
  if (kPrefetch) load_row<T, K>(next, x, dy, mean, rstd, row0 + group, row0 + group < row_end, t, P, nchunks, n);
  for (int64_t i = 0; i < per_group; ++i) {
    const int64_t row = row0 + i * G + group;
    const bool valid = row < row_end;
    RowChunks<K> cur;
    if (kPrefetch) {
      cur = next;
      const int64_t after = row + G;
      if (i + 1 < per_group) load_row<T, K>(next, x, dy, mean, rstd, after, after < row_end, t, P, nchunks, n);
    } else {
      load_row<T, K>(cur, x, dy, mean, rstd, row, valid, t, P, nchunks, n);
    }
    float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = t + k * P;
      if (valid && c < nchunks) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float d = elem<T>(cur.dy[k], e);
          const float xh = normalized<kRms>(elem<T>(cur.x[k], e), cur.mean, cur.rstd);
          const float g = __fmul_rn(d, wv[k][e]);
          if (!kRms) s1 = __fadd_rn(s1, g);
          s2 = __fadd_rn(s2, __fmul_rn(g, xh));
          dg[k][e] = __fadd_rn(dg[k][e], __fmul_rn(d, xh));
          if (!kRms) db[k][e] = __fadd_rn(db[k][e], d);
        }
      }
    }
    group_sum2(s1, s2, s_part[i & 1], first_warp, warps);  // double buffer: one barrier a row
    if (dx == nullptr || !valid) continue;
    const float a = __fdiv_rn(s1, fn), b = __fdiv_rn(s2, fn);
    uint4* out = reinterpret_cast<uint4*>(dx + row * n);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = t + k * P;
      if (c < nchunks) {
        uint4 raw;
        T* o = reinterpret_cast<T*>(&raw);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float d = elem<T>(cur.dy[k], e);
          const float xh = normalized<kRms>(elem<T>(cur.x[k], e), cur.mean, cur.rstd);
          const float g = __fmul_rn(d, wv[k][e]);
          const float centered = kRms ? g : __fsub_rn(g, a);
          o[e] = from_f32<T>(__fmul_rn(__fsub_rn(centered, __fmul_rn(xh, b)), cur.rstd));
        }
        __stcs(out + c, raw);
      }
    }
  }
  if (partial == nullptr) return;
  float* pg = partial + int64_t(blockIdx.x) * n;
  float* pb = partial + (int64_t(gridDim.x) + blockIdx.x) * n;
  if (G == 1) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = t + k * P;
      if (c < nchunks) {
#pragma unroll
        for (int e = 0; e < V; e += 4) {
          reinterpret_cast<float4*>(pg)[(c * V + e) / 4] = make_float4(dg[k][e], dg[k][e + 1], dg[k][e + 2], dg[k][e + 3]);
          reinterpret_cast<float4*>(pb)[(c * V + e) / 4] = make_float4(db[k][e], db[k][e + 1], db[k][e + 2], db[k][e + 3]);
        }
      }
    }
    return;
  }
  float* sg = s_acc;
  float* sb = s_acc + n;
  for (int gi = 0; gi < G; ++gi) {
    if (group == gi) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int c = t + k * P;
        if (c < nchunks) {
#pragma unroll
          for (int e = 0; e < V; ++e) {
            const int j = c * V + e;
            sg[j] = gi == 0 ? dg[k][e] : __fadd_rn(sg[j], dg[k][e]);
            sb[j] = gi == 0 ? db[k][e] : __fadd_rn(sb[j], db[k][e]);
          }
        }
      }
    }
    __syncthreads();
  }
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    pg[j] = sg[j];
    pb[j] = sb[j];
  }
}

__global__ void __launch_bounds__(kSumWarps * 32)
    ln_bwd_sum_kernel(const float* __restrict__ partial, int64_t tiles, int n, float* __restrict__ dgamma,
                      float* __restrict__ dbeta) {
  __shared__ float s[2][kSumWarps][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int col = blockIdx.x * 32 + lane;
  float a = 0.0f, b = 0.0f;
  if (col < n) {
#pragma unroll 8
    for (int64_t j = warp; j < tiles; j += kSumWarps) {
      a = __fadd_rn(a, partial[j * n + col]);
      b = __fadd_rn(b, partial[(tiles + j) * n + col]);
    }
  }
  s[0][warp][lane] = a;
  s[1][warp][lane] = b;
  __syncthreads();
  if (warp != 0 || col >= n) return;
  a = s[0][0][lane];
  b = s[1][0][lane];
#pragma unroll
  for (int w = 1; w < kSumWarps; ++w) {
    a = __fadd_rn(a, s[0][w][lane]);
    b = __fadd_rn(b, s[1][w][lane]);
  }
  if (dgamma != nullptr) dgamma[col] = from_f32<float>(a);
  if (dbeta != nullptr) dbeta[col] = from_f32<float>(b);
}

// mean: nullptr for the RMSNorm (kRms).
template <typename T, int K, bool kRms>
void launch_ln_bwd(const BwdGeometry& geo, const at::Tensor& dy, const at::Tensor& x, const float* mean,
                   const at::Tensor& rstd, const float* w, T* dx, float* partial, int64_t m, int n,
                   cudaStream_t stream) {
  const size_t smem = geo.groups > 1 && partial != nullptr ? size_t(2) * n * sizeof(float) : 0;
  ln_bwd_kernel<T, K, kRms><<<unsigned(geo.tiles), geo.groups * geo.threads, smem, stream>>>(
      reinterpret_cast<const T*>(dy.data_ptr()), reinterpret_cast<const T*>(x.data_ptr()), mean,
      rstd.data_ptr<float>(), w, dx, partial, m, n, geo.threads, geo.groups, geo.rows);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, bool kRms>
void launch_ln_bwd_rounds(const BwdGeometry& geo, const at::Tensor& dy, const at::Tensor& x, const float* mean,
                          const at::Tensor& rstd, const float* w, const at::Tensor& dx, float* partial, int64_t m,
                          int n, cudaStream_t stream) {
  T* out = dx.defined() ? reinterpret_cast<T*>(dx.data_ptr()) : nullptr;
  if (geo.rounds == 1) {
    launch_ln_bwd<T, 1, kRms>(geo, dy, x, mean, rstd, w, out, partial, m, n, stream);
  } else if (geo.rounds == 2) {
    launch_ln_bwd<T, 2, kRms>(geo, dy, x, mean, rstd, w, out, partial, m, n, stream);
  } else {  // 3 or 4 (the chunks past 3 * P do not exist for 3)
    launch_ln_bwd<T, 4, kRms>(geo, dy, x, mean, rstd, w, out, partial, m, n, stream);
  }
}

template <bool kRms>
void launch_ln_bwd_dtype(const BwdGeometry& geo, const at::Tensor& dy, const at::Tensor& x, const float* mean,
                         const at::Tensor& rstd, const float* w, const at::Tensor& dx, float* partial, int64_t m,
                         int n, cudaStream_t stream) {
  switch (x.scalar_type()) {
    case at::kFloat:
      launch_ln_bwd_rounds<float, kRms>(geo, dy, x, mean, rstd, w, dx, partial, m, n, stream);
      break;
    case at::kBFloat16:
      launch_ln_bwd_rounds<__nv_bfloat16, kRms>(geo, dy, x, mean, rstd, w, dx, partial, m, n, stream);
      break;
    default:
      launch_ln_bwd_rounds<__half, kRms>(geo, dy, x, mean, rstd, w, dx, partial, m, n, stream);
      break;
  }
}

using OptTensor = c10::optional<at::Tensor>;

// The checks of library_fused.check_layer_norm_backward_args (library_rms's, for the RMSNorm) on x
// and grad_y, in the same order and message; returns the row width n.
int64_t check_backward_input(const at::Tensor& grad_y, const at::Tensor& x) {
  FP8S_CHECK(x.is_cuda(), "x.device", "a CUDA tensor", x.device());
  const auto st = x.scalar_type();
  FP8S_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "x.dtype",
             "one of [torch.float32, torch.bfloat16, torch.float16]", st);
  FP8S_CHECK(x.dim() >= 1, "x.dim()", ">= 1", x.dim());
  const int64_t n = x.size(-1);
  const int64_t V = 16 / x.element_size();
  const int64_t limit = kBwdMaxChunks * V;
  FP8S_CHECK(n > 0 && n % V == 0 && n <= limit, "x.shape[-1]",
             "a positive multiple of " + std::to_string(V) + " up to " + std::to_string(limit) + " for " +
                 fp8s_dtype_name(st),
             n);
  FP8S_CHECK(grad_y.scalar_type() == st, "grad_y.dtype", st, grad_y.scalar_type());
  FP8S_CHECK(grad_y.sizes() == x.sizes(), "grad_y.shape", x.sizes(), grad_y.sizes());
  FP8S_CHECK(grad_y.device() == x.device(), "grad_y.device", x.device(), grad_y.device());
  return n;
}

// A per-row statistic (mean, rstd): float32, one per row of x, on x's device.
void check_stat(const char* name, const at::Tensor& t, int64_t m, const at::Tensor& x) {
  FP8S_CHECK(t.scalar_type() == at::kFloat, std::string(name) + ".dtype", "torch.float32", t.scalar_type());
  FP8S_CHECK(t.numel() == m, std::string(name) + ".numel()", std::to_string(m) + " (one per row of x)", t.numel());
  FP8S_CHECK(t.device() == x.device(), std::string(name) + ".device", x.device(), t.device());
}

struct NormGrads {
  at::Tensor dx, dgamma, dbeta;  // undefined where not asked for
};

// The backward of the LayerNorm (mean given) or of the RMSNorm (kRms: mean undefined, no dbeta),
// after the checks. w: the checked float32 weight or nullptr.
template <bool kRms>
NormGrads norm_backward(const at::Tensor& grad_y_in, const at::Tensor& x_in, const at::Tensor& mean_in,
                        const at::Tensor& rstd_in, const float* w, int64_t n, bool need_dx, bool need_dg,
                        bool need_db) {
  NormGrads r;
  const bool need_cols = need_dg || need_db;
  if (!need_dx && !need_cols) return r;
  const int64_t m = x_in.numel() / n;
  const auto f32 = x_in.options().dtype(at::kFloat);
  if (need_dg) r.dgamma = at::empty({n}, f32);
  if (need_db) r.dbeta = at::empty({n}, f32);
  if (need_dx) r.dx = at::empty(x_in.sizes(), x_in.options());
  if (m == 0) {
    if (need_dg) r.dgamma.zero_();
    if (need_db) r.dbeta.zero_();
    return r;
  }
  const at::Tensor x = contiguous16(x_in), dy = contiguous16(grad_y_in);
  const at::Tensor rstd = rstd_in.contiguous();
  const at::Tensor mean = kRms ? at::Tensor() : mean_in.contiguous();
  const float* mp = kRms ? nullptr : mean.data_ptr<float>();
  const BwdGeometry geo = ln_bwd_geometry(m, n, x.element_size());
  at::Tensor partial = need_cols ? at::empty({2, geo.tiles, n}, f32) : at::Tensor();
  float* pp = need_cols ? partial.data_ptr<float>() : nullptr;
  auto stream = at::cuda::getCurrentCUDAStream();
  launch_ln_bwd_dtype<kRms>(geo, dy, x, mp, rstd, w, r.dx, pp, m, int(n), stream);
  if (need_cols) {
    ln_bwd_sum_kernel<<<unsigned(ceil_div(n, 32)), kSumWarps * 32, 0, stream>>>(
        pp, geo.tiles, int(n), need_dg ? r.dgamma.data_ptr<float>() : nullptr,
        need_db ? r.dbeta.data_ptr<float>() : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return r;
}

OptTensor defined_or_none(const at::Tensor& t) { return t.defined() ? OptTensor(t) : OptTensor(); }

std::tuple<OptTensor, OptTensor, OptTensor> layer_norm_backward_cuda(const at::Tensor& grad_y,
                                                                     const at::Tensor& x, const at::Tensor& mean,
                                                                     const at::Tensor& rstd, const OptTensor& weight,
                                                                     std::array<bool, 3> output_mask) {
  const int64_t n = check_backward_input(grad_y, x);
  const int64_t m = x.numel() / n;
  check_stat("mean", mean, m, x);
  check_stat("rstd", rstd, m, x);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor keep_w;
  const float* w = ln_affine(weight, "weight", x, n, keep_w);
  const NormGrads r =
      norm_backward<false>(grad_y, x, mean, rstd, w, n, output_mask[0], output_mask[1], output_mask[2]);
  return {defined_or_none(r.dx), defined_or_none(r.dgamma), defined_or_none(r.dbeta)};
}

std::tuple<OptTensor, OptTensor> rms_norm_backward_cuda(const at::Tensor& grad_y, const at::Tensor& x,
                                                        const at::Tensor& rstd, const OptTensor& weight,
                                                        std::array<bool, 2> output_mask) {
  const int64_t n = check_backward_input(grad_y, x);
  check_stat("rstd", rstd, x.numel() / n, x);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor keep_w;
  const float* w = ln_affine(weight, "weight", x, n, keep_w);
  const NormGrads r = norm_backward<true>(grad_y, x, at::Tensor(), rstd, w, n, output_mask[0], output_mask[1], false);
  return {defined_or_none(r.dx), defined_or_none(r.dgamma)};
}

}  // namespace

TORCH_LIBRARY_IMPL(fp8state, CUDA, m) {
  m.impl("layer_norm_backward", &layer_norm_backward_cuda);
  m.impl("rms_norm_backward", &rms_norm_backward_cuda);
}
