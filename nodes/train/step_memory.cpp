// forward_backward's memory model: see step_memory.hpp.
#include "train/step_memory.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <tuple>

#include "common/device.hpp"
#include "common/memory.hpp"
#include "parallel/cost_model.hpp"
#include "parallel/layout.hpp"
#include "parallel/zero_plan.hpp"
#include "spec.hpp"
#include "train/forward_backward.hpp"
#include "train/fully_sharded.hpp"
#include "train/pipeline.hpp"

namespace flowrun {

namespace {

// Layouts that divide the model over more processes (docs/parallel.md), each with the total a
// rank would hold then, against what this rank could use (what is free and what it holds).
//  - more tp (a family that splits): the split share of the weights, gradients and what other
//    nodes keep per parameter divided further, and about 24 of a block's 34 activation units
//    a token (Korthikanti et al.: parallel::cost::activations_held; the norms and the residual stay whole);
//  - ZeRO stage params: as check_step_memory counts a sharded step,
//    at this dp, or with 2, 4 or 8 times the processes when there is one replica.
// tp only as far as the model's heads, MLP widths and vocabulary divide (parallel::tp_divides,
// flowrun plan's rule). The smallest that fits is named, else the largest tried. On the CPU the processes share
// this machine's memory: a layout fits when all of them do.
void layout_options(const StepMemorySetup& setup, const ModelState& model, const TrainingMemory& m, double available,
                    std::vector<std::string>& fixes) {
  const double usable = available + m.total() - m.to_allocate();
  const bool shared = model_device(model).is_cpu();
  const double acts = std::max(m.activations, 0.0);
  // What other nodes keep (the optimizer's moments, an EMA): as held now, and unsharded.
  double kept = 0, kept_whole = 0;
  for (const auto& k : m.kept) {
    kept += k.bytes;
    kept_whole += k.bytes * k.shards;
  }
  double all = 0, split = 0, trainable = 0;  // the parameters' bytes (a ZeRO-3 model's whole)
  for (const auto& [name, t] : model.named_parameters()) {
    const double b = static_cast<double>(t.numel()) * static_cast<double>(t.element_size());
    all += b;
    if (model.splits_over_tp && model.splits_over_tp(name)) split += b;
    if (t.requires_grad()) trainable += b;
  }
  const int world = setup.world;
  // (setting, processes, total a rank)
  auto offer = [&](const std::vector<std::tuple<std::string, int, double>>& tries) {
    for (size_t i = 0; i < tries.size(); ++i) {
      const auto& [setting, processes, total] = tries[i];
      const bool fits = available > 0 && (shared ? total * processes <= usable * world : total <= usable);
      if (!fits && i + 1 < tries.size() && available > 0) continue;
      fixes.push_back(setting + " (" + bytes_text(total) + " a rank" +
                      (available <= 0 ? ")" : fits ? ": fits)" : ": not enough alone)"));
      return;
    }
  };
  const int tp = model.tp && model.tp->group ? model.tp->group->size() : 1;
  // Only a tp the model can take (its heads, MLP widths and vocabulary divide): flowrun plan's rule.
  const int at = setup.graph ? setup.graph->index_of(setup.model_node) : -1;
  const std::vector<int64_t> sizes =
      at < 0 ? std::vector<int64_t>{} : parallel::tp_split_sizes(setup.graph->nodes[static_cast<size_t>(at)]);
  if (model.splits_over_tp && all > 0) {
    const double share = split / all;
    std::vector<std::tuple<std::string, int, double>> tries;
    for (int t = 2 * tp; t <= 8 * tp && parallel::tp_divides(sizes, t); t *= 2) {
      const double cut = 1.0 - static_cast<double>(tp) / t;
      const int processes = world * t / tp;
      tries.emplace_back("run.parallel.tp=" + std::to_string(t) + " with " + std::to_string(processes) + " processes",
                         processes,
                         m.total() - share * (m.weights + m.gradients + kept) * cut -
                             acts * (1.0 - parallel::cost::activations_held(t) / parallel::cost::activations_held(tp)));
    }
    offer(tries);
  }
  if (!(setup.zero && setup.zero->shards_params())) {
    const std::vector<std::string>& plan = setup.zero_refs;
    const std::string stage = plan.empty() ? std::string("a zero node with stage: params (schemas/zero.yaml)")
                                           : plan.front().substr(0, plan.front().find('.')) + ".stage=params";
    const double gathered = zero3_gathered_bytes(*model.module, model.checkpoint);  // the cost model's rule
    auto total = [&](int n) { return all / n + gathered + trainable * (1.0 + 1.0 / n) + kept_whole / n + acts; };
    std::vector<std::tuple<std::string, int, double>> tries;
    if (setup.dp.count > 1) tries.emplace_back(stage, world, total(setup.dp.count));
    else
      for (int n = 2; n <= 8; n *= 2)
        tries.emplace_back(stage + " with " + std::to_string(world * n) + " processes", world * n, total(n));
    offer(tries);
  }
}

}  // namespace

StepMemoryCheck check_step_memory(const StepMemorySetup& setup, const ModelState& model, const TensorMap& batch,
                                  StepProfile* profile) {
  StepMemoryCheck out;
  TrainingMemory m;
  for (const auto& [name, t] : model.named_parameters()) {
    m.weights += static_cast<double>(t.nbytes());
    if (t.requires_grad()) m.gradients += static_cast<double>(t.nbytes());
  }
  if (const auto* s = dynamic_cast<const ShardedParams*>(model.shards.get())) {
    // ZeRO-3: this rank's slices (a LoRA's base too), and what a step gathers (the cost model's
    // rule: zero3_gathered_bytes). The gradients (the trainable parameters', counted above) as
    // the stage counts them below.
    m.weights = s->bytes() / setup.dp.count + zero3_gathered_bytes(*model.module, model.checkpoint);
  }
  // Copies of the gradients (run() below): autograd's own (grad_layout fresh), and with several
  // processes or grad_layout buffer the buffers of take_buffer()'s pool (two while a step's grads
  // are still held as the next backward runs).
  // ZeRO stage 2 (the zero plan's stage gradients): autograd's, each freed once its bucket is
  // sent, and this rank's 1/world of the averaged ones.
  const int world = setup.dp.count;  // what ZeRO shards over
  const double grads = m.gradients;
  const bool buffers = world > 1 || !setup.fresh;
  const int copies = (setup.fresh ? 1 : 0) + (buffers ? static_cast<int>(setup.grad_buffers) : 0);
  if (setup.zero && setup.zero->shards_gradients()) {
    m.gradients = grads * (1.0 + 1.0 / world);
    m.gradients_note = "autograd's, freed bucket by bucket, + this rank's 1/" + std::to_string(world) +
                       " (ZeRO stage gradients)";
  } else {
    if (copies > 1)
      m.gradients_note = std::to_string(copies) + " copies: " + (setup.fresh ? "autograd's + " : "") +
                         std::to_string(setup.grad_buffers) + " gradient buffers";
    m.gradients = grads * copies;
  }
  m.kept = model.kept;
  const int64_t bytes = setup.precision == Precision::bf16 ? 2 : 4;
  const int64_t rows = batch_rows(batch);
  const int64_t micro_rows = (rows + setup.accumulate - 1) / setup.accumulate;
  double with_blocks = -1;
  if (model.activations && rows > 0) {
    try {
      const TensorMap micro = setup.accumulate > 1 ? split_batch(batch, setup.accumulate).front() : batch;
      m.activations = model.activations(micro, bytes, model.checkpoint).checkpointed;
      const ActivationEstimate blocks_recomputed = model.activations(micro, bytes, CheckpointPolicy::parse("blocks"));
      with_blocks = blocks_recomputed.checkpointed;
      if (profile)  // flowrun plan's profile: forward_backward's own state
        *profile = {batch_rows(micro), model.activations(micro, bytes, CheckpointPolicy{}), blocks_recomputed};
      m.activations_note = std::to_string(micro_rows) + " rows, " + (bytes == 2 ? "bf16" : "fp32") +
                           ", checkpoint: " + model.checkpoint.str();
      if (setup.pipeline) {
        // A stage keeps, of the whole batch's activations (M micro-batches through every block),
        // those of the (block, micro-batch) pairs its program holds at once at most: each F
        // holds its chunk's blocks for one micro-batch until its B.
        const parallel::pipeline::Schedule& s = setup.pipeline->schedule;
        const Stages& cut = *model.stages;
        auto size = [&](int chunk) { return cut.blocks[static_cast<size_t>(chunk)].second - cut.blocks[static_cast<size_t>(chunk)].first; };
        const int peak = s.peak_blocks_held(setup.pipeline->stage, cut.blocks);
        int blocks = 0, all = 0;
        for (int k = 0; k < cut.chunks(); ++k) {
          all += size(k);
          if (cut.holds(k)) blocks += size(k);
        }
        const double share = all > 0 ? static_cast<double>(peak) / (static_cast<double>(all) * s.config.microbatches) : 1.0;
        m.activations *= share;
        with_blocks *= share;
        m.activations_note += ", this stage's " + std::to_string(blocks) + " of " + std::to_string(all) +
                              " blocks, at most " + std::to_string(peak) + " block x micro-batch activations held of " +
                              std::to_string(all * s.config.microbatches);
      }
    } catch (const std::exception& e) {
      spdlog::debug("{}: no activation estimate: {}", setup.who, e.what());
    }
  }
  // On a GPU part of what is free goes to the caching allocator's fragmentation: GPT-2 350M at
  // batch 128 on an H200 ran out with 8.5 GiB reserved but unallocated, 5 % of the card, and
  // 2 % more than this estimate (docs/distributed.md's table), so 8 % is left to it.
  const c10::Device device = model_device(model);
  const double available = device.is_cpu() ? static_cast<double>(available_host_memory())
                                           : 0.92 * available_device_memory(device);
  const std::string on = device.is_cpu() ? "" : " on " + device.str();
  if (setup.rank == 0)
    spdlog::info("{}: memory per rank (estimate): {}; {}", setup.who, m.text(),
                 available > 0 ? bytes_text(available) + (device.is_cpu() ? " available" : " usable") + " now" + on +
                                     ", " + bytes_text(m.to_allocate()) + " of it still to allocate"
                               : "what " + (device.is_cpu() ? std::string("the machine") : device.str()) +
                                     " has is not known, so not checked");
  // What would make it fit: each setting alone, with the total it gives (also named when a
  // step runs out of memory after all: run() below).
  std::vector<std::string> fixes;
  auto option = [&](const std::string& setting, double saved) {
    const double left = m.to_allocate() - saved;
    fixes.push_back(setting + " (" + bytes_text(left) +
                    (available <= 0 ? ")" : left <= available ? ": fits)" : ": not enough alone)"));
  };
  if (m.activations >= 0 && with_blocks >= 0 && model.checkpoint.every != 1 && with_blocks < m.activations)
    option(setup.model_node + ".checkpoint=blocks", m.activations - with_blocks);
  for (const auto& k : m.kept)
    if (!k.fix.empty() && !k.allocated)
      option(k.fix, k.bytes - k.fixed + (k.fix_shards_gradients ? m.gradients - grads * (1.0 + 1.0 / world) : 0.0));
  if (m.activations > 0 && micro_rows > 1)
    option(setup.node + ".accumulate=" + std::to_string(setup.accumulate * 2), m.activations / 2);
  layout_options(setup, model, m, available, fixes);
  std::string listed;
  for (size_t i = 0; i < fixes.size(); ++i) listed += (i ? "; " : "") + fixes[i];
  if (listed.empty()) listed = "none found here; make the model or the batch smaller";
  out.advice = "the estimate before the first step: " + m.text() + ". Settings that reduce it (still to "
                   "allocate then): " + listed;
  if (available <= 0 || m.to_allocate() <= available) return out;
  out.over = fmt::format(
      "{}: the step needs about {} more memory than the {} available{}: {}. Settings that reduce it (still to "
      "allocate then): {}",
      setup.who, bytes_text(m.to_allocate() - available), bytes_text(available), on, m.text(), listed);
  return out;
}

}  // namespace flowrun
