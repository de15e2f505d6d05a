// Runs the FP4 CUDA kernels of csrc/fp4_ops.cu on the host: the source's
// kernel section (compiled with -DFP8STATE_FP4_NO_TORCH by a plain C++ compiler) with one
// std::thread per CUDA thread, a barrier for __syncthreads, lane groups for warp shuffles and
// std::atomic_ref for the atomics. The launch plans (tiles, row groups, the CAS path for the
// center statistics when several row groups fold the same channel) are the real ones, with a
// small `resident` CTA count to force several row groups on small inputs.
//
// It checks the kernels' indexing, tiling, reductions and NaN paths without a GPU; the GPU
// tests (test_cuda_fp4.py) remain the word on the device's arithmetic. Driven by
// tests/ops/test_fp4_emulated.py:
//   fp4_emulate quantize   TYPE MX ROWS K CENTER RECORD STATS SLOT_OFF CSTRIDE ROW_OFF RESIDENT DIR
//   fp4_emulate dequantize TYPE MX ROWS K CENTER RESIDENT DIR
//   fp4_emulate centers    N C MOMENTUM_BITS DIR
// reading and writing raw little-endian buffers in DIR (see the Python driver).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <vector_functions.h>
#include <vector_types.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <bit>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

using std::isfinite;
using std::isinf;
using std::isnan;

// ---- CUDA builtins, emulated ------------------------------------------------------------
#undef __global__
#undef __shared__
#undef __launch_bounds__
#define __global__
#define __launch_bounds__(...)
#define __shared__ static

thread_local dim3 emu_threadIdx, emu_blockIdx;
dim3 emu_blockDim, emu_gridDim;
#define threadIdx emu_threadIdx
#define blockIdx emu_blockIdx
#define blockDim emu_blockDim
#define gridDim emu_gridDim

static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline uint32_t __float_as_uint(float v) { return std::bit_cast<uint32_t>(v); }
static inline float __uint_as_float(uint32_t v) { return std::bit_cast<float>(v); }
static inline int __vimin3_s32(int a, int b, int c) { return std::min(a, std::min(b, c)); }

// Per 16-bit half, signed max / min.
static inline uint32_t emu_vsel2(uint32_t a, uint32_t b, bool take_max) {
  uint32_t r = 0;
  for (int h = 0; h < 2; ++h) {
    const int16_t x = int16_t(a >> (16 * h)), y = int16_t(b >> (16 * h));
    r |= uint32_t(uint16_t(take_max ? std::max(x, y) : std::min(x, y))) << (16 * h);
  }
  return r;
}
static inline uint32_t __vmaxs2(uint32_t a, uint32_t b) { return emu_vsel2(a, b, true); }
static inline uint32_t __vmins2(uint32_t a, uint32_t b) { return emu_vsel2(a, b, false); }

static inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t v = (uint64_t(y) << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}

template <typename T>
static inline T __ldcs(const T* p) {
  return *p;
}
template <typename T>
static inline T __ldg(const T* p) {
  return *p;
}
template <typename T>
static inline void __stcs(T* p, T v) {
  *p = v;
}
static inline size_t __cvta_generic_to_shared(const void*) { return 0; }

static std::barrier<>* g_cta_barrier = nullptr;
static inline void __syncthreads() { g_cta_barrier->arrive_and_wait(); }

// Lane groups of a warp, one reusable barrier per participation mask.
struct LaneGroup {
  std::mutex m;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
};
struct WarpState {
  float slot[32];
  std::mutex m;
  std::map<unsigned, LaneGroup> groups;
};
static std::vector<WarpState>* g_warps = nullptr;

static void lane_group_sync(WarpState& w, unsigned mask) {
  LaneGroup* g;
  {
    std::lock_guard<std::mutex> lk(w.m);
    g = &w.groups[mask];
  }
  std::unique_lock<std::mutex> lk(g->m);
  const uint64_t mine = g->generation;
  if (++g->arrived == std::popcount(mask)) {
    g->arrived = 0;
    ++g->generation;
    g->cv.notify_all();
  } else {
    g->cv.wait(lk, [&] { return g->generation != mine; });
  }
}

static inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask) {
  const unsigned lane = threadIdx.x & 31;
  if (!(mask >> lane & 1u)) std::abort();  // a lane outside its own mask: a kernel bug
  WarpState& w = (*g_warps)[threadIdx.x / 32];
  w.slot[lane] = v;
  lane_group_sync(w, mask);
  const unsigned other = lane ^ unsigned(lane_mask);
  if (!(mask >> other & 1u)) std::abort();  // reading a lane that does not take part
  const float r = w.slot[other];
  lane_group_sync(w, mask);
  return r;
}

static inline unsigned atomicMax(unsigned* p, unsigned v) {
  std::atomic_ref<unsigned> a(*p);
  unsigned old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}
static inline unsigned atomicCAS(unsigned* p, unsigned expected, unsigned desired) {
  std::atomic_ref<unsigned> a(*p);
  a.compare_exchange_strong(expected, desired);
  return expected;  // the old value either way
}

#define FP8STATE_FP4_NO_TORCH
#include "fp4_ops.cu"  // found through -I <ops.cuda.source_dir()>

using namespace fp4kernels;

// ---- launcher ---------------------------------------------------------------------------
struct EmuLauncher {
  int resident_ctas;
  template <auto Kernel>
  int resident() {
    return resident_ctas;
  }
  template <auto Kernel, typename P, int kBlock = kThreads>
  void launch(dim3 grid, const P& params) {
    emu_gridDim = grid;
    emu_blockDim = dim3(kBlock);
    for (unsigned by = 0; by < grid.y; ++by) {
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        std::barrier<> bar(kBlock);
        std::vector<WarpState> warps((kBlock + 31) / 32);
        g_cta_barrier = &bar;
        g_warps = &warps;
        std::vector<std::thread> threads;
        threads.reserve(kBlock);
        for (int t = 0; t < kBlock; ++t) {
          threads.emplace_back([&, t] {
            emu_threadIdx = dim3(unsigned(t));
            emu_blockIdx = dim3(bx, by);
            Kernel(params);
            bar.arrive_and_drop();  // threads that returned no longer hold up a barrier
          });
        }
        for (auto& th : threads) th.join();
      }
    }
  }
};

// ---- files ------------------------------------------------------------------------------
static std::vector<uint8_t> load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    std::fprintf(stderr, "missing %s\n", path.c_str());
    std::exit(2);
  }
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}
static void save(const std::string& path, const void* data, size_t bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(data), std::streamsize(bytes));
}
template <typename T>
static T* as(std::vector<uint8_t>& v) {
  return reinterpret_cast<T*>(v.data());
}

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  const std::string op = argv[1];
  auto arg = [&](int i) { return std::strtoll(argv[i], nullptr, 10); };
  if (op == "quantize" && argc == 14) {
    const auto type = InType(arg(2));
    const bool mx = arg(3);
    const int64_t rows = arg(4), k = arg(5);
    const bool center = arg(6), record = arg(7), stats = arg(8);
    const int64_t slot_off = arg(9), cstride = arg(10), row_off = arg(11);
    EmuLauncher launcher{int(arg(12))};
    const std::string dir = argv[13];
    std::vector<uint8_t> x = load(dir + "/x.bin"), scale = load(dir + "/scale.bin"), c, pending, cmax, cmin;
    const int block = mx ? 32 : 16;
    std::vector<uint8_t> packed(size_t(rows * k / 2), 0xAA), scales(size_t(rows * k / block), 0xAA);
    QuantizeParams p{};
    p.x = x.data();
    p.packed = packed.data();
    p.scales = scales.data();
    p.scale = as<float>(scale);
    if (center) {
      c = load(dir + "/center.bin");
      p.center = as<float>(c);
    }
    if (record) {
      pending = load(dir + "/pending.bin");
      p.amax_slot = as<float>(pending) + slot_off;
    }
    if (stats) {
      cmax = load(dir + "/cmax.bin");
      cmin = load(dir + "/cmin.bin");
      p.cmax = as<float>(cmax) + row_off;
      p.cmin = as<float>(cmin) + row_off;
      p.cmax_stride = p.cmin_stride = cstride;
    }
    p.rows = rows;
    p.k = k;
    run_quantize(p, type, mx, launcher);
    save(dir + "/packed.out", packed.data(), packed.size());
    save(dir + "/scales.out", scales.data(), scales.size());
    if (record) save(dir + "/pending.out", pending.data(), pending.size());
    if (stats) {
      save(dir + "/cmax.out", cmax.data(), cmax.size());
      save(dir + "/cmin.out", cmin.data(), cmin.size());
    }
    return 0;
  }
  if (op == "dequantize" && argc == 9) {
    const auto type = InType(arg(2));
    const bool mx = arg(3);
    const int64_t rows = arg(4), k = arg(5);
    const bool center = arg(6);
    EmuLauncher launcher{int(arg(7))};
    const std::string dir = argv[8];
    std::vector<uint8_t> packed = load(dir + "/packed.bin"), scales = load(dir + "/scales.bin"),
                         descale = load(dir + "/descale.bin"), c;
    const size_t width = type == InType::kF32 ? 4 : 2;
    std::vector<uint8_t> out(size_t(rows * k) * width + 16, 0xAA);
    DequantizeParams p{};
    p.packed = packed.data();
    p.scales = scales.data();
    p.descale = as<float>(descale);
    if (center) {
      c = load(dir + "/center.bin");
      p.center = as<float>(c);
    }
    p.out = out.data();
    p.rows = rows;
    p.k = k;
    run_dequantize(p, type, mx, launcher);
    save(dir + "/out.out", out.data(), size_t(rows * k) * width);
    return 0;
  }
  if (op == "centers" && argc == 6) {
    const int64_t n = arg(2), c = arg(3);
    const uint32_t mbits = uint32_t(std::strtoul(argv[4], nullptr, 16));
    const std::string dir = argv[5];
    std::vector<uint8_t> center = load(dir + "/center.bin"), cmax = load(dir + "/cmax.bin"),
                         cmin = load(dir + "/cmin.bin"), mask = load(dir + "/mask.bin");
    CenterParams p{};
    p.center = as<float>(center);
    p.cmax = as<float>(cmax);
    p.cmin = as<float>(cmin);
    p.mask = reinterpret_cast<const bool*>(mask.data());
    p.n = n;
    p.c = c;
    p.s_center[0] = p.s_max[0] = p.s_min[0] = c;
    p.s_center[1] = p.s_max[1] = p.s_min[1] = 1;
    p.s_mask = 1;
    p.momentum = std::bit_cast<float>(mbits);
    EmuLauncher launcher{1};
    run_update_centers(p, launcher);
    save(dir + "/center.out", center.data(), center.size());
    save(dir + "/cmax.out", cmax.data(), cmax.size());
    save(dir + "/cmin.out", cmin.data(), cmin.size());
    return 0;
  }
  std::fprintf(stderr, "bad arguments\n");
  return 2;
}
