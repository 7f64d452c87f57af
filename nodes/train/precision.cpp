// Compute precision: see precision.hpp.
#include "train/precision.hpp"

#include <ATen/autocast_mode.h>

#include "spec.hpp"

namespace flowrun {

Precision parse_precision(const std::string& name) {
  if (name == "fp32") return Precision::fp32;
  if (name == "bf16") return Precision::bf16;
  throw std::runtime_error("unknown precision '" + name + "' (fp32 or bf16)");
}

std::string to_string(Precision p) {
  switch (p) {
    case Precision::fp32: return "fp32";
    case Precision::bf16: return "bf16";
  }
  return "?";
}

Precision run_precision(const RunInfo& run) {
  if (!run.graph || run.graph->settings.precision.empty()) return Precision::fp32;  // a graph made by hand (tests)
  return parse_precision(run.graph->settings.precision);
}

void check_precision(Precision p, const c10::Device& device, const std::string& who) {
  if (p == Precision::bf16 && !device.is_cpu() && !device.is_cuda())
    throw std::runtime_error(who + ": run.precision bf16 is supported on CPU and CUDA, not on " + device.str());
}

AutocastScope::AutocastScope(Precision p, const c10::Device& device) {
  if (p == Precision::fp32) return;
  check_precision(p, device, "autocast");
  active_ = true;
  cuda_ = device.is_cuda();
  // As torch.autocast.__enter__ does: remember, enable, set the dtype, count the nesting.
  const at::DeviceType type = cuda_ ? at::kCUDA : at::kCPU;
  prev_enabled_ = at::autocast::is_autocast_enabled(type);
  prev_dtype_ = at::autocast::get_autocast_dtype(type);
  at::autocast::set_autocast_enabled(type, true);
  at::autocast::set_autocast_dtype(type, at::kBFloat16);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!active_) return;
  // The cache holds bf16 copies of the weights made in this scope; drop them when the
  // outermost scope ends (torch.autocast.__exit__).
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  const at::DeviceType type = cuda_ ? at::kCUDA : at::kCPU;
  at::autocast::set_autocast_enabled(type, prev_enabled_);
  at::autocast::set_autocast_dtype(type, prev_dtype_);
}

c10::Device model_device(const ModelState& model) {
  for (const auto& [_, p] : model.named_parameters()) return p.device();
  return c10::Device(c10::kCPU);
}

}  // namespace flowrun
