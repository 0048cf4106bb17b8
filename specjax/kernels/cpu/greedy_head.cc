// The greedy decision of an LLM's head for float32 rows x [M, K]: for each row, the index of its largest
// logit x[m] . W[:, j] (the first on ties, the first NaN where there is one) and whether every logit is
// finite, exactly as the float32 matmul kernel's logits (matmul.cc) would decide it, without
// computing all N of them in float32 (specjax/kernels/cpu/greedy_head.py).
//
// Why: greedy verification reads one argmax per tree node, and SmolLM2's head [576, 49152] in float32
// is 113 MB to stream per pass (2.7 ms of a ~20 ms step at 8 nodes on 2 EPYC cores, and the logits'
// argmax and finiteness checks another 0.5-1.5 ms). Here the head is streamed as float16 panels (half
// the bytes), giving approximate logits a_j; each differs from the exact float32 logit l_j by at most
//   |l_j - a_j| <= |x| * err_j,  err_j = |w_j - w16_j| + gamma_K (|w_j| + |w16_j|)  (2-norms)
// (Cauchy-Schwarz on the rounded weights, plus both float32 sums' rounding, gamma_K = K u / (1 - K u);
// err_j is computed in float64 when the head is packed, with slack). Only the columns whose interval
// a_j +- |x| err_j reaches the largest lower end can hold the maximum; those few are recomputed exactly
// (the same float32 fused multiply-adds in the same order as the matmul kernel, so the same bits) and
// the first largest wins. Every column tied with the maximum is among them, so ties resolve as in a
// full argmax. A row whose approximate logits are not all finite, or are large enough that float32 could
// overflow, is recomputed in full: its finiteness and first-NaN rule then come from the exact logits.
//
// Seeded sampling decides the same way (the same target): a row with inverse temperature r > 0
// takes its token as the first argmax of the Gumbel-max scores s_j = fl(fl(l_j r) + g_j), g one row of
// the request's noise G(seed, t) (specjax.decoding.sampling.gumbel_scores, whose XLA form keeps the
// product and the sum two roundings). Multiplying and adding are monotone, so with |l_j - a_j| <= |x| err_j
//   s_j in [(a_j - |x| err_j) r + g_j - d_j, (a_j + |x| err_j) r + g_j + d_j],
//   d_j = 2^-22 (2 (|a_j| + |x| err_j) r + |g_j|)
// (the two float32 roundings cost at most 2^-24 (2.01 |l_j r| + |g_j|); the factor 4 covers the
// float64 arithmetic of the bounds); the columns whose upper end reaches the largest lower end are
// recomputed exactly, in the same two roundings. A row with r = 0 decides greedily (a greedy request
// in a seeded batch).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "matmul.h"
#include "parallel.h"

namespace {

// The matmul kernel's float32 logit: fused multiply-adds over k in order (its accumulators do exactly this).
float exact_logit(const float* x, const float* row, long K) {
  float acc = 0.0f;
  for (long k = 0; k < K; ++k) acc = std::fmaf(x[k], row[k], acc);
  return acc;
}

// Beyond this an exact float32 logit (or score) could overflow: such rows are recomputed in full.
constexpr double LARGE = 1e37;

// How a row turns a logit into the value its argmax reads: itself (greedy, r = 0), or the Gumbel-max
// score fl(fl(l r) + g_j) with noise g.
struct Score {
  float r = 0.0f;
  const float* g = nullptr;

  bool greedy() const { return r == 0.0f; }
  float of(float l, long j) const {
    if (greedy()) return l;
    // volatile: the product is rounded to float32 on its own, never fused with the sum into one FMA
    volatile float q = l * r;
    return q + g[j];
  }
};

void full_row(const float* x, const float* rows, long K, long N, Score score, int32_t* id, bool* finite) {
  long best = 0, nan = -1;
  float best_value = -std::numeric_limits<float>::infinity();
  bool all_finite = true;
  for (long j = 0; j < N; ++j) {
    const float l = exact_logit(x, rows + j * K, K);
    if (!std::isfinite(l)) all_finite = false;
    const float s = score.of(l, j);
    if (std::isnan(s)) {
      if (nan < 0) nan = j;
      continue;
    }
    if (j == 0 || s > best_value) best = j, best_value = s;
  }
  *id = static_cast<int32_t>(nan >= 0 ? nan : best);
  *finite = all_finite;
}

void decide_row(const float* x, const float* approx, const float* rows, const float* err, long K, long N,
                Score score, int32_t* id, bool* finite) {
  double norm2 = 0.0;
  for (long k = 0; k < K; ++k) norm2 += static_cast<double>(x[k]) * x[k];
  const double norm = std::sqrt(norm2) * (1.0 + 1e-12);
  const double gamma = K * 0x1p-24 / (1.0 - K * 0x1p-24);
  const double tiny = K * 0x1p-125;  // underflow / flush-to-zero: absolute error per FMA
  const double r = score.r;
  bool usable = std::isfinite(norm) && (score.greedy() || (std::isfinite(r) && r > 0.0));
  double floor = -std::numeric_limits<double>::infinity(), largest = 0.0;
  for (long j = 0; usable && j < N; ++j) {
    const double a = approx[j], e = norm * err[j] + tiny;
    if (!std::isfinite(a) || !std::isfinite(e)) usable = false;  // NaN or out-of-range weights: in full
    // e / gamma >= |x| |w_j| >= every partial sum of either float32 dot product: none can overflow
    largest = std::max(largest, std::fabs(a) + e + (gamma > 0 ? e / gamma : 0.0));
    if (score.greedy()) {
      floor = std::max(floor, a - e);
      continue;
    }
    const double g = score.g[j], m = (std::fabs(a) + e) * r;
    if (!std::isfinite(g)) usable = false;
    largest = std::max(largest, m + std::fabs(g));
    floor = std::max(floor, (a - e) * r + g - 0x1p-22 * (2.0 * m + std::fabs(g)));
  }
  if (!usable || !(largest < LARGE)) return full_row(x, rows, K, N, score, id, finite);
  long best = -1;
  float best_value = 0.0f;
  for (long j = 0; j < N; ++j) {
    const double a = approx[j], e = norm * err[j] + tiny;
    if (score.greedy()) {
      if (a + e < floor) continue;
    } else {
      const double g = score.g[j], m = (std::fabs(a) + e) * r;
      if ((a + e) * r + g + 0x1p-22 * (2.0 * m + std::fabs(g)) < floor) continue;
    }
    const float s = score.of(exact_logit(x, rows + j * K, K), j);
    if (best < 0 || s > best_value) best = j, best_value = s;
  }
  *id = static_cast<int32_t>(best);
  *finite = true;  // every |l_j| <= |a_j| + |x| err_j < LARGE
}

// inv_t [M] (nullptr: every row greedy), noise [R, N] and noise_row [M] (its row of noise for each x row).
void decide_head(const float* x, const uint16_t* w16, const float* rows, const float* err, const float* inv_t,
                 const float* noise, const int32_t* noise_row, int32_t* ids, bool* finite, float* approx, long M,
                 long K, long N, long threads, const specjax::ScheduleTask& schedule) {
  specjax::matmul_f16(x, w16, approx, M, K, N, threads, schedule);
  specjax::parallel_units(
      M, std::min<long>(threads - 1, M - 1),
      [=](long m) {
        Score score;
        if (inv_t != nullptr && inv_t[m] != 0.0f) score = Score{inv_t[m], noise + noise_row[m] * N};
        decide_row(x + m * K, approx + m * N, rows, err, K, N, score, ids + m, finite + m);
      },
      schedule);
}

}  // namespace

// For tests without XLA (the AVX2 build among them): one thread; approx is scratch [M, N].
extern "C" void specjax_cpu_greedy_head_reference(const float* x, const uint16_t* w16, const float* rows,
                                                  const float* err, int32_t* ids, bool* finite, float* approx, long M,
                                                  long K, long N) {
  decide_head(x, w16, rows, err, nullptr, nullptr, nullptr, ids, finite, approx, M, K, N, 1,
              [](std::function<void()>) {});
}

// The same for seeded rows: inv_t [M] (0 = greedy), noise [R, N], noise_row [M] in [0, R).
extern "C" void specjax_cpu_sampled_head_reference(const float* x, const uint16_t* w16, const float* rows,
                                                   const float* err, const float* inv_t, const float* noise,
                                                   const int32_t* noise_row, int32_t* ids, bool* finite,
                                                   float* approx, long M, long K, long N) {
  decide_head(x, w16, rows, err, inv_t, noise, noise_row, ids, finite, approx, M, K, N, 1,
              [](std::function<void()>) {});
}

#ifndef SPECJAX_NO_FFI
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;

// x [M, K]; w16 the head as float16 panels [P, K, CW]; rows the float32 head with one contiguous row per
// column [N, K]; err [N]; inv_t [M] (0: a greedy row); noise [R, N] and noise_row [M] (in [0, R) for every
// row with inv_t != 0; greedy rows never read them, so an all-greedy call passes R = 0). Returns ids [M],
// finite [M] and the approximate logits [M, N] (XLA's scratch: a buffer of its own would be mapped and
// faulted in on every call).
static ffi::Error GreedyHeadImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F16> w16,
                                 ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::F32> err, ffi::Buffer<ffi::F32> inv_t,
                                 ffi::Buffer<ffi::F32> noise, ffi::Buffer<ffi::S32> noise_row,
                                 ffi::ResultBuffer<ffi::S32> ids, ffi::ResultBuffer<ffi::PRED> finite,
                                 ffi::ResultBuffer<ffi::F32> approx) {
  auto xd = x.dimensions(), wd = w16.dimensions(), rd = rows.dimensions(), ed = err.dimensions();
  auto ad = approx->dimensions(), nd = noise.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || rd.size() != 2 || ed.size() != 1 || ad.size() != 2 || nd.size() != 2 ||
      inv_t.dimensions().size() != 1 || noise_row.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("specjax_cpu_greedy_head: expected x [M, K], w16 [P, K, CW], rows [N, K], "
                                       "err [N], inv_t [M], noise [R, N], noise_row [M], approx [M, N]");
  const long M = xd[0], K = xd[1], N = rd[0];
  const long CW = specjax_cpu_matmul_panel_width();
  if (rd[1] != K || ed[0] != N || ad[0] != M || ad[1] != N || wd[1] != K || wd[2] != CW ||
      wd[0] != (N + CW - 1) / CW || ids->dimensions()[0] != M || finite->dimensions()[0] != M ||
      inv_t.dimensions()[0] != M || noise_row.dimensions()[0] != M || nd[1] != N)
    return ffi::Error::InvalidArgument("specjax_cpu_greedy_head: shapes do not match (w16: the matmul kernel's "
                                       "panels of the head)");
  if (M == 0) return ffi::Error::Success();
  if (N == 0) return ffi::Error::InvalidArgument("specjax_cpu_greedy_head: a head of no columns has no argmax");
  const float* r = inv_t.typed_data();
  const int32_t* row = noise_row.typed_data();
  for (long m = 0; m < M; ++m)
    if (r[m] != 0.0f && (row[m] < 0 || row[m] >= nd[0]))
      return ffi::Error::InvalidArgument("specjax_cpu_greedy_head: a sampled row's noise_row " +
                                         std::to_string(row[m]) + " is outside the noise's " + std::to_string(nd[0]) +
                                         " rows");
  const long threads = std::max<int64_t>(1, pool.num_threads());
  decide_head(x.typed_data(), w16.typed_data(), rows.typed_data(), err.typed_data(), r, noise.typed_data(), row,
              ids->typed_data(), finite->typed_data(), approx->typed_data(), M, K, N, threads,
              [&pool](std::function<void()> task) { pool.Schedule(std::move(task)); });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuGreedyHead, GreedyHeadImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
#endif
