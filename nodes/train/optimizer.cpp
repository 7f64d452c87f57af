// optimizer: an update rule (train/update_rule.hpp: AdamW, SGD, Adafactor in rules/, or a
// plugin's) with what every rule shares: decoupled weight decay, grad-norm clipping, a
// learning-rate schedule, non-finite steps, flat moment buffers, ZeRO sharding, checkpoints.
// Here: the update (optimizer_update) and the node. Beside it: the state's slots and their
// checkpoint I/O (optimizer_slots.cpp), gathering a sharded state (optimizer_gather.cpp), the
// learning-rate schedule (lr_schedule.cpp), the shard plan (optimizer_shard.cpp).
// Schema: schemas/optimizer.yaml. Test: tests/nodes/optimizer_test.cpp.
#include "train/optimizer.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>

#include "common/device.hpp"
#include "common/state_io.hpp"
#include "common/tensor_map.hpp"
#include "parallel/collectives.hpp"
#include "parallel/expert_parallel.hpp"
#include "parallel/placement.hpp"
#include "parallel/tensor_messages.hpp"
#include "parallel/tensor_parallel.hpp"
#include "parallel/zero_plan.hpp"
#include "registry.hpp"
#include "train/fully_sharded.hpp"
#include "train/optimizer_slots.hpp"
#include "train/precision.hpp"

namespace flowrun {

torch::Tensor global_norm(const Grads& grads) {
  std::vector<torch::Tensor> given;
  given.reserve(grads.size());
  for (const auto& g : grads)
    if (g.defined()) given.push_back(g);
  if (given.empty()) return torch::zeros({}, torch::kFloat);
  bool foreach = !given.front().is_cpu();
  for (const auto& g : given)
    foreach = foreach && g.scalar_type() == torch::kFloat && g.device() == given.front().device();
  std::vector<torch::Tensor> norms;
  if (foreach) {
    norms = at::_foreach_norm(given, 2);
  } else {
    norms.reserve(given.size());
    for (const auto& g : given) norms.push_back(at::linalg_vector_norm(g, 2, c10::nullopt, false, torch::kFloat));
  }
  return at::linalg_vector_norm(torch::stack(norms), 2);
}

namespace {
// The square of `grads`' global norm ([1]), where the gradients are (on `device`: on a GPU no step
// waits for the host; on the CPU in double).
torch::Tensor squares(const Grads& grads, const c10::Device& device) {
  return global_norm(grads).to(device, device.is_cpu() ? torch::kDouble : torch::kFloat).square().reshape({1}).contiguous();
}
// The same summed over `group` (each rank holds part of the gradients).
torch::Tensor squares_over(const Grads& grads, const c10::Device& device, parallel::Group& group, const std::string& what) {
  torch::Tensor sq = squares(grads, device);
  group.all_reduce(sq, comm::Op::sum, what).wait();
  return sq;
}
}  // namespace

int64_t nonfinite_count(const OptimizerState& st) {
  return st.nonfinite.defined() ? static_cast<int64_t>(st.nonfinite.item<double>()) : 0;
}

torch::Tensor optimizer_update(OptimizerState& st, const ModelState::Named& params, const Grads& grads,
                               const OptimConfig& cfg, double lr, const torch::Tensor& norm_of_all) {
  torch::NoGradGuard no_grad;
  st.gathered.clear();  // what an exports: true checkpoint's collect gathered: stale from here on
  if (grads.size() != params.size())
    throw std::runtime_error("got " + std::to_string(grads.size()) + " grads for " + std::to_string(params.size()) +
                             " trainable parameters");
  for (size_t i = 0; i < params.size(); ++i)
    if (grads[i].defined() && !grads[i].sizes().equals(params[i].second.sizes()))
      throw std::runtime_error("grad " + std::to_string(i) + " (" + params[i].first + ") has shape " +
                               shape_str(grads[i]) + ", the parameter " + shape_str(params[i].second));
  if (st.slots.empty()) {
    make_slots(st, params, cfg);
    if (!st.pending.empty()) {
      for (size_t i = 0; i < params.size(); ++i) load_slot(st.slots[i], st.pending, params[i].second.device());
      st.pending.clear();
    }
  } else if (st.slots.size() != params.size()) {
    throw std::runtime_error("the model has " + std::to_string(params.size()) + " trainable parameters, the optimizer " +
                             "state was made for " + std::to_string(st.slots.size()));
  }

  torch::Tensor norm = norm_of_all.defined() ? norm_of_all : global_norm(grads);
  torch::Tensor coef;  // clip factor, kept on the device (no host sync)
  if (cfg.clip > 0) coef = torch::clamp_max(cfg.clip / (norm + 1e-6), 1.0);

  const UpdateRule& rule = *st.rule;
  std::vector<char> done(params.size(), 0);
  UpdateRule::Batch batch{st, params, grads, lr, cfg.weight_decay, coef, 1.0f, torch::Tensor(), done};
  batch.on_device = rule.on_device(st, params, grads);

  // Where the rule updates on the device, a non-finite step's flag goes into its kernel and no
  // host reads it (defer_nonfinite); the count stays on the device too.
  if (cfg.defer_nonfinite && batch.on_device) {
    batch.found_inf = norm.isfinite().logical_not().to(torch::kFloat);
    st.nonfinite = st.nonfinite.defined() ? st.nonfinite.add_(batch.found_inf) : batch.found_inf.clone();
    rule.update_many(batch);
    st.updates += 1;
    return norm;
  }
  if (!std::isfinite(norm.item<double>())) {
    if (cfg.skip_nonfinite || cfg.defer_nonfinite) {  // the caller counts and reports skipped steps
      torch::Tensor one = torch::ones({}, norm.options().dtype(torch::kFloat));
      st.nonfinite = st.nonfinite.defined() ? st.nonfinite.add_(one) : one;
      return norm;
    }
    throw NonFiniteGrads("the gradients are not finite (global norm " + std::to_string(norm.item<double>()) +
                         "): the loss diverged or overflowed; lower the lr, add clip, or set skip_nonfinite: true");
  }
  if (!batch.on_device) settle_fused_step(st);  // the paths below count steps on the host
  // The clip factor as a number, for CPU kernels (a CPU tensor: reading it costs no sync).
  if (coef.defined() && coef.device().is_cpu()) batch.clip_cpu = coef.item<float>();
  rule.update_many(batch);
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& g0 = grads[i];
    if (done[i] || !g0.defined()) continue;
    torch::Tensor p = params[i].second;
    OptimizerState::Slot& s = st.slots[i];
    const torch::Tensor g = coef.defined() ? g0 * coef.to(g0.dtype()) : g0;
    s.step += 1;
    if (cfg.weight_decay > 0 && s.decays(p)) p.mul_(1.0 - lr * cfg.weight_decay);
    // A tp part, for a rule that is not element-wise (its sums over the group: every tp rank
    // updates its parts in this same order).
    const auto part = st.parts.find(s.name);
    rule.update(p, g, s.m, {lr, s.step, part == st.parts.end() ? nullptr : &part->second});
  }
  st.updates += 1;
  return norm;
}

namespace {

class OptimizerNode : public Node {
 private:
  enum class Split { none, tp, ep };  // how a parameter lies over the ranks, for the gradient norm's sums

 public:
  void setup(SetupContext& ctx) override {
    const Params& p = ctx.params();
    // The update rule from the group of its kind (the checker filled its defaults and refused
    // another rule's group).
    const std::string kind = p.get<std::string>("kind");
    cfg_.rule = make_update_rule(kind, p.sub(kind));
    cfg_.weight_decay = p.get<double>("weight_decay");
    cfg_.clip = p.get<double>("clip");
    sched_.lr = p.get<double>("lr");
    sched_.warmup = p.get<int64_t>("warmup");
    sched_.kind = lr_decay(p.get<std::string>("schedule"));
    sched_.min_lr = p.get<double>("min_lr");
    cfg_.skip_nonfinite = p.get<bool>("skip_nonfinite");
    // The ZeRO plan (parallel/zero_plan.hpp), read from a zero node. Stage 1
    // (optimizer_shard.hpp): this rank's slice of the moments only (Adafactor: of whole
    // parameters), and its group to all-gather the updated parameters (a collective node: a
    // lane; parallel/collectives.hpp: MPI for CPU parameters, NCCL for CUDA ones). Stage 2: the
    // gradients arrive as this rank's pieces already, cut as the plan says by the allreduce of a
    // forward_backward that reads the same plan. One process runs the same path, owning every
    // element (nothing saved; its test).
    const ZeroPlan plan = ctx.connected("zero") ? ctx.state_as<ZeroPlan>("zero") : ZeroPlan{};
    shard_ = plan.shards_states();
    shard_grads_ = plan.shards_gradients();
    whole_tensors_ = plan.whole_tensors || !cfg_.rule->elementwise();
    if (shard_) {
      const std::string stage = ZeroPlan::name(plan.stage);
      const std::string plan_ref = ctx.refs("zero").front();
      if (parallel::mesh_of(ctx.run()).size(parallel::Dim::ep) > 1)
        throw std::runtime_error(ctx.who() + ": ZeRO stage " + stage + " (" + plan_ref + ") under expert parallel "
                                 "(run.parallel.ep) is not built yet (the experts would be sharded over the ranks holding "
                                 "the same experts); set the zero node's stage: none, or run.parallel.ep: 1");
      // Over the data-parallel ranks (the world while tp is 1): each tp rank shards its parts of
      // the split tensors over the replicas (the same parts), as Megatron's distributed optimizer.
      dp_ = parallel::replica_of(ctx.run());
      group_ = parallel::Group::along(ctx.name(), parallel::mesh_of(ctx.run()), parallel::Dim::dp, ctx.run().rank);
      const c10::Device device = run_device(ctx.run());
      if (!device.is_cuda() && !device.is_cpu())
        throw std::runtime_error(ctx.who() + ": ZeRO stage " + stage + " (" + plan_ref + ") on " + device.str() +
                                 ": the ranks exchange CPU parameters over MPI and CUDA ones over NCCL only; set its "
                                 "stage: none");
      if (dp_.count == 1 && ctx.run().rank == 0)
        spdlog::info("{}: ZeRO stage {} with one data-parallel rank: it owns every element, so no memory is saved (the "
                     "sharded path runs as with several)", ctx.who(), stage);
    }
    check_plan_wiring(ctx, plan);
    // On a GPU no step reads the grad norm on the host: non-finite steps are skipped on the
    // device and counted, and the count is read on logged steps (check_nonfinite). On the CPU
    // reading it costs nothing, so the step that diverged stops the run itself.
    cfg_.defer_nonfinite = !run_device(ctx.run()).is_cpu();
    note_memory(ctx);
    auto state = std::make_shared<OptimizerState>();
    const ModelState& model = ctx.state_as<ModelState>("model");
    // A model split over tp: its moments are split alike (a checkpoint writes each rank's parts,
    // placed in the whole tensors; a rule's own statistics as the rule says, summed over the tp
    // group: Adafactor's rows and columns),
    // and the gradient norm adds the split parameters' squares over the tp group.
    state->tp = model.tp;
    state->rule = cfg_.rule;
    state->expect(model.named_parameters(/*trainable_only=*/true), *cfg_.rule);
    if (model.tp) {
      tp_group_ = parallel::own_tp_group(ctx.name(), ctx.run());  // the norm's sum over the tp ranks
      ep_group_ = parallel::own_ep_group(ctx.name(), ctx.run());  // and the experts' over the ep ranks
      for (auto& [name, part] : state->parts) part.group = tp_group_.get();
      for (const auto& [name, t] : model.named_parameters(/*trainable_only=*/true)) {  // the norm's sums, per gradient
        const parallel::TpSplit s = model.tp->split(name);
        tp_split_.push_back(!model.tp->group_of(s) ? Split::none : s.experts ? Split::ep : Split::tp);
      }
    }
    if (model.stages) {
      // Pipeline parallel: this stage's parameters only; the norm sums the stages' squares over
      // the pp group, a tied parameter's copy (GPT's table on the last stage) left out.
      state->staged = true;
      pp_group_ = parallel::Group::along(ctx.name() + " pipeline", parallel::mesh_of(ctx.run()), parallel::Dim::pp,
                                         ctx.run().rank);
      const ModelState::Named named = model.named_parameters(/*trainable_only=*/true);
      if (!model.stages->first())
        for (size_t i = 0; i < named.size(); ++i)
          for (const auto& tied : model.stages->tied)
            if (named[i].first == tied) tied_copies_.push_back(i);
    }
    if (plan.shards_params()) shard_model(ctx, ctx.state_as<ModelState>("model"));
    // ZeRO: this rank's slots now, before a resume, so that it reads only its slices of the
    // moments (optimizer_load_from), never a replica's whole state.
    if (shard_) {
      const ModelState::Named named = shard_named(model);
      make_shard_slots(*state, shard_plan(model, named), named, cfg_);
    }
    ctx.own_state("state", state);
  }

  // ZeRO: the parameters the slots are made for, and the plan that cuts them (ZeRO-3's is the
  // model's own; stages 1 and 2 cut the flat layout the parameters are kept in, FlatParams').
  static ModelState::Named shard_named(const ModelState& model) {
    const auto* sharded = dynamic_cast<const ShardedParams*>(model.shards.get());
    return sharded ? sharded->shapes() : model.named_parameters(/*trainable_only=*/true);
  }
  ShardPlan shard_plan(const ModelState& model, const ModelState::Named& named) const {
    if (const auto* sharded = dynamic_cast<const ShardedParams*>(model.shards.get())) return sharded->plan();
    return ShardPlan::make(FlatLayout::of(model.trainable_parameters()), named, dp_.index, dp_.count, whole_tensors_);
  }

  // ZeRO stage params (train/fully_sharded.hpp): the model's parameters sharded over the
  // data-parallel ranks, the trainable ones as this node's slices are cut, the frozen ones (a
  // LoRA's base) alike; each rank keeping its slices.
  void shard_model(SetupContext& ctx, ModelState& model) {
    const std::string plan = ctx.refs("zero").front();
    const std::string stage = "ZeRO stage params (" + plan + ")";
    const ModelState::Named named = model.named_parameters(/*trainable_only=*/true);
    std::vector<torch::Tensor> tensors;
    for (const auto& [name, t] : named) tensors.push_back(t);
    try {
      model.shards = ShardedParams::make(
          model, ShardPlan::make(FlatLayout::of(tensors), named, dp_.index, dp_.count, whole_tensors_));
    } catch (const std::exception& e) {
      throw std::runtime_error(ctx.who() + ": " + e.what());
    }
    if (ctx.run().rank == 0) {
      const auto& s = static_cast<const ShardedParams&>(*model.shards);
      spdlog::info("{}: {}: each rank keeps 1/{} of the {:.2f} MB of parameters; {} units gathered around their use "
                   "(the largest {:.2f} MB)",
                   ctx.who(), stage, dp_.count, s.bytes() / 1e6, s.units(), s.largest_unit_bytes() / 1e6);
    }
  }

  // The plan's wiring. The forward_backward whose gradients this node updates from (through an
  // allreduce, or directly) must read the same plan as this node, or none if this node reads
  // none: under stage gradients it lets go of its gradients for the allreduce to cut. Stage
  // gradients also needs that allreduce (only it cuts the gradients into this rank's slices),
  // and a rule that needs whole parameters needs the plan to cut at them (the allreduce cuts
  // before this node could).
  void check_plan_wiring(SetupContext& ctx, const ZeroPlan& plan) const {
    const std::string plan_ref = ctx.connected("zero") ? ctx.refs("zero").front() : std::string();
    const std::string plan_node = plan_ref.substr(0, plan_ref.find('.'));
    const GraphSpec* g = ctx.run().graph;
    if (!g) return;  // a graph made by hand (tests)
    auto producer = [&](const NodeSpec& n, const std::string& port) -> const NodeSpec* {
      const InputSpec* in = n.input(port);
      if (!in || in->refs.empty()) return nullptr;
      const int at = g->index_of(in->refs.front().node);
      return at < 0 ? nullptr : &g->nodes[static_cast<size_t>(at)];
    };
    const int self = g->index_of(ctx.name());
    const NodeSpec* from = self < 0 ? nullptr : producer(g->nodes[static_cast<size_t>(self)], "grads");
    const NodeSpec* sync = from && from->type == "allreduce" ? from : nullptr;
    const NodeSpec* fb = sync ? producer(*sync, "ready") : from;
    if (fb && fb->type == "forward_backward") {
      const InputSpec* in = fb->input("zero");
      const std::string fb_ref = in && !in->refs.empty() ? in->refs.front().str() : std::string();
      if (fb_ref != plan_ref)
        throw std::runtime_error(ctx.who() + ": the forward_backward '" + fb->name + "' whose gradients this node "
                                 "updates from reads the ZeRO plan " + (fb_ref.empty() ? "of nobody" : "'" + fb_ref + "'") +
                                 " and this node " + (plan_ref.empty() ? "none" : "'" + plan_ref + "'") +
                                 ": both must read the same one (add zero: " + (plan_ref.empty() ? fb_ref : plan_ref) +
                                 " to the inputs of the one that lacks it)");
    }
    if (!plan.shards_gradients()) return;
    if (!plan.whole_tensors && !cfg_.rule->elementwise())
      throw std::runtime_error(ctx.who() + ": kind " + ctx.params().get<std::string>("kind") + " needs whole "
                               "parameters per rank (its moments are not element-wise), and ZeRO stage gradients "
                               "cuts them where the plan says: set " + plan_node + ".cut=tensors");
    if (!sync) {
      const std::vector<std::string> grads = ctx.refs("grads");
      throw std::runtime_error(ctx.who() + ": ZeRO stage gradients reduce-scatters the gradients in an allreduce node, "
                               "but 'grads' comes from '" + (grads.empty() ? std::string("nowhere") : grads.front()) +
                               "': wire grads: SYNC.grads from an allreduce fed by forward_backward's ready, or set " +
                               plan_node + ".stage=states");
    }
  }

  // For forward_backward's memory estimate (common/memory.hpp): the bytes of this rank's state,
  // made at the first update; sharded: about 1/world of them.
  void note_memory(SetupContext& ctx) {
    ModelState& model = ctx.state_as<ModelState>("model");
    double bytes = 0;
    for (const auto& t : model.trainable_parameters()) {
      const double n = static_cast<double>(t.nbytes());
      bytes += static_cast<double>(cfg_.rule->moments().size()) * n;  // shaped like the parameter
      for (const auto& [name, shape] : cfg_.rule->own_moments(t.sizes()))    // Adafactor's statistics
        bytes += static_cast<double>(c10::multiply_integers(shape)) * static_cast<double>(t.element_size());
    }
    const int world = parallel::replica_of(ctx.run()).count;  // ZeRO shards over the data-parallel ranks
    MemoryItem item{"optimizer state (" + ctx.params().get<std::string>("kind") + ")", ctx.name(), bytes, false, "", 0};
    if (shard_) {
      item.what += ", sharded";
      item.bytes = bytes / world;
      item.shards = world;
    } else if (world > 1) {
      // With a zero node wired in, its stage by an override; else the node to add.
      const std::vector<std::string> plan = ctx.connected("zero") ? ctx.refs("zero") : std::vector<std::string>{};
      item.fix = plan.empty() ? std::string("a zero node with stage: gradients (schemas/zero.yaml)")
                              : plan.front().substr(0, plan.front().find('.')) + ".stage=gradients";
      item.fixed = bytes / world;
      item.fix_shards_gradients = true;  // forward_backward adds the gradients it saves
    }
    model.kept.push_back(item);
  }

  void run(StepContext& ctx) override {
    const Grads& grads = ctx.in<Grads>("grads");
    ModelState& model = ctx.state_as<ModelState>("model");
    OptimizerState& st = ctx.state_as<OptimizerState>("state");
    const double lr = sched_.at(ctx.step(), ctx.run().last_step);
    // The writer of the parameters keeps them in flat buffers (models/model_state.hpp); once
    // they are, this only checks that they still are. (ZeRO-3: its slice is the buffer.)
    if (!model.shards) model.flat.ensure(model.trainable_parameters());
    torch::Tensor norm = shard_      ? sharded_update(ctx, model, st, grads, lr)
                         : pp_group_ ? optimizer_update(st, model.named_parameters(/*trainable_only=*/true), grads, cfg_,
                                                        lr, pp_norm(ctx, model, grads))
                         : model.tp  ? optimizer_update(st, model.named_parameters(/*trainable_only=*/true), grads, cfg_,
                                                        lr, tp_norm(ctx, model, grads, tp_split_, nullptr))
                                     : optimizer_update(st, model.named_parameters(/*trainable_only=*/true), grads, cfg_, lr);
    if (!logged_memory_) log_memory(ctx, model, st, grads);
    const int64_t step = ctx.step();
    if (!cfg_.defer_nonfinite) {
      if (cfg_.skip_nonfinite && !std::isfinite(norm.item<double>()))
        spdlog::warn("{}: step {}: gradients not finite, update skipped ({} skipped so far)", ctx.who(), step,
                     nonfinite_count(st));
    } else if (step % ctx.run().log_every == 0 || step == ctx.run().last_step) {
      check_nonfinite(ctx, st, step);
    }
    ctx.out("lr", lr);
    ctx.out("grad_norm", norm);
  }

 private:
  // defer_nonfinite: what the device counted since the last check, told (skip_nonfinite) or
  // stopping the run (the updates were skipped on the device, so the parameters are those of
  // the last finite step).
  void check_nonfinite(StepContext& ctx, const OptimizerState& st, int64_t step) {
    const int64_t count = nonfinite_count(st);
    const int64_t since = checked_ >= 0 ? checked_ + 1 : ctx.run().first_step;
    checked_ = step;
    if (count == reported_) return;
    const std::string when = since == step ? "at step " + std::to_string(step)
                                           : "between step " + std::to_string(since) + " and step " + std::to_string(step);
    const int64_t fresh = count - reported_;
    reported_ = count;
    if (!cfg_.skip_nonfinite)
      throw NonFiniteGrads("the gradients were not finite in " + std::to_string(fresh) + " step(s) " + when +
                           " (those updates were skipped on the device): the loss diverged or overflowed; lower the "
                           "lr, add clip, or set skip_nonfinite: true");
    spdlog::warn("{}: {} step(s) with non-finite gradients {}, their updates skipped ({} skipped so far)", ctx.who(),
                 fresh, when, count);
  }

  // Under tp or ep: the norm of the whole model's gradients from this rank's `grads` (`split[i]`:
  // tp, the part of a parameter split over tp, the squares summed over the tp group; ep, an
  // expert's, summed over the ep group; none, a replicated one's (norms, the row-split layers'
  // biases, the router), the same on every rank and counted once). `dp`: the gradients are ZeRO's
  // pieces over the data-parallel ranks, the sums first summed over it.
  torch::Tensor tp_norm(StepContext& ctx, const ModelState& model, const Grads& grads, const std::vector<Split>& split,
                        parallel::Group* dp) const {
    Grads by[3];
    for (size_t i = 0; i < split.size() && i < grads.size(); ++i) by[static_cast<int>(split[i])].push_back(grads[i]);
    const c10::Device device = model_device(model);
    const std::string step = " of step " + std::to_string(ctx.step());
    torch::Tensor all = torch::cat({squares(by[0], device), squares(by[1], device), squares(by[2], device)});
    if (dp) dp->all_reduce(all, comm::Op::sum, "gradient norm" + step).wait();
    torch::Tensor rest = all.narrow(0, 0, 1), tp = all.narrow(0, 1, 1).contiguous(), ep = all.narrow(0, 2, 1).contiguous();
    if (tp_group_) tp_group_->all_reduce(tp, comm::Op::sum, "tensor-parallel gradient norm" + step).wait();
    if (ep_group_) ep_group_->all_reduce(ep, comm::Op::sum, "expert-parallel gradient norm" + step).wait();
    return (rest + tp + ep).sqrt().reshape({}).to(torch::kFloat);
  }

  // Pipeline parallel: the whole model's gradient norm from this stage's gradients: its squares
  // (under tp, the stage's whole norm first) summed over the pp group, a tied copy counted on the
  // first stage only.
  torch::Tensor pp_norm(StepContext& ctx, const ModelState& model, const Grads& grads) const {
    const Grads counted = counted_once(grads);
    return over_stages(ctx, model, model.tp ? tp_norm(ctx, model, counted, tp_split_, nullptr) : global_norm(counted));
  }
  // The gradients (one per trainable parameter) without the tied copies: each counted once.
  Grads counted_once(const Grads& grads) const {
    Grads out = grads;
    for (size_t i : tied_copies_)
      if (i < out.size()) out[i] = torch::Tensor();
    return out;
  }
  // The whole model's norm from each stage's `norm`: the squares summed over the pp group.
  torch::Tensor over_stages(StepContext& ctx, const ModelState& model, const torch::Tensor& norm) const {
    const c10::Device device = model_device(model);
    torch::Tensor sq = norm.to(device, device.is_cpu() ? torch::kDouble : torch::kFloat).square().reshape({1}).contiguous();
    pp_group_->all_reduce(sq, comm::Op::sum, "pipeline gradient norm of step " + std::to_string(ctx.step())).wait();
    return sq.sqrt().reshape({}).to(torch::kFloat);
  }

  // ZeRO-1 and 2: this rank's pieces updated with the norm of all the grads (the same on every
  // rank), then every rank's updated slice all-gathered into every rank's parameters.
  // ZeRO-3: the model's parameters are sharded already (shard_model); this rank's pieces are views
  // of its slice, and nothing is gathered after the update (the next use gathers what it runs).
  torch::Tensor sharded_update(StepContext& ctx, ModelState& model, OptimizerState& st, const Grads& grads, double lr) {
    auto* sharded = dynamic_cast<ShardedParams*>(model.shards.get());
    const ModelState::Named named = shard_named(model);
    const std::vector<torch::Tensor>* buffers = sharded ? &sharded->slices() : model.flat.buffers_of(model.trainable_parameters());
    if (!buffers) throw std::logic_error(ctx.who() + ": the parameters are not in flat buffers");
    const FlatLayout& layout = sharded ? sharded->plan().layout : model.flat.layout();
    if (st.slots.empty())  // made at setup; again after a load of whole tensors (a version 1 checkpoint)
      make_shard_slots(st, shard_plan(model, named), named, cfg_);
    else if (!(st.shard.layout == layout))  // the moments would start again from zero
      throw std::logic_error(ctx.who() + ": the model's trainable parameters changed (dtype, device or count) after "
                                         "this node cut its ZeRO slices at setup");
    const ShardPieces pieces = sharded ? slice_pieces(st.shard, *buffers, grads) : shard_pieces(st.shard, named, grads);
    const std::string step = " of step " + std::to_string(ctx.step());
    // The last step's all-gather ended (long since, normally): a host check bounded by
    // run.comm_timeout_s, so a dead rank ends the run instead of hanging it (a CPU one was waited
    // for already).
    for (parallel::Work& w : gathering_) w.check();
    gathering_.clear();
    torch::Tensor norm;
    // Pipeline parallel: a tied copy's pieces left out of the norm (the first stage counts it).
    Grads counted = pieces.grads;
    for (size_t i = 0; i < st.shard.pieces.size() && i < counted.size(); ++i)
      for (size_t t : tied_copies_)
        if (static_cast<size_t>(st.shard.pieces[i].param) == t) counted[i] = torch::Tensor();
    if (shard_grads_ && model.tp) {  // this rank's pieces of its tp parts
      std::vector<Split> split;
      for (const ShardPlan::Piece& piece : st.shard.pieces) split.push_back(tp_split_[static_cast<size_t>(piece.param)]);
      norm = tp_norm(ctx, model, counted, split, group_.get());
    } else if (shard_grads_) {
      // Each rank holds its pieces only: the global norm from the sum of the ranks' squares,
      // summed where the gradients are (on a GPU no step waits for the host; on the CPU in double).
      norm = squares_over(counted, buffers->front().device(), *group_, "gradient norm" + step).sqrt().reshape({}).to(torch::kFloat);
    } else {
      const Grads whole = counted_once(grads);
      norm = model.tp ? tp_norm(ctx, model, whole, tp_split_, nullptr) : global_norm(whole);
    }
    if (pp_group_) norm = over_stages(ctx, model, norm);
    norm = optimizer_update(st, pieces.params, pieces.grads, cfg_, lr, norm);
    if (sharded) return norm;
    // Every rank's updated slice into every rank's parameters; on a GPU the next forward queues
    // behind the all-gather, the host does not wait.
    gathering_ = allgather_slices(st.shard, *buffers, *group_, "all-gather of the parameters" + step);
    for (parallel::Work& w : gathering_) w.wait();
    return norm;
  }


  // Once, after the first update: what this rank holds (what a memory budget needs).
  void log_memory(StepContext& ctx, ModelState& model, const OptimizerState& st, const Grads& grads) {
    logged_memory_ = true;
    if (ctx.run().rank != 0) return;
    auto bytes = [](const std::vector<torch::Tensor>& ts) {
      double b = 0;
      for (const auto& t : ts)
        if (t.defined()) b += static_cast<double>(t.numel()) * static_cast<double>(t.element_size());
      return b;
    };
    double moments = 0;
    for (const auto& f : st.flat) moments += bytes(f);
    const size_t flat = st.flat.size();
    for (const auto& s : st.slots) moments += bytes(std::vector<torch::Tensor>(s.m.begin() + static_cast<long>(flat), s.m.end()));
    const double params = bytes(model.shards ? model.shards->slices() : model.trainable_parameters());
    spdlog::info("{}: per rank: parameters {:.2f} MB, gradients {:.2f} MB, optimizer state {:.2f} MB{}", ctx.who(),
                 params / 1e6, bytes(grads) / 1e6, moments / 1e6,
                 shard_ ? fmt::format(" (ZeRO stage {}, this rank's 1/{} slice)",
                                      model.shards ? "params" : shard_grads_ ? "gradients" : "states", dp_.count)
                        : std::string());
  }

  OptimConfig cfg_;
  LrSchedule sched_;
  bool shard_ = false;        // ZeRO stage states or gradients
  bool shard_grads_ = false;  // ZeRO stage gradients
  bool whole_tensors_ = false;  // slices cut at parameter starts (the plan's cut: tensors, or the rule needs it)
  parallel::Replica dp_;                    // sharded: this rank's data-parallel coordinate and their count
  std::shared_ptr<parallel::Group> group_;  // sharded: the data-parallel ranks the slices are exchanged with
  std::vector<parallel::Work> gathering_;   // the last step's all-gather (checked the next step)
  std::shared_ptr<parallel::Group> tp_group_;  // a tp model: this node's group over its tp ranks
  std::shared_ptr<parallel::Group> ep_group_;  // a model with experts over ep: this node's group over its ep ranks
  std::vector<Split> tp_split_;                // a split model: per trainable parameter, over what (none: replicated)
  std::shared_ptr<parallel::Group> pp_group_;  // pipeline parallel: this node's group over its pp ranks (the norm)
  std::vector<size_t> tied_copies_;            // pipeline parallel: the trainable parameters held as another stage's copy
  bool logged_memory_ = false;
  int64_t reported_ = 0;  // defer_nonfinite: skipped updates told so far
  int64_t checked_ = -1;  // the step of the last check (-1: none yet)
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(optimizer, flowrun::OptimizerNode)
// Per-rank checkpoints (common/state_io.hpp's pieces): what this rank holds of each tensor of
// tensors(), placed in the whole: its ZeRO pieces of the parameters' moments (ranges of their
// row-major elements; the rule's own moments whole with their parameter's owner), under tp its
// parts, each parameter's step and the update count (the same wherever held: the checkpoint
// writes them once).
namespace {

flowrun::parallel::Placement optimizer_placement(const flowrun::OptimizerState& st, const std::string& name) {
  if (!st.tp) return {};
  const flowrun::parallel::TpSplit s = st.split_of(name);
  const flowrun::parallel::Group* g = st.tp->group_of(s);
  if (!g) return {};
  return {s, g->rank(), g->size()};
}

std::vector<flowrun::TensorPiece> optimizer_pieces(const flowrun::OptimizerState& st) {
  using flowrun::parallel::add_pieces;
  std::vector<flowrun::TensorPiece> out;
  if (!st.shard.sharded() || st.slots.empty()) {
    for (const auto& [name, t] : st.tensors()) add_pieces(out, name, t, optimizer_placement(st, name));
    return out;
  }
  const flowrun::ShardPlan& plan = st.shard;
  const size_t flat = st.rule->moments().size();
  const int64_t fused = st.fused_step.defined() ? static_cast<int64_t>(st.fused_step.item<double>()) : -1;
  for (size_t k = 0; k < plan.pieces.size(); ++k) {
    const flowrun::ShardPlan::Piece& piece = plan.pieces[k];
    const flowrun::OptimizerState::Slot& slot = st.slots[k];
    const std::vector<int64_t>& shape = plan.shapes[static_cast<size_t>(piece.param)];
    for (size_t j = 0; j < slot.m.size(); ++j) {
      if (!slot.m[j].defined()) continue;
      const std::string name = slot.name + "." + slot.names[j];
      if (j < flat)
        flowrun::parallel::add_range_pieces(out, name, slot.m[j].reshape({-1}), shape, piece.offset,
                                            optimizer_placement(st, name));
      else
        add_pieces(out, name, slot.m[j], optimizer_placement(st, name));
    }
    add_pieces(out, slot.name + ".step", torch::tensor(fused >= 0 ? fused : slot.step, torch::kInt64), {});
  }
  add_pieces(out, "updates", torch::tensor(st.updates, torch::kInt64), {});
  return out;
}

// ZeRO (the slots made at setup): this rank's slices of the moments read into its slots, the
// boxes optimizer_pieces writes, and nothing else; each parameter's step and the update count.
// Checked as load() checks: every tensor expect() lists there, at the whole shape of this rank's,
// nothing else (but another stage's), finite.
void load_sharded(flowrun::OptimizerState& st, const flowrun::StateSource& src) {
  const std::string hint = " in " + src.where() + "; the checkpoint was written for another model or optimizer, or is "
                           "damaged: resume from another checkpoint";
  for (const auto& [name, shape] : st.expected) {
    if (!src.has(name)) throw std::runtime_error("optimizer state: tensor '" + name + "' is missing" + hint);
    std::vector<flowrun::TensorPiece> whole;  // this rank's tensor placed in the whole (no data: meta)
    flowrun::parallel::add_pieces(whole, name, torch::empty(shape, torch::TensorOptions().device(torch::kMeta)),
                                  optimizer_placement(st, name));
    const std::vector<int64_t> saved = src.shape(name);
    if (!whole.empty() && whole.front().whole != saved)
      throw std::runtime_error("optimizer state: tensor '" + name + "' has shape " + c10::str(c10::IntArrayRef(saved)) +
                               ", expected " + c10::str(c10::IntArrayRef(whole.front().whole)) + hint);
  }
  if (!st.staged)
    for (const auto& name : src.names())
      if (!st.expected.count(name)) throw std::runtime_error("optimizer state: unexpected tensor '" + name + "'" + hint);
  torch::NoGradGuard no_grad;
  for (flowrun::TensorPiece& p : optimizer_pieces(st))
    if (p.name != "updates" && flowrun::moment_parameter(p.name) + ".step" != p.name) src.read(p.name, p.offsets, p.data);
  for (flowrun::OptimizerState::Slot& s : st.slots) {
    for (size_t j = 0; j < s.m.size(); ++j)
      if (s.m[j].defined() && !flowrun::all_finite(s.m[j]))
        throw std::runtime_error("optimizer state: tensor '" + s.name + "." + s.names[j] + "' holds NaN or infinite values" + hint);
    s.step = src.whole(s.name + ".step").item<int64_t>();
  }
  st.updates = src.whole("updates").item<int64_t>();
  st.fused_step = torch::Tensor();  // the loaded steps rule
  st.pending.clear();
}

// This rank's tensors of the state (its stage's, its tp parts: what expect() lists), each read from
// its boxes of the saved ones, then load() as a whole state (its checks). ZeRO: its slices only
// (load_sharded). Without expect()'s list: every tensor whole, cut into this rank's parts.
void optimizer_load_from(flowrun::OptimizerState& st, const flowrun::StateSource& src) {
  if (st.shard.sharded() && !st.slots.empty() && !st.expected.empty()) return load_sharded(st, src);
  flowrun::NamedTensors t;
  if (st.expected.empty()) {
    for (const auto& name : src.names()) t[name] = src.whole(name);
    st.load(st.tp ? st.tp->parts_by(t, [&](const std::string& n) { return st.split_of(n); }, src.where()) : t);
    return;
  }
  for (const auto& [name, shape] : st.expected) {
    if (!src.has(name)) continue;  // load() names it missing
    torch::Tensor local = torch::empty(shape, torch::TensorOptions().dtype(src.dtype(name)));
    std::vector<flowrun::TensorPiece> pieces;
    flowrun::parallel::add_pieces(pieces, name, local, optimizer_placement(st, name));
    if (!pieces.empty() && pieces.front().whole != src.shape(name)) {  // load() refuses it, naming both shapes
      t[name] = src.whole(name);
      continue;
    }
    for (auto& p : pieces) src.read(name, p.offsets, p.data);
    t[name] = local;
  }
  if (!st.staged)  // a tensor this state does not list: load() refuses it by name
    for (const auto& name : src.names())
      if (!st.expected.count(name)) t[name] = src.whole(name);
  st.load(t);
}

}  // namespace

// Saved and restored by checkpoint/resume through pieces and load_from (above): each rank its
// own, nothing gathered. collect (gathering the state whole on rank 0) runs only for a checkpoint
// with exports: true, which calls it on every state it saves.
static const bool kOptimizerStateIO = [] {
  using flowrun::OptimizerState;
  flowrun::register_state_io(
      std::type_index(typeid(std::shared_ptr<OptimizerState>)),
      flowrun::StateIO{
          [](const flowrun::Value& v) {
            const auto& st = v.as<std::shared_ptr<OptimizerState>>();
            if (st->shard.sharded() && !st->slots.empty() && st->gathered.empty()) {
              // ZeRO, for the start-up check: the names and shapes every rank expects (meta tensors;
              // the dtype is not part of what the ranks compare here), each rank holding its slices
              // (partitioned, below: nothing broadcast).
              flowrun::NamedTensors out;
              for (const auto& [name, shape] : st->expected)
                out[name] = torch::empty(shape, torch::TensorOptions().device(torch::kMeta));
              return out;
            }
            return (st->tp || st->staged) && !st->gathered.empty() ? st->gathered : flowrun::NamedTensors(st->tensors());
          },
          [](flowrun::Value& v, const flowrun::NamedTensors& given) {
            auto& st = v.as_mut<std::shared_ptr<OptimizerState>>();
            flowrun::NamedTensors t = given;
            if (st->staged) {  // this stage's moments (and the state's own counters) out of every stage's
              t.clear();
              for (const auto& [name, tensor] : given)
                if (st->expected.count(name) || name.find('.') == std::string::npos) t.emplace(name, tensor);
            }
            st->load(st->tp ? st->tp->parts_by(t, [&](const std::string& n) { return st->split_of(n); }) : t);
          },
          [](flowrun::Value& v, const flowrun::StateIO::Groups& groups) {
            auto& st = v.as_mut<std::shared_ptr<OptimizerState>>();
            // ZeRO's slices over the data-parallel ranks (under tp: each rank's moments of its parts),
            flowrun::collect_sharded_state(*st, groups.dp);
            if (!st->tp && !st->staged) return;
            // then a tp model's moments whole: every rank gathers, the writer (rank 0) keeps them;
            // under pipeline parallel the stages' gathered on the writer's (its replica's, tp rank 0's).
            flowrun::NamedTensors whole =
                st->tp ? st->tp->wholes_by(st->tensors(), groups.tp, [&](const std::string& n) { return st->split_of(n); },
                                           groups.ep)
                       : flowrun::NamedTensors(st->tensors());
            st->gathered.clear();
            if (st->staged && groups.pp) {
              if (groups.dp.rank() != 0 || (st->tp && st->tp->group && st->tp->group->rank() != 0)) return;
              whole = flowrun::parallel::gather_on_first(*groups.pp, whole, "optimizer state for a checkpoint");
            }
            if (groups.writer) st->gathered = std::move(whole);
          },
          [](flowrun::Value& v) { v.as_mut<std::shared_ptr<OptimizerState>>()->gathered.clear(); },
          [](const flowrun::Value& v) {
            const auto& st = v.as<std::shared_ptr<OptimizerState>>();
            return st->tp != nullptr || st->staged || st->shard.sharded();
          },
          [](const flowrun::Value& v) { return optimizer_pieces(*v.as<std::shared_ptr<OptimizerState>>()); },
          [](flowrun::Value& v, const flowrun::StateSource& src) {
            optimizer_load_from(*v.as_mut<std::shared_ptr<OptimizerState>>(), src);
          }});
  return true;
}();
