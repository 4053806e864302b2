// A copy thread of its own in the lowest CPU class: how a tenant's copies give way.
//
// The daemon lowers the copies of a principal that copies more than another active one, so
// work it already started never takes a core from a lighter tenant's request. The thread that
// runs them is native and never takes Python's interpreter lock, and no Python thread waits
// for it while holding that lock (construction does not wait for it to lower itself, and
// destruction does not join it): a lowered thread a Python thread waited for under the lock
// could keep every thread of the daemon waiting while it waited for a core (measured: 100 to
// 500 ms with a busy process on the daemon's core). The caller of ``copy`` blocks, with the
// lock released, until its copy ran there; one copy at a time.
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "kvc.h"

namespace kvc {

// What the copier and its thread share; the thread keeps it alive, so the copier can leave
// without joining a thread that may wait a long time for a core.
struct LoweredState {
  std::mutex mu;
  std::condition_variable cv;
  std::function<void()> job;
  std::exception_ptr error;
  bool has_job = false;
  bool done = false;
  bool stop = false;
  bool ready = false;
  long tid = 0;
  std::atomic<int> priority{-1};  // -1 not yet, 0 none, 1 idle (SCHED_IDLE), 2 nice 19
};

class LoweredCopier {
 public:
  LoweredCopier();
  ~LoweredCopier();  // tells the thread to leave; never joins it
  LoweredCopier(const LoweredCopier&) = delete;
  LoweredCopier& operator=(const LoweredCopier&) = delete;

  // cpu_copy on the lowered thread; returns when it is done, rethrows what it threw.
  void copy(const PageTable& table, const TransferSpec& spec, int num_threads);
  // The class the thread got: "idle" (SCHED_IDLE), "nice" (nice 19), "none", or "pending".
  std::string priority() const;
  // The thread's kernel id (for tests and operators: /proc/<pid>/task/<tid>).
  long thread_id() const { return state_->tid; }

 private:
  std::mutex call_mu_;  // one caller at a time
  std::shared_ptr<LoweredState> state_;
};

}  // namespace kvc
