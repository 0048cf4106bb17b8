// Work units shared between the calling thread and XLA's intra-op thread pool (specjax/kernels/cpu).
//
// Units are claimed one at a time from a shared counter, by the calling thread and by tasks on the
// pool. The caller waits only for units a running task has claimed, so it never waits for a task
// that has not started (no deadlock when the pool is busy), and a task that starts late finds
// nothing left. (Threads of our own that spin between calls were slower: they compete with XLA's
// threads for the same cores.) Each unit writes its own outputs, so results never depend on which
// thread ran what.
#pragma once
#include <atomic>
#include <functional>
#include <memory>
#include <thread>

namespace specjax {

struct Units {
  std::function<void(long)> run;
  long count = 0;
  std::atomic<long> next{0};
  std::atomic<long> done{0};

  void work() {
    for (long u = next.fetch_add(1, std::memory_order_relaxed); u < count;
         u = next.fetch_add(1, std::memory_order_relaxed)) {
      run(u);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Runs run(0 .. count-1) on the caller and up to `helpers` pool tasks (schedule(task) puts one on the pool).
template <typename Schedule>
inline void parallel_units(long count, long helpers, std::function<void(long)> run, Schedule schedule) {
  auto job = std::make_shared<Units>();
  job->run = std::move(run);
  job->count = count;
  for (long i = 0; i < std::min(helpers, count - 1); ++i) schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < count) std::this_thread::yield();
}

}  // namespace specjax
