// CUDA kernels for the fp8state ops. Schemas are defined in Python
// (lightning_fp8state/ops/library.py); this file only adds CUDA implementations.
// Every kernel is bit-identical to the pure-torch reference in ops/reference.py:
//   encode: v = float(x) * scale (one fp32 multiply), NaN -> canonical code 0x7F,
//           else clamp to [-max, max] and round to nearest even;
//   decode: float(q) * descale (one fp32 multiply), one rounding to the output dtype,
//           NaN -> the dtype's canonical quiet NaN;
//   amax:   max |x| in fp32, folded into the owner's pending slot; NaN -> canonical NaN
//           (which orders above +inf as an integer, so one atomicMax folds it);
//   clips:  with a saturation counter, the elements with |v| > max (NaN not) added to the
//           owner's count, the elements quantized to its total (one atomicAdd per CTA);
//   update: history roll, max|most_recent, scale = fmax / amax / 2^margin, descale = 1/scale
//           (IEEE divisions), guarded against zero or non-finite amax.
// Every launch runs on the current stream; no kernel or wrapper synchronizes the host.

#include "fp8state_common.cuh"
#include "fp8_encode.cuh"

namespace {

at::Tensor quantize_fp8_cuda(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype) {
  check_input(x, dtype);
  check_scalar(scale, "scale", x);
  return launch_quantize(x, scale, dtype, nullptr);
}

at::Tensor quantize_fp8_record_amax_cuda(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& amax_pending,
                                         int64_t slot, at::ScalarType dtype,
                                         const c10::optional<at::Tensor>& saturation) {
  check_input(x, dtype);
  check_scalar(scale, "scale", x);
  float* cell = pending_cell(amax_pending, slot, x);
  return launch_quantize(x, scale, dtype, cell, false, clip_cells(saturation, slot, amax_pending, x));
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
// kTile and store_tile_transposed: fp8_encode.cuh (shared with dynamic_ops.cu's colwise kernel)

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
  store_tile_transposed(tile, out, R, r0, c0);
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
// quantize + transpose (+ column sums), recording the amax: the backward's grad_output in one
// read. The weight-gradient GEMM wants the codes transposed and the bias gradient is the
// column sum of the same tensor: separately that is a quantize, a byte transpose and a
// reduction, three passes over the largest tensor of the backward.
//
// One block of 256 threads per 128 x 128 tile of x[R, C]. EPL = 16 / sizeof(T) elements per
// 16-byte load, LPR = 128 / EPL loads per tile row, RPP = 256 / LPR rows per pass, P = 128 / RPP
// passes: thread t loads rows i + RPP j (i = t / LPR, j = 0 .. P-1) at columns g EPL .. (g = t % LPR).
// Its codes go straight to q and into a swizzled shared tile that is written out transposed
// as in transpose_tile128_kernel. Column sums (the reference's order, in float32, from +0.0):
// each thread sums its P rows in order j; the RPP partials of a column are summed in order i,
// one float per column per row tile into a workspace; column_sum_kernel sums those over the
// row tiles in order. Tiles past the edge (or shapes the 16-byte path cannot take) go element
// by element in the same order, elements outside x counting as +0.0. Where only R % 16 != 0
// (the transposed rows are not 16-byte aligned) the loads stay vectorized and the transposed
// tile is stored byte by byte.
// ---------------------------------------------------------------------------------------
template <typename T, bool E4M3, bool COLSUM>
__global__ void __launch_bounds__(256) quantize_t_kernel(const T* __restrict__ x, uint8_t* __restrict__ q,
                                                          uint8_t* __restrict__ qt, float* __restrict__ partial,
                                                          const float* __restrict__ scale_ptr, float* amax_slot,
                                                          int64_t R, int64_t C, bool vec_ok, bool vec_t,
                                                          ClipCells cells) {
  constexpr int EPL = 16 / sizeof(T);
  constexpr int LPR = kTile / EPL;
  constexpr int RPP = 256 / LPR;
  constexpr int P = kTile / RPP;
  constexpr int WPL = EPL / 4;  // words of codes per load
  __shared__ uint32_t tile[kTile * kTile / 4];  // 128 rows x 32 words of codes, swizzled
  __shared__ float s_part[COLSUM ? RPP : 1][COLSUM ? kTile : 1];
  const int t = threadIdx.x, i = t / LPR, g = t % LPR;
  const int64_t r0 = int64_t(blockIdx.x) * kTile, c0 = int64_t(blockIdx.y) * kTile;
  const bool full = vec_ok && r0 + kTile <= R && c0 + kTile <= C;
  const float scale = *scale_ptr;
  float amax = 0.0f;
  uint32_t clips = 0;
  float acc[EPL];
#pragma unroll
  for (int e = 0; e < EPL; ++e) acc[e] = 0.0f;
  if (full) {
    uint4 raw[P];
#pragma unroll
    for (int j = 0; j < P; ++j) raw[j] = __ldcs(reinterpret_cast<const uint4*>(x + (r0 + i + RPP * j) * C + c0 + g * EPL));
    typename Codec<T>::Acc m = Codec<T>::zero();
#pragma unroll
    for (int j = 0; j < P; ++j) {
      const int row = i + RPP * j;
      uint32_t words[WPL];
      Codec<T>::template encode<E4M3, true>(raw[j], scale, words, m, clips);
      uint8_t* dst = q + (r0 + row) * C + c0 + g * EPL;
      if constexpr (WPL == 2) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
      } else {
        *reinterpret_cast<uint32_t*>(dst) = words[0];
      }
      const int word = (g * WPL) ^ (((row >> 4) & 7) << 2);
#pragma unroll
      for (int w = 0; w < WPL; ++w) tile[row * 32 + word + w] = words[w];
      if (COLSUM) {
        const T* v = reinterpret_cast<const T*>(&raw[j]);
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[e] += to_f32<T>(v[e]);
      }
    }
    amax = Codec<T>::finish(m);
  } else {
    uint8_t* tile_bytes = reinterpret_cast<uint8_t*>(tile);
    for (int j = 0; j < P; ++j) {
      const int row = i + RPP * j;
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        const int col = g * EPL + e;
        const bool in = r0 + row < R && c0 + col < C;
        const float v = in ? to_f32<T>(x[(r0 + row) * C + c0 + col]) : 0.0f;
        amax = fmax_nan(amax, fabsf(v));
        const float sv = v * scale;  // (0 outside x: never clips)
        clips += clips2<E4M3>(sv, 0.0f);
        const uint8_t code = encode1<E4M3>(sv);
        if (in) q[(r0 + row) * C + c0 + col] = code;
        tile_bytes[tile_byte(row, col)] = code;
        if (COLSUM) acc[e] += v;
      }
    }
  }
  if (COLSUM) {
#pragma unroll
    for (int e = 0; e < EPL; ++e) s_part[i][g * EPL + e] = acc[e];
  }
  __syncthreads();
  if (full && vec_t) {
    store_tile_transposed(tile, qt, R, r0, c0);
  } else {
    store_tile_transposed_partial(tile, qt, R, C, r0, c0);
  }
  if (COLSUM && t < kTile) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < RPP; ++k) s += s_part[k][t];
    if (c0 + t < C) partial[int64_t(blockIdx.x) * C + c0 + t] = s;
  }
  block_fold_amax<256>(amax, amax_slot);  // fp8state_common.cuh
  block_add_clips<256>(clips, cells, R * C);
}

// out[c] = the partials of column c summed over the row tiles in order, from +0.0; NaN canonical.
__global__ void column_sum_kernel(const float* __restrict__ partial, float* __restrict__ out, int64_t tiles,
                                  int64_t C) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float s = 0.0f;
  for (int64_t r = 0; r < tiles; ++r) s += partial[r * C + c];
  out[c] = isnan(s) ? __uint_as_float(kCanonicalNanF32) : s;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_fp8_t_record_amax_cuda(const at::Tensor& x_in,
                                                                              const at::Tensor& scale,
                                                                              const at::Tensor& amax_pending,
                                                                              int64_t slot, at::ScalarType dtype,
                                                                              bool column_sum,
                                                                              const c10::optional<at::Tensor>& saturation) {
  check_input(x_in, dtype);
  FP8S_CHECK(x_in.dim() == 2, "x.dim()", "2", x_in.dim());
  check_scalar(scale, "scale", x_in);
  float* cell = pending_cell(amax_pending, slot, x_in);
  const ClipCells cells = clip_cells(saturation, slot, amax_pending, x_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const int64_t R = x.size(0), C = x.size(1);
  at::Tensor q = at::empty({R, C}, x.options().dtype(dtype));
  at::Tensor qt = at::empty({C, R}, x.options().dtype(dtype));
  at::Tensor sums = at::empty({column_sum ? C : 0}, x.options().dtype(at::kFloat));
  if (R == 0 || C == 0) {
    sums.zero_();
    return {q, qt, sums};
  }
  const int64_t row_tiles = (R + kTile - 1) / kTile, col_tiles = (C + kTile - 1) / kTile;
  TORCH_CHECK(col_tiles <= 65535, "fp8state: quantize_fp8_t_record_amax: x.shape[1] too large (more than 2^23 columns)");
  TORCH_CHECK(row_tiles <= 0x7fffffff, "fp8state: quantize_fp8_t_record_amax: x.shape[0] too large");
  at::Tensor partial = at::empty({column_sum ? row_tiles : 0, C}, x.options().dtype(at::kFloat));
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t per_load = 16 / int64_t(x.element_size());
  // 16-byte loads and code stores need whole loads per row and an aligned x; the transposed
  // tile's 16-byte stores need R % 16 == 0 besides (else its bytes are stored one by one, the
  // loads staying vectorized: an expert's share of the tokens is any count)
  const bool vec_ok = C % per_load == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  const bool vec_t = R % 16 == 0;
  const bool e4m3 = dtype == at::kFloat8_e4m3fn;
  const dim3 grid{unsigned(row_tiles), unsigned(col_tiles), 1u};
  auto* qp = reinterpret_cast<uint8_t*>(q.data_ptr());
  auto* qtp = reinterpret_cast<uint8_t*>(qt.data_ptr());
  float* pp = column_sum ? partial.data_ptr<float>() : nullptr;
#define FP8S_QT(T, E, S)                                                                                     \
  quantize_t_kernel<T, E, S><<<grid, 256, 0, stream>>>(reinterpret_cast<const T*>(x.data_ptr()), qp, qtp, pp, \
                                                       scale.data_ptr<float>(), cell, R, C, vec_ok, vec_t, cells)
#define FP8S_QT_BY_FLAGS(T)      \
  if (e4m3 && column_sum)        \
    FP8S_QT(T, true, true);      \
  else if (e4m3)                 \
    FP8S_QT(T, true, false);     \
  else if (column_sum)           \
    FP8S_QT(T, false, true);     \
  else                           \
    FP8S_QT(T, false, false);
  switch (x.scalar_type()) {
    case at::kFloat:
      FP8S_QT_BY_FLAGS(float);
      break;
    case at::kBFloat16:
      FP8S_QT_BY_FLAGS(__nv_bfloat16);
      break;
    default:
      FP8S_QT_BY_FLAGS(__half);
      break;
  }
#undef FP8S_QT_BY_FLAGS
#undef FP8S_QT
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (column_sum) {
    column_sum_kernel<<<unsigned((C + 255) / 256), 256, 0, stream>>>(pp, sums.data_ptr<float>(), row_tiles, C);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {q, qt, sums};
}

}  // namespace

TORCH_LIBRARY_IMPL(fp8state, CUDA, m) {
  m.impl("quantize_fp8", &quantize_fp8_cuda);
  m.impl("quantize_fp8_record_amax", &quantize_fp8_record_amax_cuda);
  m.impl("dequantize_fp8", &dequantize_fp8_cuda);
  m.impl("update_scales", &update_scales_cuda);
  m.impl("transpose_fp8", &transpose_fp8_cuda);
  m.impl("quantize_fp8_t_record_amax", &quantize_fp8_t_record_amax_cuda);
}
