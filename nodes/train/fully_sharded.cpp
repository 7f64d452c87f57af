// ZeRO stage 3's sharded parameters (fully_sharded.hpp): the units, gathering and letting go,
// the use forward_backward and the readers open, the whole tensors an export gathers, the ranges a
// checkpoint writes and reads, and loads.
// Tests: tests/mpi/mpi_test.sh (zero_params), tests/nodes/graph_gpt_test.cpp (ZeRO.Params*).
#include "train/fully_sharded.hpp"

#include <malloc.h>

#include <algorithm>
#include <stdexcept>

#include "models/activation_checkpoint.hpp"
#include "parallel/cost_model.hpp"

namespace flowrun {

double zero3_gathered_bytes(const torch::nn::Module& module, const CheckpointPolicy& policy) {
  double all = 0, blocks = 0, kept = 0, largest = 0;
  for (const auto& p : module.parameters(/*recurse=*/true)) all += static_cast<double>(p.nbytes());
  const std::vector<const torch::nn::Module*> units = blocks_of(module);
  for (size_t i = 0; i < units.size(); ++i) {
    double bytes = 0;
    for (const auto& p : units[i]->parameters(/*recurse=*/true)) bytes += static_cast<double>(p.nbytes());
    blocks += bytes, largest = std::max(largest, bytes);
    if (!policy.recompute(static_cast<int64_t>(i))) kept += bytes;
  }
  return parallel::cost::zero3_gathered(all - blocks, kept, largest, all);
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
    if (s_.units_[static_cast<size_t>(u)].gathered()) return;
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
  void backward_done(const torch::nn::Module& block) override {
    const auto it = s_.unit_of_block_.find(&block);
    if (it != s_.unit_of_block_.end()) s_.release(it->second);
  }
  void new_pass() override {
    for (auto& u : s_.units_) u.pending = static_cast<int>(u.spans[0].params.size());
  }
  // A block's last gradient made: its backward is done with its trainable weights, which made
  // their gradients and the input's in one node each. A frozen weight (a LoRA's base) makes
  // only the input's, in a node autograd may run after the adapters' (their branch was recorded
  // later): such a block waits for its backward to be done (a recompute's end), or the use's.
  void grad_done(int param) override {
    if (param < 0 || param >= static_cast<int>(s_.unit_of_param_.size())) return;
    const int unit = s_.unit_of_param_[static_cast<size_t>(param)];
    ShardedParams::Unit& u = s_.units_[static_cast<size_t>(unit)];
    if (--u.pending == 0 && u.block && !u.frozen()) s_.release(unit);
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

namespace {
// One dtype on one device per part, or an error naming them.
void check_one_kind(const ShardPlan& plan, const std::string& which, const std::string& model) {
  if (plan.groups.size() == 1) return;
  if (plan.groups.empty())
    throw std::runtime_error("ZeRO stage params: '" + model + "' has no " + which + " parameters to shard");
  std::string kinds;
  for (const auto& g : plan.layout.groups)
    kinds += (kinds.empty() ? "" : ", ") + std::string(c10::toString(g.dtype)) + " on " + g.device.str();
  throw std::runtime_error("ZeRO stage params: the " + which + " parameters of '" + model + "' are of " +
                           std::to_string(plan.groups.size()) + " kinds (" + kinds +
                           "); sharding them needs one dtype on one device");
}
}  // namespace

std::shared_ptr<ShardedParams> ShardedParams::make(ModelState& model, const ShardPlan& plan) {
  check_one_kind(plan, "trainable", model.kind);
  auto s = std::shared_ptr<ShardedParams>(new ShardedParams());
  const ModelState::Named named = model.named_parameters(/*trainable_only=*/true);
  ModelState::Named frozen;
  for (const auto& [name, t] : model.named_parameters())
    if (!t.requires_grad()) frozen.emplace_back(name, t);
  std::vector<torch::Tensor> tensors[2];
  for (const auto& [name, t] : named) tensors[0].push_back(t);
  for (const auto& [name, t] : frozen) tensors[1].push_back(t);
  s->parts_[0].plan = plan;
  if (!frozen.empty()) {  // cut as the trainable ones are: element-wise, over the same ranks
    s->parts_[1].plan = ShardPlan::make(FlatLayout::of(tensors[1]), frozen, plan.rank, plan.world);
    check_one_kind(s->parts_[1].plan, "frozen", model.kind);
  }
  auto gs = std::make_shared<GradShard>();
  gs->plan = plan;
  gs->buckets = FlatLayout::of(tensors[0], /*reverse=*/true);
  s->grad_shard_ = gs;
  // This rank's slices of the values, then every parameter lets go of its data.
  torch::NoGradGuard no_grad;
  for (int k = 0; k < 2; ++k) {
    Part& part = s->parts_[k];
    if (part.plan.groups.empty()) continue;
    const ShardPlan::Group& g = part.plan.groups[0];
    const FlatLayout::Group& lg = part.plan.layout.groups[0];
    part.slices = {torch::empty({g.end - g.begin}, torch::TensorOptions().dtype(lg.dtype).device(lg.device))};
    for (const ShardPlan::Piece& piece : part.plan.pieces)
      part.slices[0].narrow(0, piece.at, piece.numel)
          .copy_(tensors[k][static_cast<size_t>(piece.param)].reshape({-1}).narrow(0, piece.offset, piece.numel));
  }
  s->bind(model);
  // The template copies start from: the module with its parameters empty (a clone copies every
  // parameter's data, and a placeholder's would be copied to its whole size).
  for (Part& part : s->parts_)
    for (auto& p : part.params) p.set_data(torch::empty({0}, p.options()));
  s->template_ = model.module->clone();
  s->let_go();
  // On the CPU the whole model just let go stays in glibc's heap (flowrun's main keeps freed
  // blocks in the process for speed: cli/main.cpp); handed back now, once (measured, GPT 151M at
  // dp 4 with checkpoint: blocks: peak 1.53 GB a rank against 2.05 GB). A lower mmap threshold
  // would hand back each block a step frees too (1.34 GB), but cost a third of the step's speed
  // in page faults.
  if (plan.layout.groups[0].device.is_cpu() && plan.world > 1) malloc_trim(0);
  return s;
}

std::shared_ptr<ModelState::Shards> ShardedParams::copy_for(ModelState& copy) const {
  auto s = std::shared_ptr<ShardedParams>(new ShardedParams());
  s->grad_shard_ = grad_shard_;
  s->template_ = template_;
  torch::NoGradGuard no_grad;
  for (int k = 0; k < 2; ++k) {
    s->parts_[k].plan = parts_[k].plan;
    // The trainable slice its own; the frozen one shared (nothing writes it but a load, which
    // writes the same values into every copy).
    for (const auto& t : parts_[k].slices) s->parts_[k].slices.push_back(k == 0 ? t.clone() : t);
  }
  s->bind(copy);
  s->let_go();
  return s;
}

std::shared_ptr<torch::nn::Module> ShardedParams::fresh_module() const { return template_->clone(); }

void ShardedParams::bind(ModelState& model) {
  placeholders_.clear();
  units_.clear();
  unit_of_param_.clear();
  unit_of_block_.clear();
  // Each part's parameters as its plan was made for them (a copy's: the same names).
  std::map<std::string, torch::Tensor> by_name;
  const auto all = model.module->named_parameters(/*recurse=*/true);
  for (const auto& item : all) by_name[item.key()] = item.value();
  std::map<const c10::TensorImpl*, std::pair<int, int>> where;  // a parameter's part and index in it
  for (int k = 0; k < 2; ++k) {
    Part& part = parts_[k];
    part.params.clear();
    part.placeholders.clear();
    for (size_t i = 0; i < part.plan.names.size(); ++i) {
      auto it = by_name.find(part.plan.names[i]);
      if (it == by_name.end()) throw std::logic_error("ZeRO-3: the model has no parameter '" + part.plan.names[i] + "'");
      where[it->second.unsafeGetTensorImpl()] = {k, static_cast<int>(i)};
      part.params.push_back(it->second);
      // What each holds between uses: its shape over one element of storage (autograd's gradient
      // accumulators check the gradients against the shape they saw, whenever they were made),
      // which every index reads and no write may touch.
      const FlatLayout::Group& lg = part.plan.layout.groups[0];
      const std::vector<int64_t>& shape = part.plan.shapes[i];
      const torch::Tensor one = torch::zeros({1}, torch::TensorOptions().dtype(lg.dtype).device(lg.device));
      part.placeholders.push_back(one.as_strided(shape, std::vector<int64_t>(shape.size(), 0)));
      if (k == 0) placeholders_.emplace_back(part.plan.names[i], part.placeholders.back());
    }
  }
  // Which block each parameter belongs to; the units: runs of parameters of one owner, in module
  // order, each a run of either part's flat buffer.
  const std::vector<const torch::nn::Module*> blocks = blocks_of(*model.module);  // the units' blocks
  std::map<const c10::TensorImpl*, const torch::nn::Module*> owner;
  for (const torch::nn::Module* b : blocks)
    for (const auto& p : b->parameters(/*recurse=*/true)) owner[p.unsafeGetTensorImpl()] = b;
  unit_of_param_.assign(parts_[0].params.size(), -1);
  const torch::nn::Module* last = nullptr;
  for (const auto& item : all) {
    const auto at = where.find(item.value().unsafeGetTensorImpl());
    if (at == where.end()) continue;
    const auto [k, i] = at->second;
    const auto it = owner.find(item.value().unsafeGetTensorImpl());
    const torch::nn::Module* o = it == owner.end() ? nullptr : it->second;
    if (units_.empty() || o != last) {
      if (o && unit_of_block_.count(o))
        throw std::logic_error("ZeRO-3: the parameters of a block are not one run in module order");
      units_.push_back(Unit{});
      units_.back().block = o != nullptr;
      if (o) unit_of_block_[o] = static_cast<int>(units_.size()) - 1;
    }
    Span& span = units_.back().spans[k];
    const FlatLayout::Slot& slot = parts_[k].plan.layout.slots[static_cast<size_t>(i)];
    if (span.params.empty()) span.lo = span.hi = slot.offset;
    if (slot.offset != span.hi) throw std::logic_error("ZeRO-3: the parameters of a unit are not one run of their flat buffer");
    span.params.push_back(i);
    span.hi = slot.offset + slot.numel;
    if (k == 0) unit_of_param_[static_cast<size_t>(i)] = static_cast<int>(units_.size()) - 1;
    last = o;
  }
}

void ShardedParams::let_go() {
  for (Part& part : parts_)
    for (size_t i = 0; i < part.params.size(); ++i) {
      const FlatLayout::Slot& slot = part.plan.layout.slots[i];
      // One rank: a view of the slice (the whole buffer), for good.
      part.params[i].set_data(world() == 1 ? part.slices[0].narrow(0, slot.offset, slot.numel).view(part.plan.shapes[i])
                                           : part.placeholders[i]);
    }
}

// ---- gathering and letting go

void ShardedParams::gather(int unit, parallel::Group* group, const std::string& what) {
  Unit& u = units_[static_cast<size_t>(unit)];
  if (world() == 1 || u.gathered()) return;
  start(unit, group, what);
  for (int k = 0; k < 2; ++k) {
    Span& span = u.spans[k];
    if (span.params.empty()) continue;
    span.pending_gather.wait();
    span.pending_gather = parallel::Work();
    const Part& part = parts_[k];
    for (int p : span.params) {
      const FlatLayout::Slot& slot = part.plan.layout.slots[static_cast<size_t>(p)];
      part.params[static_cast<size_t>(p)].set_data(
          span.arriving.narrow(0, slot.offset - span.lo, slot.numel).view(part.plan.shapes[static_cast<size_t>(p)]));
    }
    span.gathered = span.arriving;
    span.arriving = torch::Tensor();
  }
}

void ShardedParams::start(int unit, parallel::Group* group, const std::string& what) {
  Unit& u = units_[static_cast<size_t>(unit)];
  if (world() == 1 || u.gathered()) return;
  if (!group) throw std::logic_error("ZeRO-3: gathering over " + std::to_string(world()) + " ranks without a group");
  torch::NoGradGuard no_grad;
  for (int k = 0; k < 2; ++k) {
    Span& span = u.spans[k];
    if (span.params.empty() || span.arriving.defined()) continue;
    const Part& part = parts_[k];
    const ShardPlan::Group& g = part.plan.groups[0];
    // Rank q's piece of the span: its slice and the range overlapping, in rank order one after
    // the other (the all-gather's blocks).
    std::vector<size_t> counts;
    for (int q = 0; q < world(); ++q) {
      const int64_t lo = std::max(g.cuts[static_cast<size_t>(q)], span.lo), hi = std::min(g.cuts[static_cast<size_t>(q) + 1], span.hi);
      counts.push_back(static_cast<size_t>(std::max<int64_t>(0, hi - lo)));
    }
    torch::Tensor buf = torch::empty({span.hi - span.lo}, part.slices[0].options());
    const int64_t lo = std::max(g.begin, span.lo), hi = std::min(g.end, span.hi);
    if (lo < hi) buf.narrow(0, lo - span.lo, hi - lo).copy_(part.slices[0].narrow(0, lo - g.begin, hi - lo));
    span.pending_gather = group->all_gather(buf, counts, std::string("ZeRO-3: the ") + (k == 0 ? "" : "frozen ") +
                                                             "parameters of " + what);
    span.arriving = buf;
  }
}

void ShardedParams::release(int unit) {
  Unit& u = units_[static_cast<size_t>(unit)];
  for (int k = 0; k < 2; ++k) {
    Span& span = u.spans[k];
    if (span.arriving.defined()) {  // started, never used: its all-gather still writes into the buffer
      parallel::Work w = std::move(span.pending_gather);
      span.pending_gather = parallel::Work();
      span.arriving = torch::Tensor();
      w.wait();
    }
    if (world() == 1 || !span.gathered.defined()) continue;
    for (int p : span.params) parts_[k].params[static_cast<size_t>(p)].set_data(parts_[k].placeholders[static_cast<size_t>(p)]);
    span.gathered = torch::Tensor();
  }
}

std::unique_ptr<ParamUse> ShardedParams::open(parallel::Group* group, const std::string& what) {
  return std::make_unique<ShardedUse>(*this, group, what);
}

// ---- what checkpoints, memory estimates and the optimizer ask

double ShardedParams::bytes() const {
  double b = 0;
  for (const Part& part : parts_)
    for (const FlatLayout::Group& lg : part.plan.layout.groups)
      b += static_cast<double>(lg.numel) * static_cast<double>(c10::elementSize(lg.dtype));
  return b;
}

double ShardedParams::largest_unit_bytes() const {
  double most = 0;
  for (const Unit& u : units_) {
    double b = 0;
    for (int k = 0; k < 2; ++k)
      if (!u.spans[k].params.empty())
        b += static_cast<double>(u.spans[k].hi - u.spans[k].lo) *
             static_cast<double>(c10::elementSize(parts_[k].plan.layout.groups[0].dtype));
    most = std::max(most, b);
  }
  return most;
}

std::map<std::string, torch::Tensor> ShardedParams::wholes(parallel::Group& group) {
  torch::NoGradGuard no_grad;
  std::map<std::string, torch::Tensor> out;
  for (const Part& part : parts_) {
    if (part.plan.groups.empty()) continue;
    const ShardPlan::Group& g = part.plan.groups[0];
    // On the host, as the optimizer's moments are gathered (for an exports: true checkpoint).
    torch::Tensor whole = torch::zeros({g.numel}, part.slices[0].options().device(torch::kCPU));
    whole.narrow(0, g.begin, g.end - g.begin).copy_(part.slices[0]);
    if (part.plan.world > 1) group.all_gather(whole, g.counts(), "ZeRO-3: the parameters whole for a checkpoint").wait();
    for (size_t i = 0; i < part.plan.names.size(); ++i) out[part.plan.names[i]] = part.plan.layout.view({whole}, i, part.plan.shapes[i]);
  }
  return out;
}

std::map<std::string, torch::Tensor> ShardedParams::load(const std::map<std::string, torch::Tensor>& whole) {
  std::map<std::string, torch::Tensor> rest = whole;
  for (const Part& part : parts_)
    for (size_t i = 0; i < part.plan.names.size(); ++i) {
      auto it = rest.find(part.plan.names[i]);
      if (it == rest.end()) throw std::runtime_error("model: tensor '" + part.plan.names[i] + "' is missing");
      if (!it->second.sizes().equals(part.plan.shapes[i]))
        throw std::runtime_error("model: tensor '" + part.plan.names[i] + "' has shape " + shape_str(it->second) +
                                 " in the file, the model's is " + c10::str(at::IntArrayRef(part.plan.shapes[i])));
    }
  torch::NoGradGuard no_grad;
  for (Part& part : parts_) {
    for (const ShardPlan::Piece& piece : part.plan.pieces) {
      const torch::Tensor& t = rest.at(part.plan.names[static_cast<size_t>(piece.param)]);
      part.slices[0].narrow(0, piece.at, piece.numel).copy_(t.reshape({-1}).narrow(0, piece.offset, piece.numel));
    }
    for (const std::string& name : part.plan.names) rest.erase(name);
  }
  return rest;
}

std::vector<ModelState::Shards::Range> ShardedParams::ranges() {
  std::vector<Range> out;
  for (Part& part : parts_)
    for (const ShardPlan::Piece& piece : part.plan.pieces) {
      const auto i = static_cast<size_t>(piece.param);
      out.push_back({part.plan.names[i], part.plan.shapes[i], piece.offset, part.slices[0].narrow(0, piece.at, piece.numel)});
    }
  return out;
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
