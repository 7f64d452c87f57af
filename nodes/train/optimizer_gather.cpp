// Gathering a sharded optimizer state (train/optimizer.hpp: collect_sharded_state): collective,
// every rank's pieces all-gathered into whole moments. StateIO::collect: only a checkpoint with
// exports: true calls it; a checkpoint writes each rank's slices themselves (optimizer.cpp).
#include <stdexcept>

#include "parallel/collectives.hpp"
#include "train/optimizer.hpp"

namespace flowrun {

void collect_sharded_state(OptimizerState& st, parallel::Group& group) {
  const ShardPlan& plan = st.shard;
  if (!plan.sharded() || st.slots.empty()) return;
  torch::NoGradGuard no_grad;
  const size_t n = plan.layout.slots.size();
  // Each parameter's step: the pieces of a parameter share it; a rank without a piece says 0.
  std::vector<double> steps(n, 0.0);
  for (size_t k = 0; k < plan.pieces.size(); ++k)
    steps[static_cast<size_t>(plan.pieces[k].param)] = static_cast<double>(st.slots[k].step);
  group.all_reduce(torch::from_blob(steps.data(), {static_cast<int64_t>(n)}, torch::kDouble), comm::Op::max,
                   "optimizer steps for a checkpoint").wait();
  std::map<std::string, torch::Tensor> out;
  auto gather = [&](const std::vector<torch::Tensor>& slices, const char* suffix) {
    if (slices.empty()) return;
    // Whole buffers, this rank's slice in place, the others' all-gathered into them; in host
    // memory, over MPI, for a GPU's state too (a checkpoint copies it to the host anyway).
    std::vector<torch::Tensor> whole;
    for (size_t g = 0; g < plan.groups.size(); ++g) {
      torch::Tensor b = torch::zeros({plan.groups[g].numel}, slices[g].options().device(torch::kCPU));
      b.narrow(0, plan.groups[g].begin, plan.groups[g].end - plan.groups[g].begin).copy_(slices[g]);
      whole.push_back(b);
    }
    for (parallel::Work& w : allgather_slices(plan, whole, group, std::string("optimizer moments ") + suffix + " for a checkpoint"))
      w.wait();
    for (size_t i = 0; i < n; ++i) out[plan.names[i] + suffix] = plan.layout.view(whole, i, plan.shapes[i]);
  };
  const std::vector<std::string> flat_names = st.rule->moments();
  for (size_t j = 0; j < flat_names.size(); ++j) gather(st.flat[j], ("." + flat_names[j]).c_str());
  // The rule's own moments (Adafactor's statistics), each held whole by its parameter's rank:
  // one vector of all of them, zeros where this rank holds none, summed over the ranks (x + 0 is
  // exact).
  std::vector<std::pair<std::string, std::vector<int64_t>>> all;
  for (size_t i = 0; i < n; ++i)
    for (auto& [name, shape] : st.own_moments(*st.rule, plan.names[i], plan.shapes[i])) all.emplace_back(plan.names[i] + "." + name, shape);
  if (!all.empty()) {
    std::map<std::string, torch::Tensor> mine;
    for (const auto& s : st.slots)
      for (size_t j = flat_names.size(); j < s.m.size(); ++j) mine[s.name + "." + s.names[j]] = s.m[j];
    std::vector<int64_t> sizes;
    std::vector<torch::Tensor> parts;
    for (const auto& [name, shape] : all) {
      auto it = mine.find(name);
      parts.push_back(it != mine.end() ? it->second.reshape({-1}).to(torch::kCPU, torch::kDouble)
                                       : torch::zeros({c10::multiply_integers(shape)}, torch::kDouble));
      sizes.push_back(parts.back().numel());
    }
    torch::Tensor flat = torch::cat(parts).contiguous();
    group.all_reduce(flat, comm::Op::sum, "the " + st.rule->kind + " rule's own moments for a checkpoint").wait();
    int64_t at = 0;
    for (size_t j = 0; j < all.size(); ++j) {
      out[all[j].first] = flat.narrow(0, at, sizes[j]).to(torch::kFloat).view(all[j].second);
      at += sizes[j];
    }
  }
  for (size_t i = 0; i < n; ++i) out[plan.names[i] + ".step"] = torch::tensor(static_cast<int64_t>(steps[i]), torch::kInt64);
  st.gathered = std::move(out);
}

}  // namespace flowrun
