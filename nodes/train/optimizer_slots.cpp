// The optimizer's state (train/optimizer.hpp): its slots, one per parameter with the rule's
// moments in flat buffers (or, sharded, one per piece this rank holds: ZeRO stage 1), listed
// for checkpoints and loaded back, checked against what the optimizer expects.
#include "train/optimizer_slots.hpp"

#include <stdexcept>

namespace flowrun {

torch::Tensor OptimizerState::Slot::moment(const std::string& n) const {
  for (size_t k = 0; k < names.size(); ++k)
    if (names[k] == n) return m[k];
  return {};
}

std::map<std::string, torch::Tensor> OptimizerState::tensors() const {
  if (shard.sharded() && !slots.empty()) {
    // This rank holds pieces; collect_sharded_state gathered the whole tensors.
    if (gathered.empty())
      throw std::logic_error("the optimizer's state is sharded over the ranks: gather it with collect_sharded_state() "
                             "(on every rank) before listing its tensors");
    std::map<std::string, torch::Tensor> out = gathered;
    out["updates"] = torch::tensor(updates, torch::kInt64);
    return out;
  }
  std::map<std::string, torch::Tensor> out;
  if (slots.empty() && !pending.empty()) {  // loaded, not yet applied: what was loaded (start-up sends it to the ranks)
    out = pending;
    out["updates"] = torch::tensor(updates, torch::kInt64);
    return out;
  }
  // The fused path's step lives on the device (a read here, where a checkpoint copies anyway).
  const int64_t fused = fused_step.defined() ? static_cast<int64_t>(fused_step.item<double>()) : -1;
  for (const Slot& s : slots) {
    for (size_t k = 0; k < s.m.size(); ++k)
      if (s.m[k].defined()) out[s.name + "." + s.names[k]] = s.m[k];
    out[s.name + ".step"] = torch::tensor(fused >= 0 ? fused : s.step, torch::kInt64);
  }
  out["updates"] = torch::tensor(updates, torch::kInt64);
  return out;
}

// Leaving the on-device path (or loading a state): each slot's host step from the device's.
void settle_fused_step(OptimizerState& st) {
  if (!st.fused_step.defined()) return;
  const auto step = static_cast<int64_t>(st.fused_step.item<double>());
  for (auto& s : st.slots) s.step = step;
  st.fused_step = torch::Tensor();
}

// A slot's moments of the rule for a parameter of `shape`: the flat ones named (made by the
// caller), its own ones made here, zeroed (they are shaped otherwise than p, so they live outside
// the flat buffers).
static void name_moments(const OptimizerState& st, OptimizerState::Slot& s, const UpdateRule& rule, const torch::Tensor& p) {
  s.names = rule.moments();
  s.m.assign(s.names.size(), torch::Tensor());
  for (const auto& [name, shape] : st.own_moments(rule, s.name, p.sizes())) {
    s.names.push_back(name);
    s.m.push_back(torch::zeros(shape, p.options()));
  }
}

// The slots for these parameters, their moments zeroed in flat buffers (see OptimizerState),
// and what load() kept for them.
void make_slots(OptimizerState& st, const ModelState::Named& params, const OptimConfig& cfg) {
  st.rule = cfg.rule;
  st.slots.resize(params.size());
  std::vector<torch::Tensor> ps;
  for (size_t i = 0; i < params.size(); ++i) {
    st.slots[i].name = params[i].first;
    name_moments(st, st.slots[i], *st.rule, params[i].second);
    ps.push_back(params[i].second);
  }
  st.layout = FlatLayout::of(ps);
  st.flat.assign(st.rule->moments().size(), {});
  for (size_t k = 0; k < st.flat.size(); ++k) {
    st.flat[k] = st.layout.zeros();
    for (size_t i = 0; i < ps.size(); ++i) st.slots[i].m[k] = st.layout.view(st.flat[k], i, ps[i].sizes());
  }
}

// The saved moments of a slot: copied into its moments where they exist (views into the flat
// buffers, on the parameter's device), else copies on `device` (the given tensors may be
// aliases their owner goes on changing; a checkpoint is read onto the CPU).
void load_slot(OptimizerState::Slot& s, const std::map<std::string, torch::Tensor>& t, const c10::Device& device) {
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < s.m.size(); ++k) {
    const std::string key = s.name + "." + s.names[k];
    auto it = t.find(key);
    if (it == t.end()) continue;
    torch::Tensor& dst = s.m[k];
    if (!dst.defined()) {
      dst = it->second.detach().to(device, /*non_blocking=*/false, /*copy=*/true);
      continue;
    }
    if (!dst.sizes().equals(it->second.sizes()))
      throw std::runtime_error("optimizer state: '" + key + "' has shape " + shape_str(it->second) +
                               ", the parameter is " + shape_str(dst) + "; the state was saved for another model");
    dst.copy_(it->second);
  }
  auto it = t.find(s.name + ".step");
  if (it != t.end()) s.step = it->second.item<int64_t>();
}

std::vector<std::pair<std::string, std::vector<int64_t>>> OptimizerState::own_moments(const UpdateRule& rule,
                                                                                     const std::string& param,
                                                                                     c10::IntArrayRef shape) const {
  const auto it = parts.find(param);
  if (it == parts.end()) return rule.own_moments(shape);
  const UpdateRule::Part& part = it->second;
  auto out = rule.own_moments(part.whole);
  for (auto& [name, moment] : out)
    if (const int64_t d = rule.own_moment_dim(part.whole, part.dim, name); d >= 0)
      moment[static_cast<size_t>(d)] /= tp->group->size();
  return out;
}

parallel::TpSplit OptimizerState::split_of(const std::string& name) const {
  if (!tp) return {};
  const std::string param = moment_parameter(name);
  const parallel::TpSplit s = tp->split(param);
  const auto it = parts.find(param);
  if (!s.split() || it == parts.end() || !rule) return s;  // a moment shaped as its parameter (or "step")
  const std::string moment = name.substr(param.size() + 1);
  for (const auto& m : rule->moments())
    if (m == moment) return s;
  const int64_t d = rule->own_moment_dim(it->second.whole, s.dim, moment);
  return d < 0 ? parallel::TpSplit{} : parallel::TpSplit{d, s.runs};
}

void OptimizerState::expect(const std::vector<std::pair<std::string, torch::Tensor>>& params, const UpdateRule& r) {
  expected.clear();
  parts.clear();
  for (const auto& [name, p] : params) {
    if (tp && !r.elementwise())
      // A rule's statistics over a split dimension are summed over the tp ranks; an expert's
      // (split by experts, dim 0) are its own, as in one process.
      if (const parallel::TpSplit s = tp->split(name); tp->group_of(s) && !s.experts && p.dim() > s.dim) {
        UpdateRule::Part& part = parts[name];
        part.whole = p.sizes().vec();
        part.whole[static_cast<size_t>(s.dim)] *= tp->group->size();
        part.dim = s.dim;
      }
    for (const auto& m : r.moments()) expected[name + "." + m] = p.sizes().vec();
    for (const auto& [m, shape] : own_moments(r, name, p.sizes())) expected[name + "." + m] = shape;
    expected[name + ".step"] = {};
  }
  expected["updates"] = {};
}

namespace {

// Issue 47: a state lacking a moment resumed with it at zero, a transposed one was taken.
void check_loaded(const std::map<std::string, std::vector<int64_t>>& expected,
                  const std::map<std::string, torch::Tensor>& t) {
  const std::string hint = "; the checkpoint was written for another model or optimizer, or is damaged: "
                           "resume from another checkpoint";
  for (const auto& [name, shape] : expected) {
    auto it = t.find(name);
    if (it == t.end() || !it->second.defined())
      throw std::runtime_error("optimizer state: tensor '" + name + "' is missing" + hint);
    if (!it->second.sizes().equals(shape))
      throw std::runtime_error("optimizer state: tensor '" + name + "' has shape " + shape_str(it->second) +
                               ", expected " + c10::str(c10::IntArrayRef(shape)) + hint);
    if (!all_finite(it->second))
      throw std::runtime_error("optimizer state: tensor '" + name + "' holds NaN or infinite values" + hint);
  }
  for (const auto& [name, _] : t)
    if (!expected.count(name)) throw std::runtime_error("optimizer state: unexpected tensor '" + name + "'" + hint);
}

}  // namespace

void OptimizerState::load(const std::map<std::string, torch::Tensor>& t) {
  if (!expected.empty()) check_loaded(expected, t);
  fused_step = torch::Tensor();  // the loaded steps rule
  if (shard.sharded() && !slots.empty()) {
    // Whole tensors for a sharded state: kept, and sliced again at the next update.
    slots.clear();
    flat.clear();
    shard = ShardPlan{};
  }
  auto it = t.find("updates");
  if (it != t.end()) updates = it->second.item<int64_t>();
  if (slots.empty()) {
    // Copies now: the given tensors may be aliases that their owner goes on changing.
    pending.clear();
    for (const auto& [k, v] : t) pending[k] = v.detach().clone();
    return;
  }
  // Slots exist once an update ran, with moments where their parameters live.
  for (Slot& s : slots) {
    c10::Device device(c10::kCPU);
    for (const auto& m : s.m)
      if (m.defined()) device = m.device();
    load_slot(s, t, device);
  }
}

void make_shard_slots(OptimizerState& st, const ShardPlan& plan, const ModelState::Named& params, const OptimConfig& cfg) {
  torch::NoGradGuard no_grad;
  if (!cfg.rule->elementwise() && !plan.whole_tensors)
    throw std::logic_error("make_shard_slots: the " + cfg.rule->kind + " rule is not element-wise: it needs a plan of "
                           "whole tensors");
  if (params.size() != plan.layout.slots.size())
    throw std::runtime_error("the model has " + std::to_string(params.size()) + " trainable parameters, the shard plan "
                             "was made for " + std::to_string(plan.layout.slots.size()));
  st.rule = cfg.rule;
  st.shard = plan;
  st.layout = plan.layout;
  st.slots.assign(plan.pieces.size(), OptimizerState::Slot{});
  auto whole = [&](const ShardPlan::Piece& piece) {
    return piece.offset == 0 && piece.numel == plan.layout.slots[static_cast<size_t>(piece.param)].numel;
  };
  for (size_t k = 0; k < plan.pieces.size(); ++k) {
    const ShardPlan::Piece& piece = plan.pieces[k];
    const torch::Tensor& p = params[static_cast<size_t>(piece.param)].second;
    st.slots[k].name = params[static_cast<size_t>(piece.param)].first;
    st.slots[k].decay = decays(p) ? 1 : 0;
    name_moments(st, st.slots[k], *st.rule, p);  // own moments: of whole parameters (not element-wise)
  }
  // The flat moments for this rank's slice of each buffer only; a piece's are a view of them
  // (shaped as its parameter when the piece is a whole one, as shard_pieces gives it).
  st.flat.assign(st.rule->moments().size(), {});
  for (size_t j = 0; j < st.flat.size(); ++j) {
    for (size_t g = 0; g < plan.groups.size(); ++g) {
      const FlatLayout::Group& lg = plan.layout.groups[g];
      st.flat[j].push_back(torch::zeros({plan.groups[g].end - plan.groups[g].begin},
                                        torch::TensorOptions().dtype(lg.dtype).device(lg.device)));
    }
    for (size_t k = 0; k < plan.pieces.size(); ++k) {
      const ShardPlan::Piece& piece = plan.pieces[k];
      torch::Tensor m = st.flat[j][static_cast<size_t>(piece.group)].narrow(0, piece.at, piece.numel);
      st.slots[k].m[j] = whole(piece) ? m.view(plan.shapes[static_cast<size_t>(piece.param)]) : m;
    }
  }
  // A resume: this rank's piece of each whole saved moment.
  if (st.pending.empty()) return;
  for (size_t k = 0; k < plan.pieces.size(); ++k) {
    const ShardPlan::Piece& piece = plan.pieces[k];
    OptimizerState::Slot& s = st.slots[k];
    if (whole(piece)) {  // every tensor of its slot, shapes checked
      load_slot(s, st.pending, params[static_cast<size_t>(piece.param)].second.device());
      continue;
    }
    for (size_t j = 0; j < st.flat.size(); ++j) {  // a piece of a parameter: flat moments only
      const std::string key = s.name + "." + s.names[j];
      auto it = st.pending.find(key);
      if (it == st.pending.end()) continue;
      if (it->second.numel() != plan.layout.slots[static_cast<size_t>(piece.param)].numel)
        throw std::runtime_error("optimizer state: '" + key + "' has shape " + shape_str(it->second) +
                                 ", the parameter has " +
                                 std::to_string(plan.layout.slots[static_cast<size_t>(piece.param)].numel) +
                                 " elements; the state was saved for another model");
      s.m[j].copy_(it->second.reshape({-1}).narrow(0, piece.offset, piece.numel));
    }
    auto step = st.pending.find(s.name + ".step");
    if (step != st.pending.end()) s.step = step->second.item<int64_t>();
  }
  st.pending.clear();
}

}  // namespace flowrun
