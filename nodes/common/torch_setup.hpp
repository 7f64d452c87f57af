// Process-wide tensor-library settings, callable without including torch (the run session uses it).
#pragma once
#include <cstdint>

namespace flowrun {
// Intra-op threads for tensor math on the calling thread (0 = number of cores), and the global
// seed. Call it on the thread that runs the math: the compute thread (RunOptions::compute_thread).
void configure_torch(int threads, uint64_t seed);
// For the executor's workers when the compute thread runs the math (RunOptions::on_worker_thread),
// on the calling thread only: one intra-op thread, and a lower scheduling priority (nice +5), so
// readers and decoders that run ahead take the cores the compute thread leaves, not its own.
void worker_thread_setup();
// How many threads of the calling thread's team one at::parallel_for of flowrun's own code
// (compiled as this library is) ran on: the team size when our kernels split as torch's do,
// 1 when they were built without OpenMP (cmake/torch.cmake). For the test that checks it.
int parallel_for_threads_used();
}  // namespace flowrun
