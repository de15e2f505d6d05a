// Host build of csrc/swiglu_math.cuh (the SwiGLU kernels' float32 math), for
// tests/ops/test_swiglu_math_host.py to compare with ops/reference_swiglu.py bit for bit.
// Built with nvcc -std=c++17 -O2 -Xcompiler -ffp-contract=off -I <csrc>; no GPU needed.
//
// Usage: swiglu_math_host_check IN OUT. IN holds N records of 3 float32 (g, u, dy); OUT gets N
// records of 5 float32: exp_f32(g), swiglu(g, u), swiglu_grad(g, u, dy)'s dg and du, exp_f32(-g).
#include <cstdio>
#include <vector>

#include "swiglu_math.cuh"  // found through -I <ops.cuda.source_dir()>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s IN OUT\n", argv[0]);
    return 2;
  }
  std::FILE* in = std::fopen(argv[1], "rb");
  if (in == nullptr) return 3;
  std::vector<float> v;
  float buf[3];
  while (std::fread(buf, sizeof(float), 3, in) == 3) v.insert(v.end(), buf, buf + 3);
  std::fclose(in);
  const size_t n = v.size() / 3;
  std::vector<float> out(n * 5);
  for (size_t i = 0; i < n; ++i) {
    const float g = v[3 * i], u = v[3 * i + 1], dy = v[3 * i + 2];
    float dg, du;
    fp8state_swiglu::swiglu_grad(g, u, dy, dg, du);
    out[5 * i] = fp8state_swiglu::exp_f32(g);
    out[5 * i + 1] = fp8state_swiglu::swiglu(g, u);
    out[5 * i + 2] = dg;
    out[5 * i + 3] = du;
    out[5 * i + 4] = fp8state_swiglu::exp_f32(-g);
  }
  std::FILE* o = std::fopen(argv[2], "wb");
  if (o == nullptr) return 4;
  const size_t wrote = std::fwrite(out.data(), sizeof(float), out.size(), o);
  std::fclose(o);
  std::printf("%zu records\n", n);
  return wrote == out.size() ? 0 : 5;
}
