// Loading a Hugging Face-style state dict into a libtorch module by parameter name, with every
// problem reported at once: missing, unexpected and mis-shaped tensors, in one error that starts
// with the file name. Used by the text encoders (bert, t5_encoder).
#pragma once
#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace flowrun {

struct LoadByNameOptions {
  std::string model;                   // "bert (layers=2 dim=32 ...)": who is loading, for the error
  std::vector<std::string> prefixes;   // optional name prefixes to strip ("bert.")
  std::function<bool(const std::string&)> ignore;  // names (prefix stripped) to skip silently
};

// Copies every parameter and buffer of `module` from `tensors` (floating dtypes, converted to
// the module's). Throws std::runtime_error listing every problem.
void load_by_name(torch::nn::Module& module, const std::map<std::string, torch::Tensor>& tensors,
                  const std::string& source, const LoadByNameOptions& options);

}  // namespace flowrun
