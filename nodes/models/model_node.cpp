// The model nodes' base: ModelNode::setup, the sequence model_node.hpp describes.
#include "models/model_node.hpp"

#include <spdlog/spdlog.h>

#include <filesystem>

#include "common/device.hpp"
#include "common/memory.hpp"
#include "common/pretrained.hpp"
#include "formats/files.hpp"
#include "models/lora.hpp"
#include "parallel/mesh.hpp"
#include "parallel/pipeline_schedule.hpp"
#include "parallel/tensor_parallel.hpp"
#include "spec.hpp"

namespace flowrun {

namespace {

// The node's `lora` group, when set: every parameter frozen, adapters on the targeted layers.
// Returns ", LoRA r=R on N layers" ("" when unset) and the adapted layers' names.
std::string apply_lora_param(SetupContext& ctx, torch::nn::Module& module, uint64_t seed,
                             std::vector<std::string>& adapted) {
  const Params& p = ctx.params();
  if (!p.has("lora")) return "";
  if (ctx.run().graph && ctx.run().graph->settings.parallel.pp > 1)
    throw std::runtime_error(ctx.who() + ": lora with pipeline parallel (run.parallel.pp) is not built yet (each stage "
                             "would draw its adapters' init from the start of the seed's draws, and the PEFT export "
                             "reads every stage's adapters); set run.parallel.pp=1");
  const Params l = p.sub("lora");
  lora::Config lc;
  lc.rank = l.get<int64_t>("rank");
  lc.alpha = l.get<double>("alpha");
  lc.dropout = l.get<double>("dropout");
  lc.targets = l.get<std::vector<std::string>>("targets");
  try {
    adapted = lora::apply_lora(module, lc, seed);
  } catch (const std::exception& e) {
    throw std::runtime_error(ctx.who() + ": " + e.what());
  }
  return ", LoRA r=" + std::to_string(lc.rank) + " on " + std::to_string(adapted.size()) + " layers";
}

// The `weights` file, through a checkpoint's `latest` (a graph can name "the newest base
// checkpoint"); a missing one is refused saying what it should be.
std::string weights_path(SetupContext& ctx, const std::string& weights_are) {
  const std::string path = resolve_latest(ctx.params().get<std::string>("weights"));
  const std::filesystem::path folder = std::filesystem::path(path).parent_path();
  if (!std::filesystem::is_regular_file(path) && std::filesystem::is_regular_file(folder / "manifest.json"))
    throw std::runtime_error(ctx.who() + ": weights: " + path + " does not exist: " + folder.string() +
                             " is a checkpoint that several ranks wrote, each its own pieces of every state; make the "
                             "file with `flowrun ckpt consolidate " + folder.string() + " FILE.safetensors --state " +
                             std::filesystem::path(path).stem().string() + "` and set " + ctx.name() + ".weights=FILE");
  if (!std::filesystem::is_regular_file(path))
    throw std::runtime_error(ctx.who() + ": weights: " + path + " does not exist (it should be " + weights_are +
                             "); set " + ctx.name() + ".weights=PATH, or null to start from the seeded init");
  return path;
}

// The node's `adapters` folder (PEFT's, through a checkpoint's `latest`), when set: loaded into
// the model, its adapters made from adapter_config.json when the model has none yet.
std::string load_adapters_param(SetupContext& ctx, ModelState& state, uint64_t seed) {
  const Params& p = ctx.params();
  if (!p.has("adapters")) return "";
  if (ctx.run().graph && ctx.run().graph->settings.parallel.pp > 1)
    throw std::runtime_error(ctx.who() + ": adapters with pipeline parallel (run.parallel.pp) are not built yet; set "
                             "run.parallel.pp=1");
  const std::string dir = resolve_latest(p.get<std::string>("adapters"));
  try {
    lora::load_peft(state, dir, seed);
  } catch (const std::exception& e) {
    throw std::runtime_error(ctx.who() + ": adapters: " + e.what());
  }
  return "; adapters from " + dir;
}

// Step 8: the parameter count (and the trainable count when some are frozen) logged with `what`
// and `from` on rank 0; the module moved to the run's device; its adapters exportable when it is
// built from lora::Linear layers (checkpoint `exports: true` writes them in PEFT's layout); the
// state owned as the node's `params` output.
void own_model(SetupContext& ctx, std::shared_ptr<ModelState> state, const std::string& what, const std::string& from) {
  int64_t n = 0, trainable = 0;
  for (const auto& t : state->module->parameters()) {
    n += t.numel();
    if (t.requires_grad()) trainable += t.numel();
  }
  if (ctx.run().rank == 0) {
    const std::string train = trainable == n ? "" : fmt::format(", {:.3f}M trainable", static_cast<double>(trainable) / 1e6);
    spdlog::info("{}: {:.2f}M parameters{} ({}; {})", ctx.who(), static_cast<double>(n) / 1e6, train, what, from);
  }
  state->module->to(run_device(ctx.run()));  // initialised or loaded on the CPU, then placed
  // A model built from lora::Linear layers can carry adapters: the checkpoint's `exports` writes
  // them (a model that cannot, the MLP or the VAE, offers nothing and says so).
  bool adaptable = false;
  for (const auto& m : state->module->modules(/*include_self=*/false)) adaptable = adaptable || m->as<lora::LinearImpl>();
  if (adaptable && !state->exporter) state->exporter = lora::peft_export;
  ctx.own_state("params", state);
}

}  // namespace

std::string ModelNode::load_pretrained(ModelState&) {
  throw std::logic_error("ModelNode: Plan::pretrained set by a family without load_pretrained");
}

std::shared_ptr<parallel::Group> ModelNode::tp_group(SetupContext& ctx) {
  const parallel::Mesh mesh = parallel::mesh_of(ctx.run());
  const int tp = mesh.size(parallel::Dim::tp);
  if (tp == 1) return nullptr;
  return parallel::Group::place(ctx.name(), mesh, parallel::Dim::tp, ctx.run().rank);
}

std::shared_ptr<parallel::Group> ModelNode::ep_group(SetupContext& ctx) {
  const parallel::Mesh mesh = parallel::mesh_of(ctx.run());
  if (mesh.size(parallel::Dim::ep) == 1) return nullptr;
  return parallel::Group::place(ctx.name(), mesh, parallel::Dim::ep, ctx.run().rank);
}

std::map<std::string, torch::Tensor> ModelNode::named_tensors(torch::nn::Module& whole) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& t : whole.named_parameters()) out[t.key()] = t.value().detach();
  return out;
}

std::shared_ptr<Stages> ModelNode::cut_into_stages(SetupContext& ctx, const Family& family) {
  const std::vector<double>& block_costs = family.block_costs;
  if (!ctx.run().graph) return nullptr;
  const RunSettings::Parallel& par = ctx.run().graph->settings.parallel;
  if (par.pp == 1) return nullptr;
  auto cut = std::make_shared<Stages>();
  cut->stages = par.pp;
  const int chunks = par.pp * par.virtual_stages;
  try {
    cut->blocks = par.stage_layers.empty()
                     ? parallel::pipeline::balance(block_costs, chunks, family.embedding_cost, family.head_cost)
                     : parallel::pipeline::given(par.stage_layers, static_cast<int>(block_costs.size()), chunks);
  } catch (const std::exception& e) {
    throw std::runtime_error(ctx.who() + ": " + e.what());
  }
  const int stage = parallel::mesh_of(ctx.run()).coord(ctx.run().rank).pp;
  for (int k = 0; k < chunks; ++k)
    if (k % par.pp == stage) cut->mine.push_back(k);
  if (cut->first() != cut->last()) cut->tied = family.tied;  // the first stage's, copied on the last
  if (ctx.run().rank == 0) {
    std::string runs;
    for (size_t k = 0; k < cut->blocks.size(); ++k)
      runs += (k ? ", " : "") + std::to_string(cut->blocks[k].first) + "-" + std::to_string(cut->blocks[k].second - 1);
    spdlog::info("{}: blocks per pipeline chunk (chunk k on stage k mod {}): {}{}", ctx.who(), par.pp, runs,
                 par.stage_layers.empty() ? " (balanced by cost, with the embedding and the head)" : " (stage_layers)");
  }
  return cut;
}

std::shared_ptr<ModelState> ModelNode::declared_state(std::shared_ptr<ModelState> state, const Family& family,
                                                      uint64_t seed, bool init, const std::string& init_name,
                                                      std::string& how) {
  if (init) {  // the whole model's init, tensor by tensor, each rank keeping its parts and its stage's
    how = init_name + ", seed " + std::to_string(seed);
    init_declared(*state->module, family, seed);
  }
  hold_declared(*state, family, how);
  return state;
}

void ModelNode::finish(SetupContext&, ModelState&, const std::vector<std::string>&) {}

void ModelNode::offer_hf_export(SetupContext& ctx, ModelState& state, const std::vector<std::string>& adapted,
                                nlohmann::json config, const std::string& prefix, const std::string& copy_from,
                                Rename rename) {
  if (!adapted.empty()) return;
  const auto max_shard = static_cast<int64_t>(ctx.params().get<double>("export_shard_mb") * 1e6);
  state.exporter = [config = std::move(config), prefix, max_shard, copy_from, rename](const ModelState& s) {
    // Copies of the whole tensors, taken at the checkpoint's snapshot; written on its writer thread.
    safetensors::Tensors tensors;
    for (const auto& [name, t] : s.gathered.empty() ? s.tensors() : s.gathered)
      tensors[prefix + name] = t.detach().to(torch::kCPU, false, /*copy=*/true);
    if (rename) tensors = rename(tensors);
    return ModelState::ExportWriter([config, tensors = std::move(tensors), max_shard, copy_from](const std::string& dir) {
      write_pretrained(dir, config, tensors, max_shard, copy_from);
    });
  };
}

void ModelNode::setup(SetupContext& ctx) {
  const Params& p = ctx.params();
  if (p.has("pretrained") && p.has("weights")) throw pretrained_and_weights(ctx.who());
  const Plan plan = configure(ctx);
  check_model_fits(ctx.who(), plan.what, plan.parameters, /*frozen=*/false, plan.layers);
  const uint64_t seed = node_seed(ctx);
  const bool loads = plan.pretrained || p.has("weights");
  const std::string weights = p.has("weights") ? weights_path(ctx, plan.weights_are) : "";
  std::string init;
  std::shared_ptr<ModelState> state = build(seed, /*init=*/!loads, init);
  std::vector<std::string> adapted;
  const std::string lora = apply_lora_param(ctx, *state->module, seed, adapted);
  std::string from = init;
  const char* base = adapted.empty() ? "weights from " : "base weights from ";
  if (plan.pretrained) from = base + load_pretrained(*state);
  if (!weights.empty()) {
    load_weights(*state, weights);
    from = base + weights;
  }
  // Issue 47: adapters over a frozen base that is only its random init train nothing a user wants.
  if (!adapted.empty() && !loads && ctx.run().rank == 0)
    spdlog::warn("{}: lora adapters on a base that was not loaded (weights and pretrained are null): the frozen base is "
                 "its random init ({}), so the adapters learn around noise; give the base's weights, or drop lora",
                 ctx.who(), init);
  from += lora + load_adapters_param(ctx, *state, seed);
  state->checkpoint = plan.checkpoint;
  finish(ctx, *state, adapted);
  own_model(ctx, state, plan.what, from);
}

}  // namespace flowrun
