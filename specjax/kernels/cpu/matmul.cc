// y[M, N] = x[M, K] @ W for float32 x and y, W packed once as panels [P, K, CW] (P = ceil(N / CW),
// columns zero-padded) of float32, or of float16 for weights that tolerate rounding (a drafter's: its
// drafts are verified, never emitted unchecked) at half the bytes to stream; each float16 is widened
// exactly and the products accumulate in float32. The weight matmuls of decode and tree passes on
// XLA:CPU (specjax/kernels/cpu/matmul.py).
//
// Why a kernel of our own: a pass over 2-17 rows streams every weight once, so it should cost what a
// one-row pass costs; XLA:CPU's libraries (Eigen, YNNPACK) repack the weights on every call and
// change their threading at 8 rows, so 17 rows cost 3x one row there. Here the weights are packed
// once at load: each panel of CW columns is one contiguous stream, read from memory once and reused
// from L1 by every row tile while the accumulators stay in registers.
//
// Prefetching: a unit of one or two tiles (a tile: MR rows, or in AVX2's wide shape 6 rows x half a
// panel) streams its panel with prefetches a few rows ahead in its first tile. With SPREAD_TILES or
// more tiles, all tiles share the work of
// prefetching the panel's *next* chunk into L2 while they compute on the current one, so the memory
// stream overlaps the arithmetic instead of alternating with it (2 Intel Xeon cores, 30 distinct
// 576 x 3072 weights: 9 rows 12.0 -> 10.8 ms, 17 rows 16.6 -> 13.6, 33 rows 25.4 -> 21.5, 136 rows
// 84 -> 73; a SmolLM2 tree pass of 17 nodes 40 -> 36 ms; at 5 nodes it cost +1 ms, hence the threshold).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include <immintrin.h>

#include "matmul.h"
#include "parallel.h"

// Tuned for AVX-512: 32 vector registers hold the 4 x 4 accumulator tile and a panel row. Built for
// AVX2 that tile spilled to the stack and ran 3x slower than XLA's matmuls (a Xeon with
// -march=haswell), so AVX2 (+FMA, F16C) gets shapes of its own over the same 32-column panels:
// - few rows (1-7, bound by streaming the weights): tiles of 2 rows x the whole panel (8 accumulators,
//   the panel row's 4 vectors and a broadcast: 13 of its 16 registers) and a last row;
// - many rows (from WIDE_ROWS on, bound by the FMAs; stop 56): tiles of 6 rows x half a panel (12
//   accumulators, 2 weight vectors held in registers and a broadcast: 15 registers), the 1-5 rows left
//   after them in tiles of their own. The 2-row tiles' 8 accumulators are exactly what two FMA pipes
//   of latency 4 keep busy, and GCC folded each weight load into every row's FMA (10 loads per 8
//   FMAs). On 2 AMD EPYC (Zen 4, AVX-512 hidden) cores, SmolLM2's 30 layers and head through XLA's
//   thread pool (in-process A/B, ms): 2-5 rows alike, 8 rows 26.0 -> 24.3, 12 rows 36.8 -> 33.8, 17
//   rows 49.3 -> 43.8, 33 rows 85.6 -> 75.0; at 3-5 rows the wide shape's remainders ran 5-13% slower,
//   hence two shapes.
#if defined(__AVX512F__)
constexpr int VW = 16;  // floats per vector register
constexpr int NR = 4;            // vectors per panel row: CW = NR * VW columns per panel
constexpr int MR = 4;            // rows per tile (MR x NR accumulators); 1-3 left take a tile of their own
constexpr int WIDE_MR = 0;       // no second shape
typedef __m512 vf;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int VW = 8;
constexpr int NR = 4;
constexpr int MR = 2;
constexpr int WIDE_MR = 6;       // rows per tile of the many-rows shape (half a panel each)
typedef __m256 vf;
#else
#error "specjax's CPU matmul kernel needs AVX-512F, or AVX2 with FMA and F16C"
#endif
constexpr int CW = NR * VW;
constexpr int WIDE_V = NR / 2;   // vectors per row of a wide tile: half a panel
constexpr long WIDE_ROWS = 8;    // rows from which the wide shape runs (6-7 rows measured alike either way)
constexpr long KC_FEW = 64;      // panel rows per L1-resident chunk, 1-2 row tiles
constexpr long PREFETCH = 32;    // panel rows the first of 1-2 row tiles reads ahead
constexpr long SPREAD_TILES = 3; // from this many row tiles on, the next chunk is prefetched by all
constexpr long KC_SPREAD = 128;  // panel rows per chunk then (at most 32 KB: L1-resident)
constexpr long MB = 64;          // rows per work unit (a prefill's hundreds of rows are split)

// Intrinsics, not generic vectors moved with memcpy: GCC tuned for some CPUs (-march=native naming
// rocketlake or icelake-server, e.g. a Xeon under KVM reporting model 167) copies such vectors in
// 256-bit halves through the stack, which kept the whole accumulator tile in memory: 17 rows ran 5.5x
// slower (30 x 576x3072 weights, one thread: 121 ms against 22 with sapphirerapids tuning).
#if defined(__AVX512F__)
static inline vf zero() { return _mm512_setzero_ps(); }
static inline vf load(const float* p) { return _mm512_loadu_ps(p); }
static inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf bcast(const float* p) { return _mm512_set1_ps(*p); }
static inline vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf hold(vf v) { return v; }  // not called: AVX-512 has no wide shape
static inline vf widen(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#else
static inline vf zero() { return _mm256_setzero_ps(); }
static inline vf load(const float* p) { return _mm256_loadu_ps(p); }
static inline void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf bcast(const float* p) { return _mm256_broadcast_ss(p); }
static inline vf fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
// Keeps a loaded weight vector in a register: without it GCC folds the load into each row's FMA (6
// loads of the same vector per panel row), which leaves a wide tile bound by loads, not FMAs. By value:
// through a reference GCC also stored every held vector to the stack, never reading it back.
static inline vf hold(vf v) {
  __asm__("" : "+x"(v));
  return v;
}
static inline vf widen(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif
// A panel row's VW weights as float32: float32 as stored, float16 (raw IEEE half bits) widened exactly.
static inline vf wload(const float* p) { return load(p); }
static inline vf wload(const uint16_t* p) { return widen(p); }

static_assert(MR == 4 || MR == 2, "few_rows() dispatches the rows left after its tiles: 1-3");
static_assert(WIDE_MR == 0 || WIDE_MR == 6, "the wide shape dispatches the rows left after its tiles: 1-5");

template <typename W>
constexpr long ROW_LINES = CW * sizeof(W) / 64;  // cache lines per panel row

// What a tile prefetches: cache lines [0, count) from `from`, `per_step` per iteration, into L1 (the
// chunk it streams itself) or L2 (the next chunk, for the tiles after it).
struct Ahead {
  const char* from = nullptr;
  long count = 0, per_step = 0;
  bool into_l1 = false;
};

// Rows [0, R) of x (row stride K) times the first V vectors of panel rows [k0, k0 + kn) (`w` points at
// the tile's first column; panel rows are CW apart) into y (row stride ys).
//
// Wide (the many-rows shape) holds the weight vectors in registers and carries the next line to
// prefetch from panel row to panel row, so GCC splits the loop into a prefetching part and a clean FMA
// part (worth 1-2 ms of 17 rows' ~44). The few-rows shape keeps the code measured before stop 56
// (held weights and the carried line made 3-5 rows 5-15% slower).
template <int R, int V, bool Wide, typename W>
static inline void tile(const float* __restrict x, long K, const W* __restrict w, float* __restrict y, long ys,
                        long k0, long kn, bool first, Ahead ahead) {
  vf acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) acc[r][j] = first ? zero() : load(y + r * ys + j * VW);
  long q = 0;  // the next line to prefetch
  for (long i = 0; i < kn; ++i) {
    const W* wr = w + i * CW;
    if constexpr (!Wide) q = i * ahead.per_step;
    for (const long e = std::min(ahead.count, q + ahead.per_step); q < e; ++q) {
      if (ahead.into_l1) __builtin_prefetch(ahead.from + q * 64, 0, 3);
      else __builtin_prefetch(ahead.from + q * 64, 0, 2);
    }
    vf wv[V];
    for (int j = 0; j < V; ++j) {
      if constexpr (Wide) wv[j] = hold(wload(wr + j * VW));
      else wv[j] = wload(wr + j * VW);
    }
    for (int r = 0; r < R; ++r) {
      const vf xs = bcast(x + r * K + k0 + i);
      for (int j = 0; j < V; ++j) acc[r][j] = fma(xs, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) store(y + r * ys + j * VW, acc[r][j]);
}

// The panel's next chunk, shared out over all tiles' iterations in order (`spread`), or the first tile
// reading PREFETCH rows ahead of itself: what tile number t prefetches.
template <typename W>
struct Prefetch {
  const W* wk;
  long kn, lines, per_step;
  bool spread;
  Ahead operator()(long t) const {
    constexpr long row_lines = ROW_LINES<W>;
    if (!spread)
      return t == 0 ? Ahead{reinterpret_cast<const char*>(wk + PREFETCH * CW), kn * row_lines, row_lines, true}
                    : Ahead{};
    const long done = std::min(lines, t * kn * per_step);
    return Ahead{reinterpret_cast<const char*>(wk + kn * CW) + done * 64, lines - done, per_step, false};
  }
};

// One chunk of rows [0, rows) in the few-rows shape: tiles of MR rows over the whole panel, then the
// MR - 1 at most left (AVX-512 1-3, AVX2 1).
template <typename W>
static void few_rows(const float* x, long K, const W* wk, float* y, long ys, long rows, long k0, long kn,
                     bool first, const Prefetch<W>& ahead) {
  long r = 0, t = 0;
  for (; r + MR <= rows; r += MR, ++t) tile<MR, NR, false>(x + r * K, K, wk, y + r * ys, ys, k0, kn, first, ahead(t));
  const float* xr = x + r * K;
  float* yr = y + r * ys;
  if (rows - r == 1) {
    tile<1, NR, false>(xr, K, wk, yr, ys, k0, kn, first, ahead(t));
  } else if constexpr (MR == 4) {  // 2-row tiles (AVX2) leave at most one row
    if (rows - r == 2) tile<2, NR, false>(xr, K, wk, yr, ys, k0, kn, first, ahead(t));
    if (rows - r == 3) tile<3, NR, false>(xr, K, wk, yr, ys, k0, kn, first, ahead(t));
  }
}

// R (1-5) rows of the wide shape: 1-2 over the whole panel, 3-5 over each half.
template <int R, typename W>
static inline void wide_tile(const float* x, long K, const W* wk, float* y, long ys, long k0, long kn, bool first,
                             const Prefetch<W>& ahead, long& t) {
  if constexpr (R <= 2) {
    tile<R, NR, true>(x, K, wk, y, ys, k0, kn, first, ahead(t++));
  } else {
    for (int h = 0; h < NR / WIDE_V; ++h)
      tile<R, WIDE_V, true>(x, K, wk + h * WIDE_V * VW, y + h * WIDE_V * VW, ys, k0, kn, first, ahead(t++));
  }
}

// The tile() calls many_rows() makes per chunk (the spread prefetch shares a chunk's lines over them).
constexpr long wide_tiles(long rows) {
  constexpr long step = WIDE_MR > 0 ? WIDE_MR : 1;  // AVX-512 has no wide shape and never asks
  const long left = rows % step;
  return rows / step * (NR / WIDE_V) + (left == 0 ? 0 : left <= 2 ? 1 : NR / WIDE_V);
}

// One chunk of rows [0, rows) in the wide shape: tiles of WIDE_MR rows over each half of the panel,
// then the rows left.
template <typename W>
static void many_rows(const float* x, long K, const W* wk, float* y, long ys, long rows, long k0, long kn,
                      bool first, const Prefetch<W>& ahead) {
  if constexpr (WIDE_MR > 0) {
    long r = 0, t = 0;
    for (; r + WIDE_MR <= rows; r += WIDE_MR) wide_tile<WIDE_MR>(x + r * K, K, wk, y + r * ys, ys, k0, kn, first, ahead, t);
    const float* xr = x + r * K;
    float* yr = y + r * ys;
    switch (rows - r) {
      case 1: wide_tile<1>(xr, K, wk, yr, ys, k0, kn, first, ahead, t); break;
      case 2: wide_tile<2>(xr, K, wk, yr, ys, k0, kn, first, ahead, t); break;
      case 3: wide_tile<3>(xr, K, wk, yr, ys, k0, kn, first, ahead, t); break;
      case 4: wide_tile<4>(xr, K, wk, yr, ys, k0, kn, first, ahead, t); break;
      case 5: wide_tile<5>(xr, K, wk, yr, ys, k0, kn, first, ahead, t); break;
      default: break;
    }
  }
}

// One work unit: rows [m0, m1) times panel p.
template <typename W>
static void unit(const float* x, const W* w, float* y, long M, long K, long N, long p, long m0, long m1) {
  const W* panel = w + p * K * CW;
  const long c = p * CW;
  const bool partial = c + CW > N;  // the last panel of an N that is not a multiple of CW
  float scratch[MB * CW];
  float* out = partial ? scratch : y + m0 * N + c;
  const long ys = partial ? CW : N;
  const long rows = m1 - m0;
  const bool wide = WIDE_MR > 0 && rows >= WIDE_ROWS;
  const long tiles = wide ? wide_tiles(rows) : (rows + MR - 1) / MR;
  const bool spread = tiles >= SPREAD_TILES;
  const long kc = spread ? KC_SPREAD : KC_FEW;
  for (long k0 = 0; k0 < K; k0 += kc) {
    const long kn = std::min(kc, K - k0);
    const W* wk = panel + k0 * CW;
    const long lines = spread ? std::min(kc, K - k0 - kn) * ROW_LINES<W> : 0;
    const Prefetch<W> ahead{wk, kn, lines, (lines + tiles * kn - 1) / (tiles * kn), spread};
    if (wide) many_rows(x + m0 * K, K, wk, out, ys, rows, k0, kn, k0 == 0, ahead);
    else few_rows(x + m0 * K, K, wk, out, ys, rows, k0, kn, k0 == 0, ahead);
  }
  if (partial)
    for (long r = m0; r < m1; ++r) std::memcpy(y + r * N + c, scratch + (r - m0) * CW, (N - c) * sizeof(float));
}

template <typename W, typename Schedule>
static void matmul(const float* x, const W* w, float* y, long M, long K, long N, long threads,
                   Schedule schedule) {
  if (M <= 0 || N <= 0) return;
  if (K == 0) { std::memset(y, 0, sizeof(float) * M * N); return; }  // else a partial panel copies unwritten scratch
  const long P = (N + CW - 1) / CW;
  const long units = P * ((M + MB - 1) / MB);
  // A small product (tiny models) runs on the calling thread alone: scheduling a helper on the pool
  // costs more than its share of the work (measured under load: +0.9 ms per pass of a 2-layer model).
  const bool small = K * N < (1L << 18) && M * K * N < (1L << 22);
  specjax::parallel_units(
      units, small ? 0 : threads - 1,
      [=](long u) {
        const long p = u % P, b = u / P;  // panels first: one row block's units are adjacent
        const long m0 = b * MB, m1 = std::min(M, m0 + MB);
        unit(x, w, y, M, K, N, p, m0, m1);
      },
      schedule);
}

void specjax::matmul_f16(const float* x, const uint16_t* w, float* y, long M, long K, long N, long threads,
                         const ScheduleTask& schedule) {
  matmul(x, w, y, M, K, N, threads, [&schedule](auto&& task) { schedule(std::move(task)); });
}

extern "C" int specjax_cpu_matmul_panel_width() { return CW; }

// For tests and benchmarks without XLA: one thread.
extern "C" void specjax_cpu_matmul_reference(const float* x, const float* w, float* y, long M, long K, long N) {
  matmul(x, w, y, M, K, N, 1, [](auto&&) {});
}
extern "C" void specjax_cpu_matmul_reference_f16(const float* x, const uint16_t* w, float* y, long M, long K,
                                                 long N) {
  matmul(x, w, y, M, K, N, 1, [](auto&&) {});
}

#ifndef SPECJAX_NO_FFI
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;

template <ffi::DataType WT>
static ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w,
                             ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("specjax_cpu_matmul: expected x [M, K], packed w [P, K, CW], y [M, N]");
  const long M = xd[0], K = xd[1], N = yd[1];
  if (yd[0] != M || wd[1] != K || wd[2] != CW || wd[0] != (N + CW - 1) / CW)
    return ffi::Error::InvalidArgument("specjax_cpu_matmul: shapes do not match the panel layout");
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) { std::memset(y->typed_data(), 0, sizeof(float) * M * N); return ffi::Error::Success(); }
  const long threads = std::max<int64_t>(1, pool.num_threads());
  matmul(x.typed_data(), w.typed_data(), y->typed_data(), M, K, N, threads,
         [&pool](auto&& task) { pool.Schedule(std::move(task)); });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuMatmul, MatmulImpl<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuMatmulF16, MatmulImpl<ffi::F16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
#endif
