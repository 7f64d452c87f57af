#include "common/device.hpp"

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <cstdlib>
#include <map>
#include <mutex>

#include "comm.hpp"
#include "node.hpp"

#if FLOWRUN_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

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
  return "this flowrun was built without CUDA (a CPU build links libtorch_cpu alone); build with -DFLOWRUN_CUDA=ON "
         "against a CUDA PyTorch (scripts/setup.sh does where it sees a GPU and nvcc)";
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

double peak_device_memory(const c10::Device& device) {
#if FLOWRUN_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return static_cast<double>(stats.allocated_bytes[0].peak);  // [0]: all pools together (StatType::AGGREGATE)
  }
#else
  (void)device;
#endif
  return -1;
}

double available_device_memory(const c10::Device& device) {
#if FLOWRUN_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDAGuard guard(device.index());
    size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;  // unknown
    }
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    const double cached = static_cast<double>(stats.reserved_bytes[0].current - stats.allocated_bytes[0].current);
    return static_cast<double>(free) + cached;
  }
#else
  (void)device;
#endif
  return 0;
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
