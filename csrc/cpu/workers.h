// Workers: the kernel's threads, built for a node whose cores other processes use too
// (docs/benchmarks.md#a-shared-node has the measurements behind each rule).
//
// A call runs its items on the calling thread and on at most `threads - 1` worker threads, every
// participant claiming the next item from one atomic counter. A worker joins only while items are left
// to claim: one that the operating system has not scheduled by then holds no one back, and the call
// waits only for the items that workers have claimed and are running. (A fork-join team, as OpenMP's,
// waits at its closing barrier for every thread of the team, scheduled or not.)
//
// A worker must not take the calling thread's core. On Linux it runs under SCHED_BATCH, which keeps its
// normal share of the processor but never preempts the running thread when it wakes: on an idle core it
// starts at once, on a busy one it waits its turn. A worker that finds itself on the core the call
// started on goes back to sleep without joining: when no core is idle, Linux wakes a thread on the
// waker's core, where it can only take turns with the caller. And when a call's workers ran nothing
// (no core was free in time), the next calls do not wake them (see learn()).
//
// Workers sleep on their own condition variable between calls; nothing spins past the work. Calls from
// several threads at once are served one at a time by the workers; a call that finds them busy runs
// on its own thread alone. A child process made by fork starts with no workers (see workers()).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#include <unistd.h>
#endif

namespace ktae {

class Workers {
 public:
  // Most threads a call may use (the calling thread included).
  static constexpr int kMaxThreads = 1024;

  // Run participate() on this thread and on up to threads - 1 workers, those that start before this
  // thread's own participate() has returned; return once every one of them has returned. participate()
  // claims work until none is left (see for_each_item); an exception it throws on a worker is rethrown
  // here (the first one).
  template <typename Fn>
  void run(int threads, Fn&& participate) {
    const int wanted = std::min(threads, kMaxThreads) - 1;
    std::unique_lock<std::mutex> running(run_mutex_, std::try_to_lock);
    if (wanted <= 0 || !running.owns_lock()) {  // one thread, or the workers serve another call
      participate();
      return;
    }
    const Mode mode = this->mode();
    if (mode != Mode::kTogether && skip_ > 0) {  // workers did not help lately: see backoff_
      --skip_;
      running.unlock();
      participate();
      return;
    }
    Job<Fn> job(participate);
    const int64_t items_before = worker_items();
    open(&job, std::min(wanted, started(wanted)));
    if (mode == Mode::kTogether)
      while (seats(state_.load(std::memory_order_acquire)) != 0) std::this_thread::yield();
    try {
      participate();
    } catch (...) {
      close();
      throw;
    }
    close();
    learn(worker_items() > items_before);
    if (job.error) std::rethrow_exception(job.error);
  }

  // Test seams. kHeld: a woken worker waits before it looks for a call, as one that the operating
  // system does not schedule; calls run on their own thread until the mode changes. kTogether: a call
  // claims no item before every worker it woke has joined, from any core (every split of the items
  // between threads is then exercised). kNormal: as shipped.
  enum class Mode { kNormal, kHeld, kTogether };

  void set_mode(Mode mode) {
    {
      std::lock_guard<std::mutex> lock(mode_mutex_);
      mode_ = mode;
    }
    mode_changed_.notify_all();
  }

  // Items that workers (not calling threads) have run since the module was loaded.
  int64_t worker_items() const { return worker_items_.load(std::memory_order_relaxed); }

  // Count `items` run by this thread (for worker_items).
  void ran(int64_t items) {
    if (items > 0 && on_worker()) worker_items_.fetch_add(items, std::memory_order_relaxed);
  }

 private:
  struct JobBase {
    virtual void run() = 0;
    std::exception_ptr error;  // the first exception of a worker's run()
    std::mutex error_mutex;
  };

  template <typename Fn>
  struct Job final : JobBase {
    explicit Job(Fn& fn) : fn(fn) {}
    void run() override { fn(); }
    Fn& fn;
  };

  struct Worker {
    std::mutex mutex;
    std::condition_variable wake;
    bool signalled = false;
  };

  // state_: bit 32 the job is open, bits 16-31 seats left, bits 0-15 workers inside the job.
  static constexpr uint64_t kOpen = uint64_t(1) << 32;
  static constexpr uint64_t kSeat = uint64_t(1) << 16;
  static constexpr uint64_t kInside = 1;
  static uint64_t inside(uint64_t state) { return state & 0xffff; }
  static uint64_t seats(uint64_t state) { return (state >> 16) & 0xffff; }

  // Workers started, up to `wanted` (fewer when the system refuses more threads).
  int started(int wanted) {
    try {
      while (int(workers_.size()) < wanted) {
        auto worker = std::make_unique<Worker>();
        std::thread(&Workers::serve, this, worker.get()).detach();
        workers_.push_back(std::move(worker));
      }
    } catch (const std::exception&) {  // std::system_error, std::bad_alloc: run with those there are
    }
    return int(workers_.size());
  }

  // Publish `job` with `seats` seats and wake that many workers.
  void open(JobBase* job, int seats) {
    job_ = job;
    caller_core_.store(core(), std::memory_order_relaxed);
    state_.store(kOpen | uint64_t(seats) * kSeat, std::memory_order_release);
    for (int w = 0; w < seats; ++w) {
      Worker& worker = *workers_[size_t(w)];
      {
        std::lock_guard<std::mutex> lock(worker.mutex);
        worker.signalled = true;
      }
      worker.wake.notify_one();
    }
  }

  // After a call whose workers ran nothing (none on another core in time: the cores are busy), the next
  // backoff_ calls run alone, backoff_ doubling up to kMaxBackoff while calls keep finding them useless;
  // a useful call resets it. Counted in calls, not time: a trainer calling once a step still skips.
  void learn(bool useful) {
    backoff_ = useful ? 0 : std::min(kMaxBackoff, std::max(1, 2 * backoff_));
    skip_ = backoff_;
  }

  // No worker joins from now on; wait for those inside.
  void close() {
    if (inside(state_.fetch_and(~kOpen, std::memory_order_acq_rel)) == 0) return;
    // the last items of the workers usually end within microseconds: look before sleeping
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kLookUs);
    while (std::chrono::steady_clock::now() < until)
      if (inside(state_.load(std::memory_order_acquire)) == 0) return;
    std::unique_lock<std::mutex> lock(done_mutex_);
    done_.wait(lock, [&] { return inside(state_.load(std::memory_order_acquire)) == 0; });
  }

  // A worker's loop: sleep until signalled, join the open job if a seat is left, run it, leave.
  void serve(Worker* self) {
    on_worker() = true;
#ifdef __linux__
    pthread_setname_np(pthread_self(), "ktae-cpu");
    sched_param param{};
    pthread_setschedparam(pthread_self(), SCHED_BATCH, &param);  // best effort: without it, as before
#endif
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(self->mutex);
        self->wake.wait(lock, [&] { return self->signalled; });
        self->signalled = false;
      }
      if (wait_for_mode() != Mode::kTogether && on_callers_core()) continue;
      if (!enter()) continue;
      JobBase* job = job_;
      try {
        job->run();
      } catch (...) {
        std::lock_guard<std::mutex> lock(job->error_mutex);
        if (!job->error) job->error = std::current_exception();
      }
      leave();
    }
  }

  static bool& on_worker() {
    thread_local bool worker = false;
    return worker;
  }

  Mode mode() {
    std::lock_guard<std::mutex> lock(mode_mutex_);
    return mode_;
  }

  // The mode, once it is not kHeld.
  Mode wait_for_mode() {
    std::unique_lock<std::mutex> lock(mode_mutex_);
    mode_changed_.wait(lock, [&] { return mode_ != Mode::kHeld; });
    return mode_;
  }

  // The processor this thread runs on (-1 where unknown).
  static int core() {
#ifdef __linux__
    return sched_getcpu();
#else
    return -1;
#endif
  }

  bool on_callers_core() const {
    const int here = core();
    return here >= 0 && here == caller_core_.load(std::memory_order_relaxed);
  }

  // Take a seat of the open job; false when it is closed or full.
  bool enter() {
    uint64_t state = state_.load(std::memory_order_relaxed);
    do {
      if (!(state & kOpen) || seats(state) == 0) return false;
    } while (!state_.compare_exchange_weak(state, state - kSeat + kInside, std::memory_order_acquire,
                                           std::memory_order_relaxed));
    return true;
  }

  void leave() {
    const uint64_t state = state_.fetch_sub(kInside, std::memory_order_acq_rel) - kInside;
    if (inside(state) == 0 && !(state & kOpen)) {
      { std::lock_guard<std::mutex> lock(done_mutex_); }  // the caller is waiting, or will see inside == 0
      done_.notify_one();
    }
  }

  static constexpr int kLookUs = 20;
  static constexpr int kMaxBackoff = 64;

  std::mutex run_mutex_;  // held by the call the workers serve
  int backoff_ = 0, skip_ = 0;  // see learn(); under run_mutex_
  std::vector<std::unique_ptr<Worker>> workers_;
  JobBase* job_ = nullptr;
  std::atomic<uint64_t> state_{0};
  std::atomic<int> caller_core_{-1};  // the core the open job's call started on
  std::mutex done_mutex_;
  std::condition_variable done_;
  std::atomic<int64_t> worker_items_{0};
  std::mutex mode_mutex_;
  std::condition_variable mode_changed_;
  Mode mode_ = Mode::kNormal;
};

// The process's workers (never destroyed: workers may outlive static destruction). A child made by
// fork has none of its parent's threads: it gets a new, empty set.
inline Workers& workers() {
#ifdef __linux__
  static std::atomic<Workers*> current{nullptr};
  static std::atomic<pid_t> owner{0};
  const pid_t pid = getpid();
  if (owner.load(std::memory_order_acquire) != pid) {
    static std::mutex creating;
    std::lock_guard<std::mutex> lock(creating);
    if (owner.load(std::memory_order_relaxed) != pid) {
      current.store(new Workers(), std::memory_order_relaxed);
      owner.store(pid, std::memory_order_release);
    }
  }
  return *current.load(std::memory_order_relaxed);
#else
  static Workers* first = new Workers();
  return *first;
#endif
}

// fn(item, state) for every item in [0, n), on up to `threads` threads (see Workers), each participant
// with its own state from make_state() (made only by a participant that claims an item) and
// done(state) after its last item.
template <typename Make, typename Fn, typename Done>
void for_each_item(int64_t n, int threads, Make make_state, Fn fn, Done done) {
  std::atomic<int64_t> next{0};
  Workers& team = workers();
  auto participate = [&] {
    int64_t item = next.fetch_add(1, std::memory_order_relaxed);
    if (item >= n) return;
    auto state = make_state();
    int64_t ran = 0;
    try {
      for (; item < n; item = next.fetch_add(1, std::memory_order_relaxed), ++ran) fn(item, state);
    } catch (...) {
      next.store(n, std::memory_order_relaxed);  // the others stop claiming
      done(state);
      throw;
    }
    done(state);
    team.ran(ran);
  };
  team.run(int(std::min<int64_t>(threads, n)), participate);
}

}  // namespace ktae
