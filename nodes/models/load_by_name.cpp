#include "models/load_by_name.hpp"

#include <sstream>
#include <stdexcept>

namespace flowrun {
namespace {
std::string shape_of(const torch::Tensor& t) { return c10::str(t.sizes()); }
}  // namespace

void load_by_name(torch::nn::Module& module, const std::map<std::string, torch::Tensor>& tensors,
                  const std::string& source, const LoadByNameOptions& options) {
  std::map<std::string, torch::Tensor> mine;
  for (const auto& item : module.named_parameters(true)) mine[item.key()] = item.value();
  for (const auto& item : module.named_buffers(true)) mine[item.key()] = item.value();

  std::map<std::string, torch::Tensor> given;
  std::vector<std::string> missing, unexpected, misshaped;
  for (const auto& [raw, t] : tensors) {
    std::string name = raw;
    for (const auto& p : options.prefixes)
      if (name.rfind(p, 0) == 0 && !mine.count(name)) {
        name = name.substr(p.size());
        break;
      }
    if (options.ignore && options.ignore(name)) continue;
    auto it = mine.find(name);
    if (it == mine.end()) {
      unexpected.push_back(raw + " " + shape_of(t));
    } else if (given.count(name)) {
      unexpected.push_back(raw + " " + shape_of(t) + " (given twice, with and without a prefix)");
    } else if (!it->second.sizes().equals(t.sizes())) {
      misshaped.push_back(raw + ": " + shape_of(t) + " in the file, the model's is " + shape_of(it->second));
      given[name] = torch::Tensor();
    } else if (!t.is_floating_point()) {
      misshaped.push_back(raw + ": dtype " + std::string(c10::toString(t.scalar_type())) + " is not a float type");
      given[name] = torch::Tensor();
    } else {
      given[name] = t;
    }
  }
  for (const auto& [name, t] : mine)
    if (!given.count(name)) missing.push_back(name + " " + shape_of(t));
  if (!missing.empty() || !unexpected.empty() || !misshaped.empty()) {
    std::ostringstream msg;
    msg << source << ": cannot load into " << options.model << ": " << missing.size() << " missing, "
        << unexpected.size() << " unexpected, " << misshaped.size() << " mis-shaped tensor(s)";
    auto list = [&](const char* what, const std::vector<std::string>& items) {
      for (const auto& s : items) msg << "\n  " << what << ": " << s;
    };
    list("missing", missing);
    list("unexpected", unexpected);
    list("mis-shaped", misshaped);
    throw std::runtime_error(msg.str());
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : mine) t.copy_(given.at(name));
}

}  // namespace flowrun
