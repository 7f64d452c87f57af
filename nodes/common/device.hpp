// run.device: where a run's tensors live, and the device streams that go with it.
//
//   auto     CUDA if this build has it (FLOWRUN_CUDA) and a GPU is visible, else the CPU;
//   cpu      the CPU (nodes run synchronously, no device streams);
//   cuda     a GPU: the local rank's (mpirun/srun start one process per GPU), modulo the count;
//   cuda:N   GPU N.
// Resolution is deterministic, so every node (and the run session) gets the same answer on its own:
// nodes call run_device(ctx.run()) for where to create their tensors; the run session calls
// resolve_device() once to report it and make_device_streams() for the executor.
// Torch-free on purpose (session/run_session.cpp includes it): c10::Device is only declared here.
#pragma once
#include <memory>
#include <string>

#include "device_streams.hpp"

namespace c10 {
struct Device;
}

namespace flowrun {

struct RunInfo;

// "cpu" or "cuda:N". Throws std::runtime_error naming run.device and what to do when the
// request cannot be honoured (no CUDA in this build, no GPU visible, N out of range).
std::string resolve_device(const std::string& requested, int local_rank);

// resolve_device(run.device, this process's local rank) as a torch device.
c10::Device run_device(const RunInfo& run);

// The executor's device streams for a resolved device: nullptr for "cpu" (no streams: nodes
// run synchronously), CUDA streams and events for "cuda:N" (FLOWRUN_CUDA builds).
std::unique_ptr<DeviceStreams> make_device_streams(const std::string& resolved);

// Block the host until the work queued on `device`'s current stream is done (a no-op on the
// CPU). For code run without device streams; with them, sync through events instead.
void synchronize_device(const c10::Device& device);

// The most bytes this process's tensors held at once on `device` since it started (CUDA: the
// caching allocator's peak of allocated bytes, what torch.cuda.max_memory_allocated reports);
// -1 for the CPU, whose figure is the peak resident memory of the process.
double peak_device_memory(const c10::Device& device);

// Bytes this process could still allocate on `device`: CUDA: what the driver has free plus what
// the caching allocator holds unused; 0 for the CPU (common/memory.hpp's available_host_memory
// answers there).
double available_device_memory(const c10::Device& device);

}  // namespace flowrun
