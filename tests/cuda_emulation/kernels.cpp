// frspec's CUDA kernels run on the CPU: the kernels' own source (cut from src/engine/candle/kernels.cu by
// tests/cuda_emulation.rs into kernel_snippet.h) with a thread per CUDA thread, __syncthreads as a barrier of the
// block and warp shuffles through a barrier of the warp, one block at a time. Their outputs are checked against
// references computed here from the same inputs. No GPU can run here, so this is how a change to a kernel's indexing,
// vector loads or reductions is tested before a GPU is lent; the GPU check (scripts/gpu-check.sh) then compares the
// GPU's tokens with the CPU engine's.
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

// What the kernels use of CUDA.
#define __device__
#define __global__
#define __forceinline__ inline
using std::min;
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct dim3 { int x, y; };
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
float *g_shared;  // the block's dynamic shared memory
std::barrier<> *g_block;
std::vector<std::unique_ptr<std::barrier<>>> g_warps;
void __syncthreads() { g_block->arrive_and_wait(); }
template <typename V> V __shfl_xor_sync(unsigned, V v, int o) {
  static V exchange[1024];
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  g_warps[warp]->arrive_and_wait();
  exchange[t] = v;
  g_warps[warp]->arrive_and_wait();
  return exchange[warp * 32 + (lane ^ o)];
}
struct bf16 { uint16_t bits; };
inline float to_f(float x) { return x; }
inline float to_f(bf16 x) { uint32_t u = (uint32_t)x.bits << 16; float f; memcpy(&f, &u, 4); return f; }
template <typename T> T from_f(float x);
template <> float from_f<float>(float x) { return x; }
template <> bf16 from_f<bf16>(float x) {  // round to nearest even, as __float2bfloat16
  uint32_t u; memcpy(&u, &x, 4); u += 0x7fff + ((u >> 16) & 1); return bf16{(uint16_t)(u >> 16)};
}
#include "kernel_snippet.h"

// Run `kernel` on a grid of blocks of `threads` threads with `shared` floats of dynamic shared memory.
void launch(int grid_x, int grid_y, int threads, size_t shared, const std::function<void()> &kernel) {
  std::vector<float> memory(shared);
  g_shared = memory.data();
  blockDim = {threads, 1};
  gridDim = {grid_x, grid_y};
  std::barrier<> block(threads);
  g_block = &block;
  g_warps.clear();
  for (int w = 0; w < threads / 32; ++w) g_warps.emplace_back(new std::barrier<>(32));
  for (int by = 0; by < grid_y; ++by)
    for (int bx = 0; bx < grid_x; ++bx) {
      std::vector<std::thread> team;
      for (int t = 0; t < threads; ++t) team.emplace_back([&, t] { threadIdx = {t, 0}; blockIdx = {bx, by}; kernel(); });
      for (auto &member : team) member.join();
    }
}

// RoPE tables [rows, d / 2] of random angles, and the pair (a, b) that pair j of a head of d rotates.
struct Rope {
  std::vector<float> cos, sin;
  int d, interleaved;
  Rope(int rows, int d, int interleaved, std::mt19937 &rng) : d(d), interleaved(interleaved) {
    std::uniform_real_distribution<float> angle(-3.2f, 3.2f);
    for (int i = 0; i < rows * d / 2; ++i) {
      const float a = angle(rng);
      cos.push_back(std::cos(a));
      sin.push_back(std::sin(a));
    }
  }
  int a(int j) const { return interleaved ? 2 * j : j; }
  int b(int j) const { return interleaved ? 2 * j + 1 : j + d / 2; }
  // Head x of row r rotated into out, computed in F (double for a reference, float as the kernels compute it).
  template <typename F, typename T> void rotate(int r, const T *x, F *out) const {
    for (int j = 0; j < d / 2; ++j) {
      const F c = cos[r * d / 2 + j], s = sin[r * d / 2 + j], xa = to_f(x[a(j)]), xb = to_f(x[b(j)]);
      out[a(j)] = xa * c - xb * s;
      out[b(j)] = xa * s + xb * c;
    }
  }
};

// rows_attention against attention in double, as launched by kernels.rs (256 threads), each query rotated by RoPE (in
// double here). Returns the worst error: f32 absolute; bf16 as a share of what the output's rounding allows (half a
// unit in the last place, 2^-8 relative, plus 1e-3).
template <typename T>
double attention(int heads, int kv_heads, int d, int slots, int capacity, int rows, int interleaved, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0, 1);
  const int width = (heads + 2 * kv_heads) * d;
  std::vector<T> qkv(rows * width), pool((size_t)slots * 2 * kv_heads * capacity * d), out(rows * heads * d);
  for (auto &x : qkv) x = from_f<T>(normal(rng));
  for (auto &x : pool) x = from_f<T>(normal(rng));
  std::vector<unsigned> at(2 * rows);
  int longest = 0;
  for (int r = 0; r < rows; ++r) {
    at[2 * r] = rng() % slots;
    at[2 * r + 1] = rng() % capacity;
    longest = std::max<int>(longest, at[2 * r + 1] + 1);
  }
  const Rope rope(rows, d, interleaved, rng);
  const int threads = 256, groups = threads / (d * (int)sizeof(T) / 16);
  const float scale = 1.0f / std::sqrt((float)d);
  launch(rows * heads, 1, threads, longest + d + groups * d, [&] {
    rows_attention<T>(qkv.data(), pool.data(), at.data(), rope.cos.data(), rope.sin.data(), interleaved, out.data(), heads,
                      kv_heads, d, capacity, width, longest, scale);
  });
  double worst = 0;
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < heads; ++h) {
      const int kvh = h / (heads / kv_heads), slot = at[2 * r], len = at[2 * r + 1] + 1;
      std::vector<double> q(d);
      rope.rotate(r, &qkv[r * width + h * d], q.data());
      const T *k = &pool[(((size_t)slot * 2 * kv_heads) + kvh) * capacity * d];
      const T *v = &pool[(((size_t)slot * 2 * kv_heads) + kv_heads + kvh) * capacity * d];
      std::vector<double> p(len);
      double m = -INFINITY, sum = 0;
      for (int j = 0; j < len; ++j) {
        double s = 0;
        for (int i = 0; i < d; ++i) s += q[i] * to_f(k[j * d + i]);
        p[j] = s / std::sqrt((double)d);
        m = std::max(m, p[j]);
      }
      for (auto &x : p) sum += (x = std::exp(x - m));
      for (int i = 0; i < d; ++i) {
        double o = 0;
        for (int j = 0; j < len; ++j) o += p[j] * to_f(v[j * d + i]);
        o /= sum;
        const double allowed = sizeof(T) == 2 ? std::ldexp(std::fabs(o), -8) + 1e-3 : 1.0;
        worst = std::max(worst, std::fabs(o - to_f(out[(r * heads + h) * d + i])) / allowed);
      }
    }
  return worst;
}

// write_kv as launched by kernels.rs (a block per row and key or value head, d threads rounded up to a warp), rows at
// distinct places, keys rotated by RoPE when `rotate`: the number of pool values that differ from what f32 rotation
// (or a copy) and the storage's rounding give, counting every place no row was written to, which must not change.
template <typename T>
int write(int heads, int kv_heads, int d, int slots, int capacity, int rows, int interleaved, bool rotate, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0, 1);
  const int width = (heads + 2 * kv_heads) * d;
  std::vector<T> qkv(rows * width), pool((size_t)slots * 2 * kv_heads * capacity * d);
  for (auto &x : qkv) x = from_f<T>(normal(rng));
  for (auto &x : pool) x = from_f<T>(normal(rng));
  std::vector<T> want = pool;
  std::vector<unsigned> at(2 * rows);
  std::vector<int> places(slots * capacity);
  std::iota(places.begin(), places.end(), 0);
  std::shuffle(places.begin(), places.end(), rng);
  for (int r = 0; r < rows; ++r) {
    at[2 * r] = places[r] / capacity;
    at[2 * r + 1] = places[r] % capacity;
  }
  const Rope rope(rows, d, interleaved, rng);
  launch(rows * 2 * kv_heads, 1, std::min((d + 31) / 32 * 32, 1024), 0, [&] {
    write_kv<T>(qkv.data(), pool.data(), at.data(), rotate ? rope.cos.data() : nullptr, rotate ? rope.sin.data() : nullptr,
                interleaved, heads, kv_heads, d, capacity, width);
  });
  for (int r = 0; r < rows; ++r)
    for (int plane_head = 0; plane_head < 2 * kv_heads; ++plane_head) {
      const T *src = &qkv[r * width + (heads + plane_head) * d];
      T *dst = &want[(((size_t)at[2 * r] * 2 * kv_heads + plane_head) * capacity + at[2 * r + 1]) * d];
      for (int i = 0; i < d; ++i) dst[i] = src[i];
      if (rotate && plane_head < kv_heads) {
        std::vector<float> rotated(d);
        rope.rotate(r, src, rotated.data());
        for (int i = 0; i < d; ++i) dst[i] = from_f<T>(rotated[i]);
      }
    }
  int wrong = 0;
  for (size_t i = 0; i < pool.size(); ++i) wrong += to_f(pool[i]) != to_f(want[i]);
  return wrong;
}

// argmax_chunks then argmax_pick, as launched by kernels.rs (chunks of `chunk`, 256 threads), on rows `stride` apart
// with ties and -inf planted: the number of rows whose index is not the first of the largest value.
template <typename T>
double argmax(int rows, int cols, int stride, int chunk, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> small(-40, 40);  // few distinct values: many ties, in bf16 too
  std::vector<T> x((size_t)(rows - 1) * stride + cols);
  for (auto &v : x) v = from_f<T>((float)small(rng));
  for (int c = 0; c < cols; ++c) x[c] = from_f<T>(-INFINITY);  // row 0: all -inf
  const int chunks = (cols + chunk - 1) / chunk;
  std::vector<float> best(rows * chunks);
  std::vector<unsigned> where(rows * chunks), out(rows);
  launch(chunks, rows, 256, 0, [&] { argmax_chunks<T>(x.data(), best.data(), where.data(), cols, stride, chunk); });
  launch(rows, 1, 256, 0, [&] { argmax_pick(best.data(), where.data(), out.data(), chunks); });
  int wrong = 0;
  for (int r = 0; r < rows; ++r) {
    int first = 0;
    for (int c = 1; c < cols; ++c)
      if (to_f(x[(size_t)r * stride + c]) > to_f(x[(size_t)r * stride + first])) first = c;
    wrong += out[r] != (unsigned)first;
  }
  return wrong;
}

// One of the matrix-vector kernels (norm_matvec_*, matvec_add_*, norm_swiglu_matvec_*, matvec_*) as launched by
// kernels.rs (eight rows a block of 256 threads) against double: the worst error as a share of what f32 sums of k
// terms and the output's rounding allow (at most 1).
template <typename T, bool NORM, bool RESIDUAL, bool SWIGLU>
double product(int n, int k, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0, 1);
  std::vector<T> w((SWIGLU ? 2 : 1) * n * k), x(k), g(k), r(n), y(n);
  for (auto *v : {&w, &x, &g, &r})
    for (auto &e : *v) e = from_f<T>(normal(rng));
  const float eps = 1e-5f;
  launch((n + 7) / 8, 1, 256, 0, [&] { matvec<T, NORM, RESIDUAL, SWIGLU>(w.data(), x.data(), g.data(), r.data(), y.data(), n, k, eps); });
  double squares = 0;
  for (auto &e : x) squares += (double)to_f(e) * to_f(e);
  const double scale = NORM ? 1 / std::sqrt(squares / k + eps) : 1;
  double worst = 0;
  for (int j = 0; j < n; ++j) {
    // A row's dot product and the sum of its terms' sizes (what f32 rounding errors scale with).
    auto dot = [&](int row, double &size) {
      double sum = 0;
      size = 0;
      for (int i = 0; i < k; ++i) {
        const double term = (double)to_f(w[(size_t)row * k + i]) * to_f(x[i]) * (NORM ? to_f(g[i]) : 1.0) * scale;
        sum += term;
        size += std::fabs(term);
      }
      return sum;
    };
    double size, up_size = 0, want = dot(j, size);
    if (RESIDUAL) want += to_f(r[j]);
    if (SWIGLU) {
      const double up = dot(j + n, up_size), sigmoid = 1 / (1 + std::exp(-want));
      size = size * std::fabs(up) + std::fabs(want * sigmoid) * up_size;
      want = want * sigmoid * up;
    }
    const double allowed = 1e-6 * (1 + size) + (sizeof(T) == 2 ? std::ldexp(std::fabs(want), -8) : 1e-6 * std::fabs(want));
    worst = std::max(worst, std::fabs(to_f(y[j]) - want) / allowed);
  }
  return worst;
}

int main() {
  struct Case { const char *name; double worst, tolerance; };
  const Case cases[] = {
      {"attention f32, 32 heads over 8, d 128 (Llama-3.1-8B)", attention<float>(32, 8, 128, 3, 300, 3, 0, 1), 1e-5},
      {"attention f32, 16 heads over 8, d 32 (the GPU check's model)", attention<float>(16, 8, 32, 2, 70, 4, 0, 2), 1e-5},
      {"attention bf16, 32 heads over 8, d 128", attention<bf16>(32, 8, 128, 3, 300, 3, 0, 3), 1},
      {"attention bf16, 9 heads over 3, d 64 (SmolLM2)", attention<bf16>(9, 3, 64, 2, 100, 3, 0, 4), 1},
      {"attention f32, 9 heads over 3, d 64, 1,500 positions, interleaved pairs", attention<float>(9, 3, 64, 1, 1500, 2, 1, 5), 1e-5},
      {"write_kv bf16, 8 key/value heads of d 128, keys rotated", (double)write<bf16>(32, 8, 128, 3, 20, 7, 0, true, 14), 0},
      {"write_kv f32, 3 heads of d 64, keys rotated (interleaved pairs)", (double)write<float>(9, 3, 64, 2, 10, 5, 1, true, 15), 0},
      {"write_kv bf16, 8 heads of d 128, copied as they are", (double)write<bf16>(32, 8, 128, 2, 10, 4, 0, false, 16), 0},
      {"argmax f32, 3 rows of 10,000 in chunks of 4,096", argmax<float>(3, 10000, 10000, 4096, 6), 0},
      {"argmax bf16, 4 rows of 5,000, 5,120 apart, chunks of 1,000", argmax<bf16>(4, 5000, 5120, 1000, 7), 0},
      {"argmax f32, 2 rows of 100 (one chunk, threads without values)", argmax<float>(2, 100, 100, 4096, 8), 0},
      {"matvec f32, 40 rows of 256", product<float, false, false, false>(40, 256, 9), 1},
      {"matvec bf16 with the norm folded in, 37 rows of 512", product<bf16, true, false, false>(37, 512, 10), 1},
      {"matvec f32 plus a residual, 40 rows of 384", product<float, false, true, false>(40, 384, 11), 1},
      {"matvec bf16, norm and SiLU x up folded in, 24 of 2 x 24 rows of 512", product<bf16, true, false, true>(24, 512, 12), 1},
      {"matvec f32, norm and SiLU x up folded in, 20 of 2 x 20 rows of 256", product<float, true, false, true>(20, 256, 13), 1},
  };
  int failed = 0;
  for (const Case &c : cases) {
    const bool ok = c.worst <= c.tolerance;
    printf("%s: %.3g (%s)\n", c.name, c.worst, ok ? "ok" : "TOO LARGE");
    failed += !ok;
  }
  return failed;
}
