// A copy thread of its own in the lowest CPU class: how a tenant's copies give way.
//
// The daemon lowers the copies of a principal that wants more copying than another active
// one, so work it already started never takes a core from a lighter tenant's request. The
// thread that runs them is native and never takes Python's interpreter lock: a lowered
// thread that held it could be preempted holding it and then wait for a core no other
// thread leaves, stalling every thread of the daemon (measured: 100 to 400 ms with a busy
// process on the daemon's core). The caller blocks, with the lock released, until its copy
// ran there; one copy at a time.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "kvc.h"

namespace kvc {

class LoweredCopier {
 public:
  LoweredCopier();
  ~LoweredCopier();
  LoweredCopier(const LoweredCopier&) = delete;
  LoweredCopier& operator=(const LoweredCopier&) = delete;

  // cpu_copy on the lowered thread; returns when it is done, rethrows what it threw.
  void copy(const PageTable& table, const TransferSpec& spec, int num_threads);
  // The class the thread got: "idle" (SCHED_IDLE), "nice" (nice 19) or "none".
  const std::string& priority() const { return priority_; }
  // The thread's kernel id (for tests and operators: /proc/<pid>/task/<tid>).
  long thread_id() const { return tid_; }

 private:
  void run();

  std::mutex call_mu_;  // one caller at a time
  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void()> job_;
  std::exception_ptr error_;
  bool has_job_ = false;
  bool done_ = false;
  bool stop_ = false;
  bool ready_ = false;
  std::string priority_ = "none";
  long tid_ = 0;
  std::thread thread_;
};

}  // namespace kvc
