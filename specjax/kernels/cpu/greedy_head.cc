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
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "matmul.h"
#include "parallel.h"

namespace {

// The matmul kernel's float32 logit: fused multiply-adds over k in order (its accumulators do exactly this).
float exact_logit(const float* x, const float* row, long K) {
  float acc = 0.0f;
  for (long k = 0; k < K; ++k) acc = std::fmaf(x[k], row[k], acc);
  return acc;
}

// Beyond this an exact float32 logit could overflow: such rows are recomputed in full.
constexpr double LARGE = 1e37;

void full_row(const float* x, const float* rows, long K, long N, int32_t* id, bool* finite) {
  long best = 0, nan = -1;
  float best_value = -std::numeric_limits<float>::infinity();
  bool all_finite = true;
  for (long j = 0; j < N; ++j) {
    const float l = exact_logit(x, rows + j * K, K);
    if (std::isnan(l)) {
      if (nan < 0) nan = j;
      all_finite = false;
      continue;
    }
    if (std::isinf(l)) all_finite = false;
    if (j == 0 || l > best_value) best = j, best_value = l;
  }
  *id = static_cast<int32_t>(nan >= 0 ? nan : best);
  *finite = all_finite;
}

void decide_row(const float* x, const float* approx, const float* rows, const float* err, long K, long N,
                int32_t* id, bool* finite) {
  double norm2 = 0.0;
  for (long k = 0; k < K; ++k) norm2 += static_cast<double>(x[k]) * x[k];
  const double norm = std::sqrt(norm2) * (1.0 + 1e-12);
  bool usable = std::isfinite(norm);
  double floor = -std::numeric_limits<double>::infinity(), largest = 0.0;
  for (long j = 0; usable && j < N; ++j) {
    const double a = approx[j], e = norm * err[j];
    if (!std::isfinite(a) || !std::isfinite(e)) usable = false;  // NaN or out-of-range weights: in full
    floor = std::max(floor, a - e);
    largest = std::max(largest, std::fabs(a) + e);
  }
  if (!usable || !(largest < LARGE)) return full_row(x, rows, K, N, id, finite);
  long best = -1;
  float best_value = 0.0f;
  for (long j = 0; j < N; ++j) {
    if (approx[j] + norm * err[j] < floor) continue;
    const float l = exact_logit(x, rows + j * K, K);
    if (best < 0 || l > best_value) best = j, best_value = l;
  }
  *id = static_cast<int32_t>(best);
  *finite = true;  // every |l_j| <= |a_j| + |x| err_j < LARGE
}

void greedy_head(const float* x, const uint16_t* w16, const float* rows, const float* err, int32_t* ids, bool* finite,
                 float* approx, long M, long K, long N, long threads, const specjax::ScheduleTask& schedule) {
  specjax::matmul_f16(x, w16, approx, M, K, N, threads, schedule);
  specjax::parallel_units(
      M, std::min<long>(threads - 1, M - 1),
      [=](long m) { decide_row(x + m * K, approx + m * N, rows, err, K, N, ids + m, finite + m); }, schedule);
}

}  // namespace

// For tests without XLA (the AVX2 build among them): one thread; approx is scratch [M, N].
extern "C" void specjax_cpu_greedy_head_reference(const float* x, const uint16_t* w16, const float* rows,
                                                  const float* err, int32_t* ids, bool* finite, float* approx, long M,
                                                  long K, long N) {
  greedy_head(x, w16, rows, err, ids, finite, approx, M, K, N, 1, [](std::function<void()>) {});
}

#ifndef SPECJAX_NO_FFI
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;

// x [M, K]; w16 the head as float16 panels [P, K, CW]; rows the float32 head with one contiguous row per
// column [N, K]; err [N]. Returns ids [M], finite [M] and the approximate logits [M, N] (XLA's scratch:
// a buffer of its own would be mapped and faulted in on every call).
static ffi::Error GreedyHeadImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F16> w16,
                                 ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::F32> err, ffi::ResultBuffer<ffi::S32> ids,
                                 ffi::ResultBuffer<ffi::PRED> finite, ffi::ResultBuffer<ffi::F32> approx) {
  auto xd = x.dimensions(), wd = w16.dimensions(), rd = rows.dimensions(), ed = err.dimensions();
  auto ad = approx->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || rd.size() != 2 || ed.size() != 1 || ad.size() != 2)
    return ffi::Error::InvalidArgument("specjax_cpu_greedy_head: expected x [M, K], w16 [P, K, CW], rows [N, K], "
                                       "err [N], approx [M, N]");
  const long M = xd[0], K = xd[1], N = rd[0];
  const long CW = specjax_cpu_matmul_panel_width();
  if (rd[1] != K || ed[0] != N || ad[0] != M || ad[1] != N || wd[1] != K || wd[2] != CW ||
      wd[0] != (N + CW - 1) / CW || ids->dimensions()[0] != M || finite->dimensions()[0] != M)
    return ffi::Error::InvalidArgument("specjax_cpu_greedy_head: shapes do not match (w16: the matmul kernel's "
                                       "panels of the head)");
  if (M == 0) return ffi::Error::Success();
  if (N == 0) return ffi::Error::InvalidArgument("specjax_cpu_greedy_head: a head of no columns has no argmax");
  const long threads = std::max<int64_t>(1, pool.num_threads());
  greedy_head(x.typed_data(), w16.typed_data(), rows.typed_data(), err.typed_data(), ids->typed_data(),
              finite->typed_data(), approx->typed_data(), M, K, N, threads,
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
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
#endif
