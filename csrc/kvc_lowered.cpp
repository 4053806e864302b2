// LoweredCopier: see kvc_lowered.h.
#include "kvc_lowered.h"

#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace kvc {

namespace {

// Lowers the calling thread (Linux applies both calls to the thread, not the process; the
// nice fallback is Linux only, elsewhere it would lower the whole process).
int lower_this_thread() {
#ifdef SCHED_IDLE
  sched_param param{};
  param.sched_priority = 0;
  if (sched_setscheduler(0, SCHED_IDLE, &param) == 0) return 1;
#endif
#ifdef __linux__
  if (setpriority(PRIO_PROCESS, 0, 19) == 0) return 2;
#endif
  return 0;
}

void run(std::shared_ptr<LoweredState> s) {
#ifdef __linux__
  pthread_setname_np(pthread_self(), "kvcache-lowered");  // what top -H and /proc show
#endif
  {
    std::lock_guard<std::mutex> lock(s->mu);
#ifdef SYS_gettid
    s->tid = static_cast<long>(syscall(SYS_gettid));
#endif
    s->ready = true;  // before lowering: the constructor's wait is at normal priority
  }
  s->cv.notify_all();
  s->priority.store(lower_this_thread());
  std::unique_lock<std::mutex> lock(s->mu);
  for (;;) {
    s->cv.wait(lock, [&s] { return s->has_job || s->stop; });
    if (!s->has_job) return;  // stopping, nothing left to run
    s->has_job = false;
    std::function<void()> job = std::move(s->job);  // a move: nothing allocated here
    lock.unlock();
    std::exception_ptr error;
    try {
      job();
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    s->error = error;
    s->done = true;
    s->cv.notify_all();
  }
}

}  // namespace

LoweredCopier::LoweredCopier() : state_(std::make_shared<LoweredState>()) {
  std::thread(run, state_).detach();
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->cv.wait(lock, [this] { return state_->ready; });
}

LoweredCopier::~LoweredCopier() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stop = true;
  }
  state_->cv.notify_all();
}

void LoweredCopier::copy(const PageTable& table, const TransferSpec& spec, int num_threads) {
  std::lock_guard<std::mutex> call(call_mu_);
  LoweredState& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  s.job = [&table, &spec, num_threads] { cpu_copy(table, spec, num_threads); };
  s.error = nullptr;
  s.done = false;
  s.has_job = true;
  s.cv.notify_all();
  s.cv.wait(lock, [&s] { return s.done; });
  if (s.error) std::rethrow_exception(s.error);
}

std::string LoweredCopier::priority() const {
  switch (state_->priority.load()) {
    case 1:
      return "idle";
    case 2:
      return "nice";
    case 0:
      return "none";
    default:
      return "pending";
  }
}

}  // namespace kvc
