#include "common/torch_setup.hpp"

#include <dlfcn.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <torch/torch.h>

#include <ATen/Parallel.h>

#include <atomic>
#include <thread>

namespace flowrun {

// torch's intra-op pool is OpenMP's, which keeps one team of threads per calling thread and one
// team size per thread. at::set_num_threads sets the calling thread's size and the size that
// threads touching torch for the first time start with; at::get_num_threads() makes this thread
// take its size now (torch sets it lazily, at a thread's first parallel operation).
void configure_torch(int threads, uint64_t seed) {
  int n = threads > 0 ? threads : static_cast<int>(std::thread::hardware_concurrency());
  at::set_num_threads(std::max(1, n));
  (void)at::get_num_threads();
  torch::manual_seed(seed);
}

// This thread only: its OpenMP team size, set through the OpenMP runtime that torch loaded
// (looked up, not linked: a pip torch bundles its own libgomp). After at::get_num_threads(), so
// torch's lazy setup of this thread has run and will not undo it. Without an OpenMP runtime
// (a torch built without it) at::set_num_threads(1) is the only knob, and it is process-wide
// for threads that start later; this thread is the one that matters.
void worker_thread_setup() {
  // A thread's own nice value (Linux: setpriority on the thread id). A worker preempting one of
  // the compute team's threads stalls the whole team at its next barrier; at nice 5 the
  // scheduler gives the worker about a third of a core's share while the team is busy.
  setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 5);
  (void)at::get_num_threads();
  using SetNumThreads = void (*)(int);
  static const auto omp_set_num_threads = reinterpret_cast<SetNumThreads>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  if (omp_set_num_threads)
    omp_set_num_threads(1);
  else
    at::set_num_threads(1);
}

int parallel_for_threads_used() {
  const int team = at::get_num_threads();
  std::atomic<uint64_t> seen{0};  // bit t: thread t ran a chunk
  at::parallel_for(0, 64 * team, 1, [&](int64_t, int64_t) { seen |= uint64_t{1} << (at::get_thread_num() % 64); });
  return __builtin_popcountll(seen.load());
}

}  // namespace flowrun
