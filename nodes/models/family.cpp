// The machinery over a family's declaration (family.hpp): its init, its loads, its layout told.
#include "models/family.hpp"

#include <set>

#include "models/lora.hpp"
#include "models/model_state.hpp"

namespace flowrun {

void init_in_order(torch::nn::Module& module, const ParamOrder& order, const parallel::TpLayout& layout, at::Generator g,
                   const std::function<void(const std::string&, torch::Tensor&, at::Generator&)>& init_one) {
  torch::NoGradGuard no_grad;
  auto held = module.named_parameters(/*recurse=*/true);
  for (const auto& [name, shape] : order) {
    if (lora::is_adapter(name)) continue;
    const parallel::TpSplit s = layout.split ? layout.split(name) : parallel::TpSplit{};
    const parallel::Group* over = layout.group_of(s);  // tp's or ep's ranks, or none
    torch::Tensor* mine = held.find(name);
    if (mine && !over) {  // held whole: drawn where it lies, no copy
      init_one(name, *mine, g);
      continue;
    }
    std::vector<int64_t> whole_shape = shape;
    if (over) whole_shape[static_cast<size_t>(s.dim)] *= over->size();
    torch::Tensor whole = torch::empty(whole_shape);
    init_one(name, whole, g);  // drawn whether kept or not: the generator moves on as in the whole model
    if (mine) mine->copy_(over ? parallel::tp_part(whole, s, *over, name) : whole);
  }
}

void init_declared(torch::nn::Module& module, const Family& family, uint64_t seed) {
  if (!family.generator || !family.init_one)
    throw std::logic_error("init_declared: the family declares no init of one tensor (Family::generator, init_one)");
  ParamOrder order;
  if (family.stages) {
    order = family.order();  // the whole model's: another stage's tensors are drawn and dropped
  } else {
    for (const auto& item : module.named_parameters(/*recurse=*/true)) order.emplace_back(item.key(), item.value().sizes().vec());
  }
  init_in_order(module, order, family.layout(), family.generator(seed), family.init_one);
}

void load_declared(torch::nn::Module& module, const Family& family, const std::map<std::string, torch::Tensor>& tensors,
                   const std::string& source, LoadByNameOptions o) {
  if (family.stages) {  // another chunk's tensors (whole-model names this rank does not hold) are skipped
    std::set<std::string> whole;
    for (const auto& [name, shape] : family.order()) whole.insert(name);
    o.ignore = [whole = std::move(whole), held = module.named_parameters(true), ignore = o.ignore](const std::string& n) {
      return (ignore && ignore(n)) || (!held.contains(n) && whole.count(n) > 0);
    };
  }
  if (!family.splits()) return load_by_name(module, tensors, source, o);  // converts fp16/bf16 files
  load_by_name(module, family.layout().parts(tensors, nullptr, source), source, o);  // this rank's parts
}

void hold_declared(ModelState& state, const Family& family, std::string& how) {
  state.splits_over_tp = [split = family.tp_split](const std::string& name) {
    const parallel::TpSplit s = split(name);
    return s.split() && !s.experts;
  };
  if (family.experts > 0) {
    state.is_expert = [split = family.tp_split](const std::string& name) { return split(name).experts; };
    state.experts = family.experts, state.top_k = family.top_k;
  }
  state.stages = family.stages;
  state.tied = family.tied;
  if (!family.splits()) return;  // tp 1, ep 1
  state.tp = std::make_shared<const parallel::TpLayout>(family.layout());
  state.vocab_split_logits = family.split() && family.vocab_split_logits;
  if (!how.empty() && family.split()) how += ", split over tp " + std::to_string(family.tp->size()) + ": the count is this rank's part";
  if (!how.empty() && family.splits_experts())
    how += ", experts split over ep " + std::to_string(family.ep->size()) + ": the count is this rank's part";
}

}  // namespace flowrun
