// The helper pool of work_pool.h. Helpers spin briefly for the next job (a decode step posts
// jobs microseconds apart), then yield for 2 ms, then sleep on a condition variable until one is
// posted (no periodic wake-up: an idle worker costs nothing).
//
// Lifetime of a job (it lives on the poster's stack): the poster publishes it in `current`,
// works, waits until every chunk is done, clears `current`, then waits until no helper is inside
// (`active`). A helper enters by incrementing `active` and then re-reading `current`: only if the
// job is still published does it touch it, so a job is never read after its poster returned.
#include "work_pool.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace pds_cpu {
namespace {

struct Job {
  void (*fn)(void*, int64_t);
  void* ctx;
  int64_t chunks;
  int helpers;                      // helpers with index < helpers may take part
  uint64_t id;
  std::atomic<int64_t> next{0};     // the next chunk to claim
  std::atomic<int64_t> done{0};     // chunks finished
};

// Claim and run chunks until none is left.
void work(Job& job) {
  for (int64_t c = job.next.fetch_add(1); c < job.chunks; c = job.next.fetch_add(1)) {
    job.fn(job.ctx, c);
    job.done.fetch_add(1);
  }
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

class Pool {
 public:
  void run(int64_t chunks, int threads, void (*fn)(void*, int64_t), void* ctx) {
    std::unique_lock<std::mutex> poster(post_, std::try_to_lock);
    if (!poster.owns_lock() || threads <= 1 || chunks <= 1) {  // busy (another caller) or alone
      for (int64_t c = 0; c < chunks; ++c) fn(ctx, c);
      return;
    }
    grow(threads - 1);
    Job job;
    job.fn = fn;
    job.ctx = ctx;
    job.chunks = chunks;
    job.helpers = threads - 1;
    job.id = ++ids_;
    current_.store(&job);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_);
      wake_.notify_all();
    }
    work(job);
    while (job.done.load() < chunks) cpu_relax();  // only chunks a helper already claimed
    current_.store(nullptr);
    while (active_.load() > 0) cpu_relax();        // a helper between its entry and its check
  }

 private:
  void grow(int helpers) {
    while (static_cast<int>(threads_.size()) < helpers) {
      const int index = static_cast<int>(threads_.size());
      threads_.emplace_back([this, index] { loop(index); });
      threads_.back().detach();  // the pool lives as long as the process
    }
  }

  void loop(int index) {
    uint64_t last = 0;
    auto idle_since = std::chrono::steady_clock::now();
    for (int spins = 0;; ++spins) {
      if (Job* seen = current_.load()) {
        active_.fetch_add(1);
        if (current_.load() == seen && seen->id != last && index < seen->helpers) {
          last = seen->id;
          work(*seen);
          active_.fetch_sub(1);
          spins = 0;
          idle_since = std::chrono::steady_clock::now();
          continue;
        }
        active_.fetch_sub(1);
      }
      if (spins < 2000) {
        cpu_relax();
      } else if (std::chrono::steady_clock::now() - idle_since < std::chrono::milliseconds(2)) {
        std::this_thread::yield();
      } else {  // idle: sleep until a job is posted
        std::unique_lock<std::mutex> lock(sleep_);
        sleepers_.fetch_add(1);
        // no timeout: an idle server must not wake (the poster notifies under `sleep_` after
        // publishing, and this predicate is read under it, so no post is missed)
        wake_.wait(lock, [&] { return current_.load() != nullptr; });
        sleepers_.fetch_sub(1);
        spins = 0;
        idle_since = std::chrono::steady_clock::now();
      }
    }
  }

  std::mutex post_;                 // one poster at a time
  std::mutex sleep_;
  std::condition_variable wake_;
  std::atomic<Job*> current_{nullptr};
  std::atomic<int> active_{0};
  std::atomic<int> sleepers_{0};
  uint64_t ids_ = 0;
  std::vector<std::thread> threads_;
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: detached helpers may still be looping at exit
  return *p;
}

}  // namespace

void parallel_chunks(int64_t chunks, int threads, void (*fn)(void* ctx, int64_t c), void* ctx) {
  pool().run(chunks, threads, fn, ctx);
}

}  // namespace pds_cpu
