// CapturedWork (cuda_graph.hpp): at::cuda::CUDAGraph on a stream of its own, thread-local
// capture mode.
#include "common/cuda_graph.hpp"

#include <ATen/core/Tensor.h>

#include <atomic>
#include <optional>
#include <stdexcept>

#if FLOWRUN_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace flowrun {

namespace {
std::atomic<int64_t> replayed{0};
}  // namespace

int64_t CapturedWork::replays() { return replayed.load(); }

#if FLOWRUN_CUDA

struct CapturedWork::Impl {
  c10::cuda::CUDAStream stream;
  std::optional<at::cuda::CUDAGraph> graph;
  bool captured = false;
};

CapturedWork::CapturedWork(int device)
    : impl_(new Impl{c10::cuda::getStreamFromPool(/*isHighPriority=*/false, static_cast<c10::DeviceIndex>(device)),
                     std::nullopt, false}) {}
CapturedWork::~CapturedWork() = default;
bool CapturedWork::available() { return true; }
bool CapturedWork::captured() const { return impl_->captured; }

struct CapturedWork::OnStream::Impl {
  c10::cuda::CUDAStream caller;
  c10::cuda::CUDAStream own;
  std::optional<c10::cuda::CUDAStreamGuard> guard;
};

CapturedWork::OnStream::OnStream(CapturedWork& w)
    : impl_(new Impl{c10::cuda::getCurrentCUDAStream(w.impl_->stream.device_index()), w.impl_->stream, std::nullopt}) {
  at::cuda::CUDAEvent queued;
  queued.record(impl_->caller);
  queued.block(impl_->own);
  impl_->guard.emplace(impl_->own);
}

CapturedWork::OnStream::~OnStream() {
  impl_->guard.reset();
  at::cuda::CUDAEvent done;
  done.record(impl_->own);
  done.block(impl_->caller);
}

void CapturedWork::capture(const std::function<void()>& work) {
  impl_->graph.reset();  // a capture replaces the one before (the model's tensors changed)
  impl_->captured = false;
  if (c10::cuda::getCurrentCUDAStream(impl_->stream.device_index()) != impl_->stream)
    throw std::logic_error("CapturedWork::capture outside CapturedWork::OnStream");
  impl_->graph.emplace();
  impl_->graph->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
  try {
    work();
  } catch (...) {
    try {
      impl_->graph->capture_end();  // ends the (possibly invalidated) capture; its error is the lesser one
    } catch (...) {
    }
    impl_->graph.reset();
    throw;
  }
  impl_->graph->capture_end();
  impl_->captured = true;
  replay();  // the captured work, done once
}

void CapturedWork::replay() {
  if (!impl_->captured) throw std::logic_error("CapturedWork::replay before capture");
  impl_->graph->replay();
  ++replayed;
}

void CapturedWork::used_here(const at::Tensor& t) {
  if (t.defined() && t.is_cuda()) t.record_stream(c10::cuda::getCurrentCUDAStream(t.device().index()));
}

#else

struct CapturedWork::Impl {};
struct CapturedWork::OnStream::Impl {};
CapturedWork::CapturedWork(int) { throw std::runtime_error("CUDA graphs need a CUDA build of flowrun (FLOWRUN_CUDA)"); }
CapturedWork::~CapturedWork() = default;
CapturedWork::OnStream::OnStream(CapturedWork&) {}
CapturedWork::OnStream::~OnStream() = default;
bool CapturedWork::available() { return false; }
bool CapturedWork::captured() const { return false; }
void CapturedWork::capture(const std::function<void()>&) {}
void CapturedWork::replay() {}
void CapturedWork::used_here(const at::Tensor&) {}

#endif

}  // namespace flowrun
