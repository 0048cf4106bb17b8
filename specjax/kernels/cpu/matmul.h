// The matmul kernel's entry for other kernels of the library (greedy_head.cc): y[M, N] = x[M, K] @ W
// over float16 panels [P, K, CW] (matmul.cc), its units shared with a thread pool through `schedule`.
#pragma once
#include <cstdint>
#include <functional>

// Columns per packed panel (CW).
extern "C" int specjax_cpu_matmul_panel_width();

namespace specjax {

using ScheduleTask = std::function<void(std::function<void()>)>;

void matmul_f16(const float* x, const uint16_t* w, float* y, long M, long K, long N, long threads,
                const ScheduleTask& schedule);

}  // namespace specjax
