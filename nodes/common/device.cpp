#include "common/device.hpp"

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <cstdlib>
#include <map>
#include <mutex>

#include "comm.hpp"
#include "node.hpp"

#if FLOWRUN_CUDA
#include <c10/cuda/CUDAStream.h>

#include "common/cuda_streams.hpp"
#endif

namespace flowrun {

namespace {

int visible_gpus() {
#if FLOWRUN_CUDA
  return torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
#else
  return 0;  // a CPU build never places tensors on a GPU, even if its libtorch could
#endif
}

std::string no_gpu_reason() {
#if FLOWRUN_CUDA
  const char* v = std::getenv("CUDA_VISIBLE_DEVICES");
  return std::string("no CUDA device is visible to this process") +
         (v ? std::string(" (CUDA_VISIBLE_DEVICES=") + v + ")" : std::string(" (check nvidia-smi and the driver)"));
#else
  return "this flowrun was built without CUDA (Debian's libtorch is CPU-only); build with -DFLOWRUN_CUDA=ON "
         "against a CUDA libtorch (tests/gpu/run.sh shows how)";
#endif
}

}  // namespace

std::string resolve_device(const std::string& requested, int local_rank) {
  if (requested == "cpu") return "cpu";
  const int n = visible_gpus();
  if (requested == "auto") return n > 0 ? "cuda:" + std::to_string(local_rank % n) : "cpu";
  if (requested == "cuda") {
    if (n == 0) throw std::runtime_error("run.device is cuda, but " + no_gpu_reason() + "; or set run.device=cpu");
    if (local_rank >= n)
      spdlog::warn("local rank {} of this machine shares GPU {} with another rank ({} visible)", local_rank,
                   local_rank % n, n);
    return "cuda:" + std::to_string(local_rank % n);
  }
  if (requested.rfind("cuda:", 0) == 0) {
    const int k = std::atoi(requested.c_str() + 5);
    if (n == 0) throw std::runtime_error("run.device is " + requested + ", but " + no_gpu_reason() + "; or set run.device=cpu");
    if (k >= n)
      throw std::runtime_error("run.device is " + requested + ", but only " + std::to_string(n) + " GPU" +
                               (n == 1 ? " is" : "s are") + " visible (cuda:0" + (n > 1 ? "..cuda:" + std::to_string(n - 1) : "") + ")");
    return requested;
  }
  throw std::runtime_error("run.device '" + requested + "' is not a device: use auto, cpu, cuda or cuda:N");
}

c10::Device run_device(const RunInfo& run) {
  // Cached: nodes ask in setup and in run(); the answer cannot change within a process.
  static std::mutex mu;
  static std::map<std::string, std::string> cache;
  std::lock_guard<std::mutex> l(mu);
  auto it = cache.find(run.device);
  if (it == cache.end()) it = cache.emplace(run.device, resolve_device(run.device, comm::local_rank())).first;
  return c10::Device(it->second);
}

void synchronize_device(const c10::Device& device) {
#if FLOWRUN_CUDA
  if (device.is_cuda()) c10::cuda::getCurrentCUDAStream(device.index()).synchronize();
#else
  (void)device;
#endif
}

std::unique_ptr<DeviceStreams> make_device_streams(const std::string& resolved) {
  if (resolved == "cpu") return nullptr;
#if FLOWRUN_CUDA
  return make_cuda_streams(c10::Device(resolved).index());
#else
  throw std::runtime_error("run.device " + resolved + ": " + no_gpu_reason());
#endif
}

}  // namespace flowrun
