// TensorMap: a batch. Data nodes output one per step as a Value holding a TensorMap
// (port type `batch`); keys are documented by each data node ("x", "y", "tokens", ...).
// Tensors of one batch share their first dimension (the batch dimension), which is what
// forward_backward splits into micro-batches.
#pragma once
#include <torch/torch.h>

#include <map>
#include <stdexcept>
#include <string>

namespace flowrun {

using TensorMap = std::map<std::string, torch::Tensor>;

// "[2, 3, 32, 32]": a tensor's shape, for messages.
inline std::string shape_str(const torch::Tensor& t) { return c10::str(t.sizes()); }

// False when a floating-point tensor holds NaN or an infinity (one host read); other dtypes are
// finite. What every loader of saved values checks (weights, adapters, model and optimizer states).
inline bool all_finite(const torch::Tensor& t) {
  return !t.is_floating_point() || torch::isfinite(t).all().item<bool>();
}

// "image, style": a batch's keys, for messages ("(none)" when empty).
inline std::string keys_of(const TensorMap& m) {
  std::string s;
  for (const auto& [k, _] : m) s += (s.empty() ? "" : ", ") + k;
  return s.empty() ? "(none)" : s;
}

// The batch with every tensor on `device`. From the CPU to a GPU the copy is staged in pinned
// (page-locked) memory and queued without blocking the host, on the current stream: a data
// node with `stream: io` copies on the io stream, and the executor makes its consumers wait
// for it (engine/device_streams.hpp). Tensors already there are shared, not copied.
inline torch::Tensor to_device(const torch::Tensor& t, const torch::Device& device) {
  if (!t.defined() || t.device() == device) return t;
  return (t.is_cpu() && device.is_cuda() ? t.pin_memory() : t).to(device, /*non_blocking=*/true);
}
inline TensorMap to_device(const TensorMap& batch, const torch::Device& device) {
  TensorMap out = batch;
  for (auto& [_, t] : out) t = to_device(t, device);
  return out;
}

// The batch with the entries of `extra` added (forward_backward's and the evaluator's `cond`:
// the frozen encoders' outputs); a key in both is an error naming it.
inline TensorMap merge_batches(const TensorMap& batch, const TensorMap& extra) {
  TensorMap out = batch;
  for (const auto& [k, t] : extra) {
    if (out.count(k))
      throw std::runtime_error("the batch and the cond input both have '" + k +
                               "' (rename one: the objective would not know which to use)");
    out[k] = t;
  }
  return out;
}

}  // namespace flowrun
