// CUDA implementation of the executor's device streams (engine/device_streams.hpp), built
// only with FLOWRUN_CUDA. Torch-free header.
//
// Stream "default" (a node with no `stream:`) is the device's default stream, where torch
// puts work when nothing else is current; every other name is a stream from c10's pool
// (non-blocking, so it never serialises with the default one implicitly). begin() makes the
// node's stream current for the calling thread (c10::cuda::CUDAStreamGuard, so every torch op
// of the node is queued there) and opens an NVTX range named "NODE step N", so `nsys profile`
// timelines show the graph's nodes and steps. Events are at::cuda::CUDAEvent (timing off).
// used_on() calls Tensor::record_stream for the tensors a value holds (a tensor, a map of
// tensors, a list of gradients), so the caching allocator does not hand their memory out
// again while the consuming stream may still read it.
#pragma once
#include <memory>

#include "device_streams.hpp"

namespace flowrun {

std::unique_ptr<DeviceStreams> make_cuda_streams(int device_index);

}  // namespace flowrun
