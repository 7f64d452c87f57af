// The one weight loader (load_by_name.hpp). Test: tests/nodes/load_by_name_test.cpp.
#include "models/load_by_name.hpp"

#include <sstream>
#include <stdexcept>

#include "common/safetensors.hpp"
#include "common/tensor_map.hpp"

namespace flowrun {

void load_by_name(NamedTensorMap mine, const NamedTensorMap& tensors, const std::string& source,
                  const LoadByNameOptions& options) {
  NamedTensorMap given;  // by the model's names; undefined: present but unusable
  std::vector<std::string> missing, unexpected, misshaped, nonfinite;
  for (const auto& [raw, t] : tensors) {
    std::string name = raw;
    for (const auto& p : options.prefixes)
      if (name.rfind(p, 0) == 0 && !mine.count(name)) {
        name = name.substr(p.size());
        break;
      }
    if (options.rename) name = options.rename(name);
    if (options.ignore && options.ignore(name)) continue;
    auto it = mine.find(name);
    if (it == mine.end()) {
      unexpected.push_back(raw + " " + shape_str(t));
    } else if (given.count(name)) {
      unexpected.push_back(raw + " " + shape_str(t) + " (given twice, under two names)");
    } else if (!it->second.sizes().equals(t.sizes())) {
      misshaped.push_back(raw + ": " + shape_str(t) + " in the file, the model's is " + shape_str(it->second));
      given[name] = torch::Tensor();
    } else if (!t.is_floating_point()) {
      misshaped.push_back(raw + ": dtype " + std::string(c10::toString(t.scalar_type())) + " is not a float type");
      given[name] = torch::Tensor();
    } else if (!all_finite(t)) {
      // Issue 47: NaN weights or adapters loaded silently, and step 1 blamed the learning rate.
      nonfinite.push_back(raw + " " + shape_str(t));
      given[name] = torch::Tensor();
    } else {
      given[name] = t;
    }
    safetensors::release_pages(t);  // a mapped file's tensor: read again when copied, so one at a time is in memory
  }
  for (const auto& [name, t] : mine)
    if (!given.count(name) && !(options.optional && options.optional(name)))
      missing.push_back(name + " " + shape_str(t));
  if (options.check)
    for (auto& s : options.check(tensors)) misshaped.push_back(std::move(s));
  if (!missing.empty() || !unexpected.empty() || !misshaped.empty() || !nonfinite.empty()) {
    std::ostringstream msg;
    msg << source << ": cannot load into " << options.model << ": " << missing.size() << " missing, "
        << unexpected.size() << " unexpected, " << misshaped.size() << " mis-shaped"
        << (nonfinite.empty() ? "" : ", " + std::to_string(nonfinite.size()) + " non-finite") << " tensor(s)";
    auto list = [&](const char* what, const std::vector<std::string>& items) {
      for (const auto& s : items) msg << "\n  " << what << ": " << s;
    };
    list("missing", missing);
    list("unexpected", unexpected);
    list("mis-shaped", misshaped);
    list("holds NaN or infinite values", nonfinite);
    if (options.describe_file)
      if (const std::string d = options.describe_file(tensors); !d.empty()) msg << "\n  (" << d << ")";
    throw std::runtime_error(msg.str());
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : mine)
    if (auto it = given.find(name); it != given.end()) {
      t.copy_(it->second);
      safetensors::release_pages(it->second);
    }
}

void load_by_name(torch::nn::Module& module, const NamedTensorMap& tensors, const std::string& source,
                  const LoadByNameOptions& options) {
  NamedTensorMap mine;
  for (const auto& item : module.named_parameters(true)) mine[item.key()] = item.value();
  for (const auto& item : module.named_buffers(true)) mine[item.key()] = item.value();
  load_by_name(std::move(mine), tensors, source, options);
}

}  // namespace flowrun
