// frspec's own CUDA kernels for the candle engine's decode step, where candle and candle-nn have no fused op: RoPE of
// queries and keys in place in the fused QKV row, SiLU(gate) × up, keys and values written into the caches (the keys
// rotated on the way), the attention of every row of a batch over its own cache (the query rotated as it is read), and the matrix-vector product (with the RMSNorm before it or
// the residual add after it folded in). Built to PTX by build.rs (feature `cuda`); each has a CPU twin in kernels.rs,
// which the tests check against the CPU engine.
// Arithmetic in f32 whatever the storage type.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }

// Pair j of a head x of d values under RoPE: its indices a and b (neighbours, or j and j + d / 2: HF's rotate-half)
// and their values rotated by the angle whose cosine and sine are c and s, in f32.
template <typename T>
__device__ __forceinline__ void rope_pair(const T *x, int j, int d, int interleaved, float c, float s, int &a, int &b,
                                          float &ya, float &yb) {
  a = interleaved ? 2 * j : j;
  b = interleaved ? 2 * j + 1 : j + d / 2;
  const float xa = to_f(x[a]), xb = to_f(x[b]);
  ya = xa * c - xb * s;
  yb = xa * s + xb * c;
}

// A head of d values from src rotated into dst (which may be src) with one row's cos and sin [d / 2], the block's
// threads taking its pairs in turn.
template <typename T>
__device__ void rotate_head(const T *src, T *dst, const float *cos, const float *sin, int d, int interleaved) {
  for (int j = threadIdx.x; j < d / 2; j += blockDim.x) {
    int a, b;
    float ya, yb;
    rope_pair(src, j, d, interleaved, cos[j], sin[j], a, b, ya, yb);
    dst[a] = from_f<T>(ya);
    dst[b] = from_f<T>(yb);
  }
}

// Rows of qkv [n, width]: the first `heads` heads of head_dim d (queries, then keys) rotated in place with cos, sin
// [n, d / 2] (f32). One block per (row, head). Used where attention is candle's products; the fused path rotates
// keys in write_kv and queries in rows_attention, a launch a layer fewer.
template <typename T>
__device__ void rope_qk(T *qkv, const float *cos, const float *sin, int heads, int d, int width, int interleaved) {
  const int row = blockIdx.x / heads, head = blockIdx.x % heads;
  T *x = qkv + (size_t)row * width + (size_t)head * d;
  rotate_head(x, x, cos + (size_t)row * (d / 2), sin + (size_t)row * (d / 2), d, interleaved);
}

// out [n, width] = silu(gate) * up of gate_up [n, 2 * width].
template <typename T>
__device__ void silu_mul(const T *gate_up, T *out, size_t n, size_t width) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n * width) return;
  const size_t row = i / width, col = i % width;
  const float g = to_f(gate_up[row * 2 * width + col]), u = to_f(gate_up[row * 2 * width + width + col]);
  out[i] = from_f<T>(g / (1.0f + expf(-g)) * u);
}

// Sum (or max) over the block; every thread gets the result. blockDim.x is a multiple of 32, at most 1024.
__device__ float block_reduce(float v, float *red, bool is_max) {
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffff, v, o);
    v = is_max ? fmaxf(v, w) : v + w;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < warps ? red[lane] : (is_max ? -INFINITY : 0.0f);
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffff, v, o);
    v = is_max ? fmaxf(v, w) : v + w;
  }
  return v;
}

// Rows of qkv [rows, width] (queries first: `heads` heads of d, then kv_heads keys and kv_heads values) into the pool
// [slots, 2, kv_heads, capacity, d] of every sequence's cache: row r at slot at[2r], position at[2r + 1]. With cos
// and sin [rows, d / 2] (not null) the keys are rotated as they are written (the same f32 arithmetic as rope_qk, whose
// launch this saves), else copied as they are. One block per (row, key or value head).
template <typename T>
__device__ void write_kv(const T *qkv, T *pool, const unsigned *at, const float *cos, const float *sin, int interleaved,
                         int heads, int kv_heads, int d, int capacity, int width) {
  const int per_row = 2 * kv_heads, row = blockIdx.x / per_row, plane_head = blockIdx.x % per_row;
  const unsigned slot = at[2 * row], position = at[2 * row + 1];
  const T *src = qkv + (size_t)row * width + (size_t)(heads + plane_head) * d;
  T *dst = pool + (((size_t)slot * per_row + plane_head) * capacity + position) * d;
  if (cos != nullptr && plane_head < kv_heads) {
    rotate_head(src, dst, cos + (size_t)row * (d / 2), sin + (size_t)row * (d / 2), d, interleaved);
  } else {
    for (int i = threadIdx.x; i < d; i += blockDim.x) dst[i] = src[i];
  }
}

// Every query row of qkv [rows, width] (its first `heads` heads of d, not yet rotated: each block rotates its query
// with cos and sin [rows, d / 2] as it reads it, in f32) attending, as position at[2r + 1] of slot at[2r], to
// positions 0..=that of the slot's cache in pool [slots, 2, kv_heads, capacity, d] (keys, then values, the keys
// rotated by write_kv); out [rows, heads, d]. The rows of one sequence's block see the block's own keys up to themselves (written first by
// write_kv), so no mask is needed, and the rows of every sequence go in one launch. One block of ATTENTION_THREADS
// per (row, query head). Every load is a 16-byte vector (d · sizeof(T) is a multiple of 16; the caller checks): a
// thread per key for the scores, its key row read in d / V vectors; then groups of d / V threads, each thread V
// columns of every G-th value row, and a sum of the groups' partials. A block of 1,024 threads with a key row read
// one element at a time took 20 µs a layer for one decode row and 287 µs for a 128-row prefill on an H200
// (2026-12-04): latency, not bytes, and at most two such blocks a multiprocessor. Dynamic shared memory: `longest`
// scores (the longest row's length), the query row, G × d partials.
template <typename T>
__device__ void rows_attention(const T *qkv, const T *pool, const unsigned *at, const float *cos, const float *sin,
                               int interleaved, T *out, int heads, int kv_heads, int d, int capacity, int width,
                               int longest, float scale) {
  constexpr int V = 16 / sizeof(T);
  extern __shared__ float shared[];
  __shared__ float red[32];
  const int vectors = d / V, groups = blockDim.x / vectors;
  float *scores = shared, *qs = shared + longest, *partial = qs + d;
  const int row = blockIdx.x / heads, h = blockIdx.x % heads, kvh = h / (heads / kv_heads);
  const unsigned slot = at[2 * row];
  const int len = (int)at[2 * row + 1] + 1;
  const T *q = qkv + (size_t)row * width + (size_t)h * d;
  const uint4 *k = reinterpret_cast<const uint4 *>(pool + (((size_t)slot * 2 * kv_heads) + kvh) * capacity * d);
  const uint4 *v = reinterpret_cast<const uint4 *>(pool + (((size_t)slot * 2 * kv_heads) + kv_heads + kvh) * capacity * d);
  for (int j = threadIdx.x; j < d / 2; j += blockDim.x) {
    int a, b;
    float ya, yb;
    rope_pair(q, j, d, interleaved, cos[row * (d / 2) + j], sin[row * (d / 2) + j], a, b, ya, yb);
    qs[a] = ya * scale;
    qs[b] = yb * scale;
  }
  __syncthreads();
  float m = -INFINITY;
  for (int j = threadIdx.x; j < len; j += blockDim.x) {
    const uint4 *kj = k + (size_t)j * vectors;
    float acc = 0.0f;
#pragma unroll 4
    for (int c = 0; c < vectors; ++c) {
      const uint4 kv = kj[c];
      const T *kp = reinterpret_cast<const T *>(&kv);
#pragma unroll
      for (int e = 0; e < V; ++e) acc += qs[c * V + e] * to_f(kp[e]);
    }
    scores[j] = acc;
    m = fmaxf(m, acc);
  }
  m = block_reduce(m, red, true);
  float sum = 0.0f;
  for (int j = threadIdx.x; j < len; j += blockDim.x) {
    const float e = expf(scores[j] - m);
    scores[j] = e;
    sum += e;
  }
  sum = block_reduce(sum, red, false);
  const int g = threadIdx.x / vectors, c = threadIdx.x % vectors;
  if (g < groups) {
    float acc[V];
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] = 0.0f;
#pragma unroll 4
    for (int j = g; j < len; j += groups) {
      const uint4 vv = v[(size_t)j * vectors + c];
      const T *vp = reinterpret_cast<const T *>(&vv);
      const float p = scores[j];
#pragma unroll
      for (int e = 0; e < V; ++e) acc[e] += p * to_f(vp[e]);
    }
#pragma unroll
    for (int e = 0; e < V; ++e) partial[g * d + c * V + e] = acc[e];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float total = 0.0f;
    for (int p = 0; p < groups; ++p) total += partial[p * d + i];
    out[((size_t)row * heads + h) * d + i] = from_f<T>(total / sum);
  }
}

// The first index of the largest value of each row of x [n, cols] (rows row_stride apart), in two launches: blocks
// (chunk, row) find their chunk's largest value and its index (argmax_chunks, into best and where [n, chunks]), then
// one block a row picks among its chunks' (argmax_pick). Ties go to the lower index, as on the host
// (crate::sampling::argmax): each thread visits its indices in increasing order and keeps a value only when larger,
// and every merge prefers the lower index of equal values. A row of -inf or NaN alone gives 0, as on the host.
// candle's argmax was one block a row: 110 µs for the 128,256 logits of a Llama-3.1 decode step on an H200
// (2026-12-04), 2% of the step and 19% of a drafting step.
__device__ __forceinline__ void take_better(float &m, unsigned &at, float m2, unsigned at2) {
  if (m2 > m || (m2 == m && at2 < at)) {
    m = m2;
    at = at2;
  }
}

// The block's best (value, index) into thread 0's m and at. blockDim.x is a multiple of 32, at most 1024.
__device__ void block_argmax(float &m, unsigned &at) {
  __shared__ float red_m[32];
  __shared__ unsigned red_at[32];
  for (int o = 16; o > 0; o >>= 1) take_better(m, at, __shfl_xor_sync(0xffffffff, m, o), __shfl_xor_sync(0xffffffff, at, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) {
    red_m[warp] = m;
    red_at[warp] = at;
  }
  __syncthreads();
  if (warp == 0) {
    m = lane < warps ? red_m[lane] : -INFINITY;
    at = lane < warps ? red_at[lane] : 0xffffffffu;
    for (int o = 16; o > 0; o >>= 1) take_better(m, at, __shfl_xor_sync(0xffffffff, m, o), __shfl_xor_sync(0xffffffff, at, o));
  }
}

template <typename T>
__device__ void argmax_chunks(const T *x, float *best, unsigned *where, int cols, long long row_stride, int chunk) {
  const int c = blockIdx.x, row = blockIdx.y, chunks = gridDim.x;
  const int end = min((c + 1) * chunk, cols);
  float m = -INFINITY;
  unsigned at = 0xffffffffu;
  for (int i = c * chunk + threadIdx.x; i < end; i += blockDim.x) {
    const float v = to_f(x[(size_t)row * row_stride + i]);
    if (v > m) {
      m = v;
      at = i;
    }
  }
  block_argmax(m, at);
  if (threadIdx.x == 0) {
    best[row * chunks + c] = m;
    where[row * chunks + c] = at;
  }
}

__device__ void argmax_pick(const float *best, const unsigned *where, unsigned *out, int chunks) {
  const int row = blockIdx.x;
  float m = -INFINITY;
  unsigned at = 0xffffffffu;
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) take_better(m, at, best[row * chunks + c], where[row * chunks + c]);
  block_argmax(m, at);
  if (threadIdx.x == 0) out[row] = at == 0xffffffffu ? 0 : at;
}

extern "C" __global__ void argmax_pick_u32(const float *best, const unsigned *where, unsigned *out, int chunks) {
  argmax_pick(best, where, out, chunks);
}

// y [n] = w [n, k] · x [k]: one warp per output row, each lane streaming 16-byte loads of its row, partial sums in
// f32 reduced across the warp. cuBLAS's matrix-vector path reached 45–85% of the read bandwidth on an H200 for the
// 30–500 MB matrices of a decode step; this one keeps many independent loads in flight per warp. NORM: x is first
// RMS-normed with weights g (each warp sums x² itself as it reads x, so the norm costs no launch of its own); RESIDUAL:
// y = w · x + r; SWIGLU: w holds 2n rows (gate, then up) and y[j] = silu(gate_j · x) × (up_j · x), one warp reading
// both rows (SiLU × up then costs no launch, 2.3 µs a layer of an H200 decode step on 2026-12-04, and no
// round trip of the gate and up values through memory). k · sizeof(T) is a multiple of 16 bytes and every operand
// 16-byte aligned (the caller checks).
template <typename T, bool NORM, bool RESIDUAL, bool SWIGLU>
__device__ void matvec(const T *w, const T *x, const T *g, const T *r, T *y, int n, int k, float eps) {
  constexpr int V = 16 / sizeof(T);
  const int row = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (row >= n) return;
  const uint4 *wr = reinterpret_cast<const uint4 *>(w + (size_t)row * k);
  const uint4 *ur = reinterpret_cast<const uint4 *>(w + (size_t)(SWIGLU ? row + n : row) * k);
  const uint4 *xr = reinterpret_cast<const uint4 *>(x);
  const uint4 *gr = reinterpret_cast<const uint4 *>(g);
  float acc = 0.0f, up = 0.0f, squares = 0.0f;
#pragma unroll 4
  for (int c = lane; c < k / V; c += 32) {
    const uint4 wv = wr[c], xv = xr[c];
    uint4 uv;
    if (SWIGLU) uv = ur[c];
    const T *wp = reinterpret_cast<const T *>(&wv), *xp = reinterpret_cast<const T *>(&xv);
    const T *up_p = reinterpret_cast<const T *>(&uv);
    if (NORM) {
      const uint4 gv = gr[c];
      const T *gp = reinterpret_cast<const T *>(&gv);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float xe = to_f(xp[e]);
        acc += to_f(wp[e]) * xe * to_f(gp[e]);
        if (SWIGLU) up += to_f(up_p[e]) * xe * to_f(gp[e]);
        squares += xe * xe;
      }
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) {
        acc += to_f(wp[e]) * to_f(xp[e]);
        if (SWIGLU) up += to_f(up_p[e]) * to_f(xp[e]);
      }
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    acc += __shfl_xor_sync(0xffffffff, acc, o);
    if (SWIGLU) up += __shfl_xor_sync(0xffffffff, up, o);
    if (NORM) squares += __shfl_xor_sync(0xffffffff, squares, o);
  }
  if (lane == 0) {
    if (NORM) {
      const float scale = rsqrtf(squares / k + eps);
      acc *= scale;
      up *= scale;
    }
    if (RESIDUAL) acc += to_f(r[row]);
    if (SWIGLU) acc = acc / (1.0f + expf(-acc)) * up;
    y[row] = from_f<T>(acc);
  }
}

#define FRSPEC_KERNELS(T, NAME)                                                                                       \
  extern "C" __global__ void rope_qk_##NAME(T *qkv, const float *cos, const float *sin, int heads, int d, int width,  \
                                            int interleaved) {                                                        \
    rope_qk<T>(qkv, cos, sin, heads, d, width, interleaved);                                                          \
  }                                                                                                                   \
  extern "C" __global__ void silu_mul_##NAME(const T *gate_up, T *out, size_t n, size_t width) {                      \
    silu_mul<T>(gate_up, out, n, width);                                                                              \
  }                                                                                                                   \
  extern "C" __global__ void matvec_##NAME(const T *w, const T *x, T *y, int n, int k) {                              \
    matvec<T, false, false, false>(w, x, nullptr, nullptr, y, n, k, 0.0f);                                            \
  }                                                                                                                   \
  extern "C" __global__ void norm_matvec_##NAME(const T *w, const T *x, const T *g, T *y, int n, int k, float eps) {  \
    matvec<T, true, false, false>(w, x, g, nullptr, y, n, k, eps);                                                    \
  }                                                                                                                   \
  extern "C" __global__ void norm_swiglu_matvec_##NAME(const T *w, const T *x, const T *g, T *y, int n, int k,        \
                                                       float eps) {                                                   \
    matvec<T, true, false, true>(w, x, g, nullptr, y, n, k, eps);                                                     \
  }                                                                                                                   \
  extern "C" __global__ void matvec_add_##NAME(const T *w, const T *x, const T *r, T *y, int n, int k) {              \
    matvec<T, false, true, false>(w, x, nullptr, r, y, n, k, 0.0f);                                                   \
  }                                                                                                                   \
  extern "C" __global__ void write_kv_##NAME(const T *qkv, T *pool, const unsigned *at, const float *cos,             \
                                             const float *sin, int interleaved, int heads, int kv_heads, int d,       \
                                             int capacity, int width) {                                               \
    write_kv<T>(qkv, pool, at, cos, sin, interleaved, heads, kv_heads, d, capacity, width);                           \
  }                                                                                                                   \
  extern "C" __global__ void argmax_chunks_##NAME(const T *x, float *best, unsigned *where, int cols,                 \
                                                  long long row_stride, int chunk) {                                  \
    argmax_chunks<T>(x, best, where, cols, row_stride, chunk);                                                        \
  }                                                                                                                   \
  extern "C" __global__ void rows_attention_##NAME(const T *qkv, const T *pool, const unsigned *at, const float *cos, \
                                                   const float *sin, int interleaved, T *out, int heads,              \
                                                   int kv_heads, int d, int capacity, int width, int longest,         \
                                                   float scale) {                                                     \
    rows_attention<T>(qkv, pool, at, cos, sin, interleaved, out, heads, kv_heads, d, capacity, width, longest,        \
                      scale);                                                                                         \
  }

FRSPEC_KERNELS(float, f32)
FRSPEC_KERNELS(__nv_bfloat16, bf16)
FRSPEC_KERNELS(__half, f16)
