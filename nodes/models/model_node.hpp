// What the model nodes (gpt, dit, cappa, vae, mlp) share once their module is built: LoRA
// adapters from the graph (`lora:`, `adapters:`; the shared group schemas/groups/lora.yaml),
// the parameter count in the log, the move to the run's device, and the `params` state they
// own. A family's node reads its config, builds and initialises (or loads) its module, then:
//
//   std::string from = init_lora_load(ctx, *model, seed,                // init or `weights`, `lora`
//       [&] { init_weights(*model, seed); return "GPT-2 init, seed " + std::to_string(seed); },
//       [&](const std::string& path) { load_hf_safetensors(*model, path); });
//   auto state = make_state(model);
//   from += load_adapters_param(ctx, *state, seed);  // `adapters:` set: PEFT folder
//   own_model(ctx, state, describe(cfg), from);      // log, place, export adapters, own
//
// Adapters go on the lora::Linear layers whose module names end with a target (gpt: c_attn,
// attn.c_proj, mlp.c_fc, mlp.c_proj; dit: to_q, to_k, to_v, to_out.0, ff.net.0.proj, ...).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "models/model_state.hpp"
#include "node.hpp"

namespace flowrun {

// A warning (rank 0) when a model carries adapters (`adapters`) over a base nothing was loaded
// into (`base_loaded` false): `init` says how the base was initialised.
void warn_adapters_on_random_base(SetupContext& ctx, bool adapters, bool base_loaded, const std::string& init);

// The module's values in the order a LoRA fine-tune needs: `init` (when the node has no
// `weights`; it returns what it did, "GPT-2 init, seed 7"), the adapters of `lora`
// (apply_lora_param), then `weights` (through a checkpoint's `latest`) loaded by `load`, the
// base of the adapters, which keep their init (the family's loader takes lora::is_adapter
// names as optional). Returns what was done, for own_model's log line.
std::string init_lora_load(SetupContext& ctx, torch::nn::Module& module, uint64_t seed,
                           const std::function<std::string()>& init, const std::function<void(const std::string&)>& load);

// The node's `lora` group, when set: every parameter of `module` frozen, adapters on the
// targeted layers (models/lora.hpp). Returns ", LoRA r=R on N layers", or "" when unset, and
// the adapted layers' names in `adapted` if given. Errors name the node.
std::string apply_lora_param(SetupContext& ctx, torch::nn::Module& module, uint64_t seed,
                             std::vector<std::string>* adapted = nullptr);

// The node's `adapters` folder (PEFT's, through a checkpoint's `latest`), when set: loaded
// into the model, its adapters made from adapter_config.json when the model has none yet.
// Returns "; adapters from DIR", or "".
std::string load_adapters_param(SetupContext& ctx, ModelState& state, uint64_t seed);

// Logs the parameter count (and the trainable count when some are frozen) with `what` (the
// config) and `from` (init or weights), on rank 0; moves the module to the run's device; makes
// its adapters exportable when it is built from lora::Linear layers (checkpoint `exports: true`
// writes them in PEFT's layout); owns `state` as the node's `params` output.
void own_model(SetupContext& ctx, std::shared_ptr<ModelState> state, const std::string& what, const std::string& from);

}  // namespace flowrun
