// ZeRO stage 3's sharded parameters (fully_sharded.hpp): the units, gathering and letting go,
// the use forward_backward and the readers open, checkpoints' whole tensors and loads.
// Tests: tests/mpi/mpi_test.sh (zero_params), tests/nodes/graph_gpt_test.cpp (ZeRO.Params*).
#include "train/fully_sharded.hpp"

#include <malloc.h>

#include <algorithm>
#include <stdexcept>

namespace flowrun {

namespace {

// The modules whose parameters make a unit: the items of the outermost ModuleLists (the blocks
// run_block runs), found from `m` down, not below a list.
void find_blocks(const torch::nn::Module& m, std::vector<const torch::nn::Module*>& out) {
  for (const auto& child : m.children()) {
    if (dynamic_cast<const torch::nn::ModuleListImpl*>(child.get())) {
      for (const auto& item : child->children()) out.push_back(item.get());
    } else {
      find_blocks(*child, out);
    }
  }
}

}  // namespace

double largest_block_bytes(const torch::nn::Module& module) {
  std::vector<const torch::nn::Module*> blocks;
  find_blocks(module, blocks);
  double largest = 0;
  for (const torch::nn::Module* b : blocks) {
    double bytes = 0;
    for (const auto& p : b->parameters(/*recurse=*/true)) bytes += static_cast<double>(p.nbytes());
    largest = std::max(largest, bytes);
  }
  return largest;
}

// ---- the use: what a node opens for as long as it runs the model

class ShardedUse : public ParamUse {
 public:
  ShardedUse(ShardedParams& s, parallel::Group* group, std::string what) : s_(s), group_(group), what_(std::move(what)) {
    if (s_.in_use_)
      throw std::logic_error("ZeRO-3: the model's parameters are in use by another node (" + what_ +
                             "); a reader runs a copy of the model (ModelState::clone)");
    s_.in_use_ = true;
    try {
      new_pass();
      for (size_t u = 0; u < s_.units_.size(); ++u)
        if (!s_.units_[u].block) s_.gather(static_cast<int>(u), group_, what_);  // embeddings, norms, head: for the whole use
    } catch (...) {
      close();
      throw;
    }
  }
  ~ShardedUse() override { close(); }
  void gather(const torch::nn::Module& block, bool recompute) override {
    const auto it = s_.unit_of_block_.find(&block);
    if (it == s_.unit_of_block_.end()) return;
    const int u = it->second;
    if (s_.units_[static_cast<size_t>(u)].gathered.defined()) return;
    s_.gather(u, group_, what_);
    // The block that runs next starts on its way now (forward: the next one; recomputes in
    // backward: the one before), so its all-gather overlaps this block's compute.
    const int next = u + (recompute ? -1 : 1);
    if (next >= 0 && next < static_cast<int>(s_.units_.size()) && s_.units_[static_cast<size_t>(next)].block)
      s_.start(next, group_, what_);
  }
  void after_forward(const torch::nn::Module& block, bool kept) override {
    const auto it = s_.unit_of_block_.find(&block);
    if (it != s_.unit_of_block_.end() && !kept) s_.release(it->second);
  }
  void new_pass() override {
    for (auto& u : s_.units_) u.pending = static_cast<int>(u.params.size());
  }
  void grad_done(int param) override {
    if (param < 0 || param >= static_cast<int>(s_.unit_of_param_.size())) return;
    ShardedParams::Unit& u = s_.units_[static_cast<size_t>(s_.unit_of_param_[static_cast<size_t>(param)])];
    if (--u.pending == 0 && u.block) s_.release(s_.unit_of_param_[static_cast<size_t>(param)]);
  }

 private:
  void close() noexcept {
    for (size_t u = 0; u < s_.units_.size(); ++u) {
      try {
        s_.release(static_cast<int>(u));  // a gather still on its way is waited for first
      } catch (const std::exception&) {
        // Its wait failed (a rank gone): the communication layer ends the job; nothing to free safely.
      }
    }
    s_.in_use_ = false;
  }
  ShardedParams& s_;
  parallel::Group* group_;
  std::string what_;
};

// ---- making, copying, binding

std::shared_ptr<ShardedParams> ShardedParams::make(ModelState& model, const ShardPlan& plan) {
  if (plan.groups.size() != 1) {
    std::string kinds;
    for (const auto& g : plan.layout.groups)
      kinds += (kinds.empty() ? "" : ", ") + std::string(c10::toString(g.dtype)) + " on " + g.device.str();
    throw std::runtime_error("ZeRO stage params: the trainable parameters of '" + model.kind + "' are of " +
                             std::to_string(plan.groups.size()) + " kinds (" + kinds +
                             "); sharding them needs one dtype on one device");
  }
  auto s = std::shared_ptr<ShardedParams>(new ShardedParams());
  s->plan_ = plan;
  const ModelState::Named named = model.named_parameters(/*trainable_only=*/true);
  std::vector<torch::Tensor> tensors;
  for (const auto& [name, t] : named) tensors.push_back(t);
  auto gs = std::make_shared<GradShard>();
  gs->plan = plan;
  gs->buckets = FlatLayout::of(tensors, /*reverse=*/true);
  s->grad_shard_ = gs;
  // This rank's slice of the values, then every parameter lets go of its data.
  const ShardPlan::Group& g = plan.groups[0];
  const FlatLayout::Group& lg = plan.layout.groups[0];
  torch::NoGradGuard no_grad;
  s->slices_ = {torch::empty({g.end - g.begin}, torch::TensorOptions().dtype(lg.dtype).device(lg.device))};
  for (const ShardPlan::Piece& piece : plan.pieces)
    s->slices_[0].narrow(0, piece.at, piece.numel)
        .copy_(tensors[static_cast<size_t>(piece.param)].reshape({-1}).narrow(0, piece.offset, piece.numel));
  s->bind(model);
  // The template copies start from: the module with its parameters empty (a clone copies every
  // parameter's data, and a placeholder's would be copied to its whole size).
  for (auto& p : s->params_) p.set_data(torch::empty({0}, p.options()));
  s->template_ = model.module->clone();
  s->let_go();
  // On the CPU the whole model just let go stays in glibc's heap (flowrun's main keeps freed
  // blocks in the process for speed: cli/main.cpp); handed back now, once (measured, GPT 151M at
  // dp 4 with checkpoint: blocks: peak 1.53 GB a rank against 2.05 GB). A lower mmap threshold
  // would hand back each block a step frees too (1.34 GB), but cost a third of the step's speed
  // in page faults.
  if (lg.device.is_cpu() && plan.world > 1) malloc_trim(0);
  return s;
}

std::shared_ptr<ModelState::Shards> ShardedParams::copy_for(ModelState& copy) const {
  auto s = std::shared_ptr<ShardedParams>(new ShardedParams());
  s->plan_ = plan_;
  s->grad_shard_ = grad_shard_;
  s->template_ = template_;
  torch::NoGradGuard no_grad;
  for (const auto& t : slices_) s->slices_.push_back(t.clone());
  s->bind(copy);
  s->let_go();
  return s;
}

std::shared_ptr<torch::nn::Module> ShardedParams::fresh_module() const { return template_->clone(); }

void ShardedParams::bind(ModelState& model) {
  params_.clear();
  placeholders_.clear();
  units_.clear();
  unit_of_param_.clear();
  unit_of_block_.clear();
  // The model's trainable parameters as the plan was made for them (a copy's: the same names).
  std::map<std::string, torch::Tensor> by_name;
  for (const auto& item : model.module->named_parameters(/*recurse=*/true)) by_name[item.key()] = item.value();
  for (const std::string& name : plan_.names) {
    auto it = by_name.find(name);
    if (it == by_name.end()) throw std::logic_error("ZeRO-3: the model has no parameter '" + name + "'");
    params_.push_back(it->second);
  }
  // What each holds between uses: its shape over one element of storage (autograd's gradient
  // accumulators check the gradients against the shape they saw, whenever they were made), which
  // every index reads and no write may touch.
  const FlatLayout::Group& lg = plan_.layout.groups[0];
  for (size_t i = 0; i < plan_.names.size(); ++i) {
    const std::vector<int64_t>& shape = plan_.shapes[i];
    const torch::Tensor one = torch::zeros({1}, torch::TensorOptions().dtype(lg.dtype).device(lg.device));
    placeholders_.emplace_back(plan_.names[i], one.as_strided(shape, std::vector<int64_t>(shape.size(), 0)));
  }
  // Which block each parameter belongs to; the units: runs of parameters of one owner.
  std::vector<const torch::nn::Module*> blocks;
  find_blocks(*model.module, blocks);
  std::map<const c10::TensorImpl*, const torch::nn::Module*> owner;
  for (const torch::nn::Module* b : blocks)
    for (const auto& p : b->parameters(/*recurse=*/true)) owner[p.unsafeGetTensorImpl()] = b;
  const torch::nn::Module* last = nullptr;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto it = owner.find(params_[i].unsafeGetTensorImpl());
    const torch::nn::Module* o = it == owner.end() ? nullptr : it->second;
    const FlatLayout::Slot& slot = plan_.layout.slots[i];
    if (units_.empty() || o != last || slot.offset != units_.back().hi) {
      if (o && unit_of_block_.count(o))
        throw std::logic_error("ZeRO-3: the parameters of a block are not one run of the flat buffer");
      units_.push_back(Unit{slot.offset, slot.offset, {}, o != nullptr, {}, {}, {}, 0});
      if (o) unit_of_block_[o] = static_cast<int>(units_.size()) - 1;
    }
    Unit& u = units_.back();
    u.params.push_back(static_cast<int>(i));
    u.hi = slot.offset + slot.numel;
    unit_of_param_.push_back(static_cast<int>(units_.size()) - 1);
    last = o;
  }
}

void ShardedParams::let_go() {
  for (size_t i = 0; i < params_.size(); ++i) {
    const FlatLayout::Slot& slot = plan_.layout.slots[i];
    // One rank: a view of the slice (the whole buffer), for good.
    params_[i].set_data(plan_.world == 1 ? slices_[0].narrow(0, slot.offset, slot.numel).view(plan_.shapes[i]) : placeholders_[i].second);
  }
}

// ---- gathering and letting go

void ShardedParams::gather(int unit, parallel::Group* group, const std::string& what) {
  Unit& u = units_[static_cast<size_t>(unit)];
  if (plan_.world == 1 || u.gathered.defined()) return;
  if (!u.arriving.defined()) start(unit, group, what);
  u.pending_gather.wait();
  u.pending_gather = parallel::Work();
  for (int p : u.params) {
    const FlatLayout::Slot& slot = plan_.layout.slots[static_cast<size_t>(p)];
    params_[static_cast<size_t>(p)].set_data(u.arriving.narrow(0, slot.offset - u.lo, slot.numel).view(plan_.shapes[static_cast<size_t>(p)]));
  }
  u.gathered = u.arriving;
  u.arriving = torch::Tensor();
}

void ShardedParams::start(int unit, parallel::Group* group, const std::string& what) {
  Unit& u = units_[static_cast<size_t>(unit)];
  if (plan_.world == 1 || u.gathered.defined() || u.arriving.defined()) return;
  if (!group) throw std::logic_error("ZeRO-3: gathering over " + std::to_string(plan_.world) + " ranks without a group");
  const ShardPlan::Group& g = plan_.groups[0];
  // Rank q's piece of the unit's range: its slice and the range overlapping, in rank order one
  // after the other (the all-gather's blocks).
  std::vector<size_t> counts;
  for (int q = 0; q < plan_.world; ++q) {
    const int64_t lo = std::max(g.cuts[static_cast<size_t>(q)], u.lo), hi = std::min(g.cuts[static_cast<size_t>(q) + 1], u.hi);
    counts.push_back(static_cast<size_t>(std::max<int64_t>(0, hi - lo)));
  }
  torch::NoGradGuard no_grad;
  torch::Tensor buf = torch::empty({u.hi - u.lo}, slices_[0].options());
  const int64_t lo = std::max(g.begin, u.lo), hi = std::min(g.end, u.hi);
  if (lo < hi) buf.narrow(0, lo - u.lo, hi - lo).copy_(slices_[0].narrow(0, lo - g.begin, hi - lo));
  u.pending_gather = group->all_gather(buf, counts, "ZeRO-3: the parameters of " + what);
  u.arriving = buf;
}

void ShardedParams::release(int unit) {
  Unit& u = units_[static_cast<size_t>(unit)];
  if (u.arriving.defined()) {  // started, never used: its all-gather still writes into the buffer
    parallel::Work w = std::move(u.pending_gather);
    u.pending_gather = parallel::Work();
    u.arriving = torch::Tensor();
    w.wait();
  }
  if (plan_.world == 1 || !u.gathered.defined()) return;
  for (int p : u.params) params_[static_cast<size_t>(p)].set_data(placeholders_[static_cast<size_t>(p)].second);
  u.gathered = torch::Tensor();
}

std::unique_ptr<ParamUse> ShardedParams::open(parallel::Group* group, const std::string& what) {
  return std::make_unique<ShardedUse>(*this, group, what);
}

// ---- what checkpoints, memory estimates and the optimizer ask

double ShardedParams::bytes() const {
  const FlatLayout::Group& lg = plan_.layout.groups[0];
  return static_cast<double>(lg.numel) * static_cast<double>(c10::elementSize(lg.dtype));
}

double ShardedParams::largest_unit_bytes() const {
  int64_t most = 0;
  for (const Unit& u : units_) most = std::max(most, u.hi - u.lo);
  return static_cast<double>(most) * static_cast<double>(c10::elementSize(plan_.layout.groups[0].dtype));
}

std::map<std::string, torch::Tensor> ShardedParams::wholes(parallel::Group& group) {
  const ShardPlan::Group& g = plan_.groups[0];
  torch::NoGradGuard no_grad;
  // On the host, as the optimizer's moments are gathered for a checkpoint.
  torch::Tensor whole = torch::zeros({g.numel}, slices_[0].options().device(torch::kCPU));
  whole.narrow(0, g.begin, g.end - g.begin).copy_(slices_[0]);
  if (plan_.world > 1) group.all_gather(whole, g.counts(), "ZeRO-3: the parameters whole for a checkpoint").wait();
  std::map<std::string, torch::Tensor> out;
  for (size_t i = 0; i < plan_.names.size(); ++i) out[plan_.names[i]] = plan_.layout.view({whole}, i, plan_.shapes[i]);
  return out;
}

std::map<std::string, torch::Tensor> ShardedParams::load(const std::map<std::string, torch::Tensor>& whole) {
  std::map<std::string, torch::Tensor> rest = whole;
  for (size_t i = 0; i < plan_.names.size(); ++i) {
    auto it = rest.find(plan_.names[i]);
    if (it == rest.end()) throw std::runtime_error("model: tensor '" + plan_.names[i] + "' is missing");
    if (!it->second.sizes().equals(plan_.shapes[i]))
      throw std::runtime_error("model: tensor '" + plan_.names[i] + "' has shape " + shape_str(it->second) +
                               " in the file, the model's is " + c10::str(at::IntArrayRef(plan_.shapes[i])));
  }
  torch::NoGradGuard no_grad;
  for (const ShardPlan::Piece& piece : plan_.pieces) {
    const torch::Tensor& t = rest.at(plan_.names[static_cast<size_t>(piece.param)]);
    slices_[0].narrow(0, piece.at, piece.numel).copy_(t.reshape({-1}).narrow(0, piece.offset, piece.numel));
  }
  for (const std::string& name : plan_.names) rest.erase(name);
  return rest;
}

ShardedReader::ShardedReader(ModelState& model, parallel::Group* group, const std::string& what)
    : model_(model), group_(group) {
  if (!model.shards) return;
  copy_ = model.clone();
  use_ = copy_->shards->open(group, what);
}

int64_t ShardedReader::agreed(int64_t n) {
  if (!copy_ || !group_) return n;
  torch::Tensor t = torch::tensor({static_cast<double>(n)}, torch::kDouble);
  group_->all_reduce(t, comm::Op::min, "ZeRO-3: the forwards every rank runs").wait();
  return static_cast<int64_t>(t.item<double>());
}

}  // namespace flowrun
