// Compute precision of training nodes (the graph's run.precision: fp32 | bf16).
//
// Parameters, gradients and optimizer state stay fp32; bf16 runs the forward under autocast
// (matrix products in bf16, reductions kept in fp32 by autocast's op lists), as torch.autocast
// does. The loss and the backward run outside autocast: backward follows the dtypes forward
// chose, as in PyTorch's recipe.
//
// Support: fp32 everywhere; bf16 on CPU through libtorch's CPU autocast
// (at::autocast::set_cpu_enabled / set_autocast_cpu_dtype) and on CUDA through its GPU
// autocast. fp16 is not offered (the schema has no such value): it needs a dynamic loss
// scaler, and CPU autocast has no fp16, so no test could run it here.
#pragma once
#include <torch/torch.h>

#include <string>

#include "models/model_state.hpp"
#include "node.hpp"

namespace flowrun {

enum class Precision { fp32, bf16 };

Precision parse_precision(const std::string& name);  // throws for an unknown name
std::string to_string(Precision p);
// run.precision of the graph being run; fp32 when there is no graph (direct calls in tests).
Precision run_precision(const RunInfo& run);

// Throws a clear error when `p` cannot run on `device` (see above); `who` starts the message.
void check_precision(Precision p, const c10::Device& device, const std::string& who);

// Autocast for the scope's lifetime, on this thread only (libtorch's autocast state is
// thread-local), restoring the previous state after. fp32: does nothing.
class AutocastScope {
 public:
  AutocastScope(Precision p, const c10::Device& device);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool active_ = false, cuda_ = false, prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kFloat;
};

// The device of a model's first parameter (CPU if it has none).
c10::Device model_device(const ModelState& model);

}  // namespace flowrun
