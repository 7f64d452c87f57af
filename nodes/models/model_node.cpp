// The model nodes' shared tail (model_node.hpp).
#include "models/model_node.hpp"

#include <spdlog/spdlog.h>

#include "common/device.hpp"
#include "formats/files.hpp"
#include "models/lora.hpp"

namespace flowrun {

std::string apply_lora_param(SetupContext& ctx, torch::nn::Module& module, uint64_t seed,
                             std::vector<std::string>* adapted) {
  const Params& p = ctx.params();
  if (!p.has("lora")) return "";
  const Params l = p.sub("lora");
  lora::Config lc;
  lc.rank = l.get<int64_t>("rank");
  lc.alpha = l.get<double>("alpha");
  lc.dropout = l.get<double>("dropout");
  lc.targets = l.get<std::vector<std::string>>("targets");
  try {
    const std::vector<std::string> names = lora::apply_lora(module, lc, seed);
    if (adapted) *adapted = names;
    return ", LoRA r=" + std::to_string(lc.rank) + " on " + std::to_string(names.size()) + " layers";
  } catch (const std::exception& e) {
    throw std::runtime_error(ctx.who() + ": " + e.what());
  }
}

// Issue 47: adapters over a frozen base that is only its random init train nothing a user wants.
void warn_adapters_on_random_base(SetupContext& ctx, bool adapters, bool base_loaded, const std::string& init) {
  if (!adapters || base_loaded || ctx.run().rank != 0) return;
  spdlog::warn("{}: lora adapters on a base that was not loaded (weights and pretrained are null): the frozen base is "
               "its random init ({}), so the adapters learn around noise; give the base's weights, or drop lora",
               ctx.who(), init);
}

std::string init_lora_load(SetupContext& ctx, torch::nn::Module& module, uint64_t seed,
                           const std::function<std::string()>& init, const std::function<void(const std::string&)>& load) {
  const Params& p = ctx.params();
  std::string from = p.has("weights") ? "" : init();
  const std::string adapters = apply_lora_param(ctx, module, seed);
  if (p.has("weights")) {
    // Through a checkpoint's `latest` file, so a graph can name "the newest base checkpoint".
    const std::string path = resolve_latest(p.get<std::string>("weights"));
    load(path);
    from = (adapters.empty() ? "weights from " : "base weights from ") + path;
  }
  warn_adapters_on_random_base(ctx, !adapters.empty(), p.has("weights"), from);
  return from + adapters;
}

std::string load_adapters_param(SetupContext& ctx, ModelState& state, uint64_t seed) {
  const Params& p = ctx.params();
  if (!p.has("adapters")) return "";
  const std::string dir = resolve_latest(p.get<std::string>("adapters"));
  try {
    lora::load_peft(state, dir, seed);
  } catch (const std::exception& e) {
    throw std::runtime_error(ctx.who() + ": adapters: " + e.what());
  }
  return "; adapters from " + dir;
}

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

}  // namespace flowrun
