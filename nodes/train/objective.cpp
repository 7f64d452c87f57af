// Objective helpers (train/objective.hpp).
#include "train/objective.hpp"

namespace flowrun {

void check_needs(const Objective& objective, const TensorMap& batch) {
  std::string missing;
  for (const auto& k : objective.needs())
    if (!batch.count(k)) missing += (missing.empty() ? "'" : ", '") + k + "'";
  if (missing.empty()) return;
  std::string have;
  for (const auto& [k, _] : batch) have += (have.empty() ? "" : ", ") + k;
  throw std::runtime_error("objective " + objective.type + " needs the batch's " + missing + "; it has {" + have + "}");
}

}  // namespace flowrun
