// LoweredCopier: see kvc_lowered.h.
#include "kvc_lowered.h"

#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace kvc {

namespace {

// Lowers the calling thread (Linux applies both calls to the thread, not the process).
std::string lower_this_thread() {
#ifdef SCHED_IDLE
  sched_param param{};
  param.sched_priority = 0;
  if (sched_setscheduler(0, SCHED_IDLE, &param) == 0) return "idle";
#endif
#ifdef __linux__
  if (setpriority(PRIO_PROCESS, 0, 19) == 0) return "nice";
#endif
  return "none";
}

}  // namespace

LoweredCopier::LoweredCopier() {
  thread_ = std::thread([this] { run(); });
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return ready_; });
}

LoweredCopier::~LoweredCopier() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void LoweredCopier::copy(const PageTable& table, const TransferSpec& spec, int num_threads) {
  std::lock_guard<std::mutex> call(call_mu_);
  std::unique_lock<std::mutex> lock(mu_);
  job_ = [&table, &spec, num_threads] { cpu_copy(table, spec, num_threads); };
  error_ = nullptr;
  done_ = false;
  has_job_ = true;
  cv_.notify_all();
  cv_.wait(lock, [this] { return done_; });
  job_ = nullptr;
  if (error_) std::rethrow_exception(error_);
}

void LoweredCopier::run() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    priority_ = lower_this_thread();
#ifdef SYS_gettid
    tid_ = static_cast<long>(syscall(SYS_gettid));
#endif
    ready_ = true;
  }
  cv_.notify_all();
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return has_job_ || stop_; });
    if (!has_job_) return;  // stopping, nothing left to run
    has_job_ = false;
    std::function<void()> job = job_;
    lock.unlock();
    std::exception_ptr error;
    try {
      job();
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    error_ = error;
    done_ = true;
    cv_.notify_all();
  }
}

}  // namespace kvc
