// frspec's CUDA attention kernel run on the CPU: the kernel's own source (cut from src/engine/candle/kernels.cu by
// tests/cuda_emulation.rs into kernel_snippet.h) with a thread per CUDA thread, __syncthreads as a barrier of the
// block and warp shuffles through a barrier of the warp, one block at a time. Its outputs are checked against
// attention computed in double from the same inputs. No GPU can run here, so this is how a change to the kernel's
// indexing, vector loads or reductions is tested before a GPU is lent; the GPU check (scripts/gpu-check.sh) then
// compares the GPU's tokens with the CPU engine's.
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>
#include <memory>
#define __device__
#define __forceinline__ inline
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct dim { int x; };
thread_local dim threadIdx, blockIdx;
dim blockDim;
float *g_shared;
std::barrier<> *g_block;
std::vector<std::unique_ptr<std::barrier<>>> g_warps;
float g_xchg[1024];
void __syncthreads() { g_block->arrive_and_wait(); }
float __shfl_xor_sync(unsigned, float v, int o) {
  int t = threadIdx.x, w = t / 32, lane = t % 32;
  g_warps[w]->arrive_and_wait();
  g_xchg[t] = v;
  g_warps[w]->arrive_and_wait();
  float r = g_xchg[w * 32 + (lane ^ o)];
  return r;
}
struct bf16 { uint16_t b; };
inline float to_f(float x) { return x; }
inline float to_f(bf16 x) { uint32_t u = (uint32_t)x.b << 16; float f; memcpy(&f, &u, 4); return f; }
template <typename T> T from_f(float x);
template <> float from_f<float>(float x) { return x; }
template <> bf16 from_f<bf16>(float x) { uint32_t u; memcpy(&u, &x, 4); u += 0x7fff + ((u >> 16) & 1); return bf16{(uint16_t)(u >> 16)}; }
#include "kernel_snippet.h"

template <typename T>
double run(int heads, int kv_heads, int d, int slots, int capacity, int rows, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> N(0, 1);
  const int width = (heads + 2 * kv_heads) * d;
  std::vector<T> qkv(rows * width), pool((size_t)slots * 2 * kv_heads * capacity * d);
  for (auto &x : qkv) x = from_f<T>(N(rng));
  for (auto &x : pool) x = from_f<T>(N(rng));
  std::vector<unsigned> at(2 * rows);
  int longest = 0;
  for (int r = 0; r < rows; ++r) { at[2 * r] = rng() % slots; at[2 * r + 1] = rng() % capacity; longest = std::max<int>(longest, at[2 * r + 1] + 1); }
  std::vector<T> out(rows * heads * d);
  const int threads = 256, V = 16 / sizeof(T), groups = threads / (d / V);
  std::vector<float> shm(longest + d + groups * d);
  blockDim.x = threads;
  g_shared = shm.data();
  std::barrier<> block(threads);
  g_block = &block;
  g_warps.clear();
  for (int w = 0; w < threads / 32; ++w) g_warps.emplace_back(new std::barrier<>(32));
  for (int b = 0; b < rows * heads; ++b) {
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) ts.emplace_back([&, t, b] { threadIdx.x = t; blockIdx.x = b;
      rows_attention<T>(qkv.data(), pool.data(), at.data(), out.data(), heads, kv_heads, d, capacity, width, longest, 1.0f / std::sqrt((float)d)); });
    for (auto &t : ts) t.join();
  }
  // Reference in double, from the query as the kernel reads it. For bf16 the error is returned as a share of what
  // the output's rounding allows (1 at most).
  double worst = 0;
  for (int r = 0; r < rows; ++r) for (int h = 0; h < heads; ++h) {
    const int kvh = h / (heads / kv_heads), slot = at[2 * r], len = at[2 * r + 1] + 1;
    const T *q = &qkv[r * width + h * d];
    const T *k = &pool[(((size_t)slot * 2 * kv_heads) + kvh) * capacity * d];
    const T *v = &pool[(((size_t)slot * 2 * kv_heads) + kv_heads + kvh) * capacity * d];
    std::vector<double> s(len); double m = -1e300, sum = 0;
    for (int j = 0; j < len; ++j) { double a = 0; for (int i = 0; i < d; ++i) a += (double)to_f(q[i]) * to_f(k[j * d + i]); s[j] = a / std::sqrt((double)d); m = std::max(m, s[j]); }
    for (auto &x : s) { x = std::exp(x - m); sum += x; }
    for (int i = 0; i < d; ++i) { double o = 0; for (int j = 0; j < len; ++j) o += s[j] * to_f(v[j * d + i]); o /= sum;
      const double allowed = sizeof(T) == 2 ? std::ldexp(std::fabs(o), -8) + 1e-3 : 1.0;
      worst = std::max(worst, std::fabs(o - to_f(out[(r * heads + h) * d + i])) / allowed); }
  }
  return worst;
}
// Worst error of each case against double: f32 within 1e-5; bf16 as a share of what the output's rounding allows
// (half a unit in the last place, 2^-8 relative, plus 1e-3), at most 1.
int main() {
  struct Case { const char *name; double worst, tolerance; };
  const Case cases[] = {
      {"f32, 32 heads over 8, d 128 (Llama-3.1-8B)", run<float>(32, 8, 128, 3, 300, 3, 1), 1e-5},
      {"f32, 16 heads over 8, d 32 (the GPU check's synthetic model)", run<float>(16, 8, 32, 2, 70, 4, 2), 1e-5},
      {"bf16, 32 heads over 8, d 128", run<bf16>(32, 8, 128, 3, 300, 3, 3), 1},
      {"bf16, 9 heads over 3, d 64 (SmolLM2)", run<bf16>(9, 3, 64, 2, 100, 3, 4), 1},
      {"f32, 9 heads over 3, d 64, 1,500 positions", run<float>(9, 3, 64, 1, 1500, 2, 5), 1e-5},
  };
  int failed = 0;
  for (const Case &c : cases) {
    const bool ok = c.worst <= c.tolerance;
    printf("%s: worst error %.3g (%s)\n", c.name, c.worst, ok ? "ok" : "TOO LARGE");
    failed += !ok;
  }
  return failed;
}
