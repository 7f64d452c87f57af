#include "common/cuda_streams.hpp"

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <nvtx3/nvToolsExt.h>
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/grads.hpp"
#include "common/tensor_map.hpp"
#include "value.hpp"

namespace flowrun {

namespace {

class CudaEvent : public DeviceEvent {
 public:
  mutable at::cuda::CUDAEvent ev;  // block() and synchronize() are not const in every libtorch
  void synchronize() const override { ev.synchronize(); }
};

// The guard of the stream a node runs on, per thread (begin/end pair on one thread).
thread_local std::optional<c10::cuda::CUDAStreamGuard> current_guard;

class CudaStreams : public DeviceStreams {
 public:
  explicit CudaStreams(int device) : device_(static_cast<c10::DeviceIndex>(device)) {}

  int stream(const std::string& name) override {
    const std::string key = name.empty() ? "default" : name;
    std::lock_guard<std::mutex> l(mu_);
    auto it = ids_.find(key);
    if (it != ids_.end()) return it->second;
    streams_.push_back(key == "default" ? c10::cuda::getDefaultCUDAStream(device_)
                                        : c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_));
    return ids_[key] = static_cast<int>(streams_.size()) - 1;
  }

  void begin(int s, const std::string& label) override {
    current_guard.emplace(at(s));
    nvtxRangePushA(label.c_str());
  }

  void end(int /*s*/) override {
    nvtxRangePop();
    current_guard.reset();
  }

  std::shared_ptr<DeviceEvent> record(int s) override {
    auto e = std::make_shared<CudaEvent>();
    e->ev.record(at(s));
    return e;
  }

  void wait(int s, const DeviceEvent& e) override { static_cast<const CudaEvent&>(e).ev.block(at(s)); }

  void used_on(const Value& v, int s) override {
    const c10::cuda::CUDAStream st = at(s);
    auto keep = [&](const torch::Tensor& t) {
      if (t.defined() && t.is_cuda()) t.record_stream(st);
    };
    if (const auto* t = v.get_if<torch::Tensor>()) return keep(*t);
    if (const auto* m = v.get_if<TensorMap>()) {
      for (const auto& [_, t] : *m) keep(t);
      return;
    }
    if (const auto* g = v.get_if<Grads>()) {
      for (const auto& t : *g) keep(t);
      return;
    }
    // Other values hold no per-step allocations: numbers, shared state objects, and
    // forward_backward's gradient-buffer items (the buffer lives across steps).
  }

  void synchronize_all() override {
    std::vector<c10::cuda::CUDAStream> all;
    {
      std::lock_guard<std::mutex> l(mu_);
      all = streams_;
    }
    for (auto& s : all) s.synchronize();
  }

 private:
  c10::cuda::CUDAStream at(int s) {
    std::lock_guard<std::mutex> l(mu_);
    return streams_.at(static_cast<size_t>(s));
  }

  c10::DeviceIndex device_;
  std::mutex mu_;
  std::vector<c10::cuda::CUDAStream> streams_;
  std::map<std::string, int> ids_;
};

}  // namespace

std::unique_ptr<DeviceStreams> make_cuda_streams(int device_index) {
  if (device_index < 0) device_index = 0;
  return std::make_unique<CudaStreams>(device_index);
}

}  // namespace flowrun
