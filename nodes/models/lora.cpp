// LoRA adapters in PEFT's layout: see lora.hpp. Test: tests/nodes/lora_test.cpp.
#include "models/lora.hpp"

#include "formats/json_file.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "formats/files.hpp"
#include "common/memory.hpp"
#include "common/safetensors.hpp"
#include "common/seed.hpp"
#include "models/dropout.hpp"
#include "models/linear.hpp"
#include "models/load_by_name.hpp"

namespace flowrun::lora {

namespace fs = std::filesystem;

namespace {

constexpr const char* kPeftPrefix = "base_model.model.";

}  // namespace

void Config::check() const {
  if (rank < 1) throw std::runtime_error("lora: rank must be >= 1, got " + std::to_string(rank));
  if (targets.empty()) throw std::runtime_error("lora: targets is empty (name the Linear layers to adapt, e.g. [to_q, to_v])");
  if (!(dropout >= 0.0 && dropout < 1.0)) throw std::runtime_error("lora: dropout must be in [0, 1)");
}

void LinearImpl::reset() {
  weight = register_parameter("weight", fan_in_fan_out_ ? torch::empty({in_, out_}) : torch::empty({out_, in_}));
  if (has_bias_) bias = register_parameter("bias", torch::zeros({out_}));
  if (rank_ > 0) {
    lora_A = register_module("lora_A", Factor(rank_, in_));
    lora_B = register_module("lora_B", Factor(out_, rank_));
  }
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x) { return product(x, bias); }

torch::Tensor LinearImpl::forward_without_bias(const torch::Tensor& x) { return product(x, torch::Tensor()); }

torch::Tensor LinearImpl::product(const torch::Tensor& x, const torch::Tensor& bias) {
  torch::Tensor y = flowrun::linear(x, weight, bias, fan_in_fan_out_);
  if (rank_ > 0) {
    // Under tp (see the top of lora.hpp): the factor every rank holds whole gets its gradient
    // summed over the group; a split input's dropout mask is its columns of the whole input's.
    const bool split = tp_ && tp_->size() > 1;
    torch::Tensor A = lora_A->weight, B = lora_B->weight, in;
    if (split && tp_role_ == TpRole::outputs) A = parallel::copy_to_tp(A, tp_);
    if (split && tp_role_ == TpRole::inputs) {
      B = parallel::copy_to_tp(B, tp_);
      std::vector<int64_t> whole = x.sizes().vec();
      whole.back() = whole_in_features();
      in = flowrun::dropout_of_part(x, dropout_, whole, x.dim() - 1, tp_->rank() * in_);
    } else {
      in = flowrun::dropout(x, dropout_);
    }
    y = y + torch::nn::functional::linear(torch::nn::functional::linear(in, A), B) * scale();
  }
  return y;
}

void LinearImpl::set_tp(std::shared_ptr<parallel::Group> tp, TpRole role) {
  if (rank_ > 0) throw std::logic_error("lora: a layer is split over tp before it gets an adapter");
  tp_ = std::move(tp);
  tp_role_ = role;
}

int64_t LinearImpl::whole_in_features() const {
  return tp_ && tp_role_ == TpRole::inputs ? in_ * tp_->size() : in_;
}

torch::Tensor LinearImpl::inputs_part(const torch::Tensor& whole) const {
  if (!(tp_ && tp_role_ == TpRole::inputs && tp_->size() > 1)) return whole;
  return parallel::tp_block(whole, whole.dim() - 1, *tp_, "lora: a row-split layer's adapter");
}

parallel::TpSplit adapter_tp_split(const std::string& name, const std::function<parallel::TpSplit(const std::string&)>& base,
                                   bool fan_in_fan_out) {
  const size_t at = name.rfind(".lora_");
  if (at == std::string::npos) return {};
  const parallel::TpSplit w = base(name.substr(0, at) + ".weight");
  if (!w.split()) return {};
  const bool outputs = w.dim == (fan_in_fan_out ? 1 : 0);  // W's output dimension split: column-parallel
  const bool is_b = name.compare(at, 8, ".lora_B.") == 0;
  if (outputs) return is_b ? parallel::TpSplit{0, w.runs} : parallel::TpSplit{};  // B [out, r] by rows
  return is_b ? parallel::TpSplit{} : parallel::TpSplit{1, 1};                     // A [r, in] by columns
}

void LinearImpl::add_adapter(int64_t rank, double alpha, double dropout, const std::string& target) {
  if (rank_ > 0) throw std::runtime_error("lora: layer already has an adapter");
  if (rank < 1) throw std::runtime_error("lora: rank must be >= 1");
  rank_ = rank;
  alpha_ = alpha;
  dropout_ = dropout;
  target_ = target;
  auto opts = weight.options().requires_grad(false);
  lora_A = register_module("lora_A", Factor(rank_, in_));
  lora_B = register_module("lora_B", Factor(out_, rank_));
  torch::NoGradGuard no_grad;
  lora_A->weight.set_data(torch::zeros({rank_, in_}, opts));
  lora_B->weight.set_data(torch::zeros({out_, rank_}, opts));
}

void LinearImpl::merge_adapter() {
  if (rank_ == 0) return;
  {
    torch::NoGradGuard no_grad;
    const torch::Tensor delta = torch::mm(lora_B->weight, lora_A->weight);  // [out, in]
    weight.add_((fan_in_fan_out_ ? delta.t() : delta).to(weight.dtype()), scale());
  }
  unregister_module("lora_A");
  unregister_module("lora_B");
  lora_A = nullptr;
  lora_B = nullptr;
  rank_ = 0;
  alpha_ = dropout_ = 0.0;
  target_.clear();
}

bool matches(const std::string& name, const std::string& target) {
  if (name == target) return true;
  return name.size() > target.size() && name.compare(name.size() - target.size(), target.size(), target) == 0 &&
         name[name.size() - target.size() - 1] == '.';
}

std::vector<std::string> apply_lora(torch::nn::Module& root, const Config& cfg, uint64_t seed) {
  cfg.check();
  // Find every layer first, so that a bad target changes nothing. A layer goes to the first
  // target that matches it; a later target that matches only layers taken before it is named
  // with the one that took them (c_proj, then attn.c_proj).
  std::vector<std::pair<std::string, LinearImpl*>> chosen;
  std::vector<std::string> chosen_target;
  std::set<std::string> used;
  std::map<std::string, std::string> shadowed;  // target -> the earlier target that took its first match
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    const std::string& name = item.key();
    const std::string* taken_by = nullptr;
    for (const auto& t : cfg.targets) {
      if (!matches(name, t)) continue;
      if (taken_by) {
        shadowed.emplace(t, "'" + *taken_by + "' already takes " + name);
        continue;
      }
      auto* lin = item.value()->as<LinearImpl>();
      if (!lin)
        throw std::runtime_error("lora: target '" + t + "' matches module '" + name + "', which is a " +
                                 item.value()->name() + ", not a Linear layer (lora::Linear)");
      if (lin->has_adapter()) throw std::runtime_error("lora: module '" + name + "' already has an adapter");
      chosen.emplace_back(name, lin);
      chosen_target.push_back(t);
      used.insert(t);
      taken_by = &t;
    }
  }
  for (const auto& t : cfg.targets)
    if (!used.count(t) && shadowed.count(t))
      throw std::runtime_error("lora: target '" + t + "' matches only layers an earlier target takes (" + shadowed.at(t) +
                               "); drop one of the two");
  std::vector<std::string> unused;
  for (const auto& t : cfg.targets)
    if (!used.count(t)) unused.push_back(t);
  if (!unused.empty()) {
    std::string u, some;
    for (const auto& t : unused) u += (u.empty() ? "" : ", ") + t;
    int n = 0;
    for (const auto& item : root.named_modules("", false))
      if (item.value()->as<LinearImpl>() && n++ < 6) some += (some.empty() ? "" : ", ") + item.key();
    throw std::runtime_error("lora: target(s) " + u + " match no module of the model (its Linear layers: " + some +
                             (n > 6 ? ", ..." : "") + ")");
  }
  // The adapters' size before any is made: a rank of a million ended in torch's allocator text.
  double adapter_params = 0;
  for (const auto& [name, lin] : chosen)
    adapter_params += static_cast<double>(cfg.rank) * static_cast<double>(lin->in_features() + lin->out_features());
  check_model_fits("lora", "rank " + std::to_string(cfg.rank) + " on " + std::to_string(chosen.size()) + " layers",
                   adapter_params);

  torch::NoGradGuard no_grad;
  for (auto& p : root.parameters(true)) p.set_requires_grad(false);
  at::Generator g = make_cpu_generator(mix_seed({seed, kSeedTagLora}));
  for (size_t i = 0; i < chosen.size(); ++i) {
    LinearImpl* lin = chosen[i].second;
    lin->add_adapter(cfg.rank, cfg.alpha, cfg.dropout, chosen_target[i]);
    // PEFT: kaiming_uniform_(A, a=sqrt(5)) = U(-1/sqrt(fan_in), 1/sqrt(fan_in)); B = 0. A split
    // layer's A is drawn whole (the same draws at any tp) and this rank's columns kept.
    const int64_t in = lin->whole_in_features();
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    torch::Tensor a = torch::empty({cfg.rank, in}).uniform_(-bound, bound, g);
    lin->lora_A->weight.copy_(lin->inputs_part(a));
    lin->lora_A->weight.set_requires_grad(true);
    lin->lora_B->weight.set_requires_grad(true);
  }
  std::vector<std::string> names;
  for (const auto& c : chosen) names.push_back(c.first);
  return names;
}

std::vector<std::pair<std::string, LinearImpl*>> adapted_layers(torch::nn::Module& root) {
  std::vector<std::pair<std::string, LinearImpl*>> out;
  for (const auto& item : root.named_modules("", false))
    if (auto* lin = item.value()->as<LinearImpl>(); lin && lin->has_adapter()) out.emplace_back(item.key(), lin);
  return out;
}

bool has_lora(const ModelState& model) { return model.module && !adapted_layers(*model.module).empty(); }

Config adapter_config(const ModelState& model) {
  if (!model.module) throw std::runtime_error("lora: model '" + model.kind + "' has no module");
  auto layers = adapted_layers(*model.module);
  if (layers.empty()) throw std::runtime_error("lora: model '" + model.kind + "' has no LoRA adapters");
  Config c;
  c.rank = layers[0].second->rank();
  c.alpha = layers[0].second->alpha();
  c.dropout = layers[0].second->dropout();
  for (const auto& [name, lin] : layers) {
    if (lin->rank() != c.rank || lin->alpha() != c.alpha || lin->dropout() != c.dropout)
      throw std::runtime_error("lora: adapters of '" + name + "' differ in rank/alpha/dropout from '" + layers[0].first +
                               "' (PEFT's adapter_config has one r and lora_alpha)");
    if (std::find(c.targets.begin(), c.targets.end(), lin->target()) == c.targets.end()) c.targets.push_back(lin->target());
  }
  return c;
}

PeftFiles peft_files(const ModelState& model, const std::string& base_model) {
  const Config c = adapter_config(model);
  PeftFiles f;
  // A model split over tp, or sharded by ZeRO-3 over several ranks, exports whole adapters: those
  // the checkpoint's collect gathered (one rank's ZeRO-3 parameters are views of its whole slice).
  auto whole = [&](const std::string& name, const torch::Tensor& mine) {
    auto it = model.gathered.find(name);
    if (it != model.gathered.end()) return it->second.detach().to(torch::kCPU, false, true);
    if (model.tp || (model.shards && mine.numel() > 1 && mine.stride(0) == 0))
      throw std::logic_error("lora: a tensor-parallel or sharded model's adapters export from its gathered whole "
                             "tensors; '" + name + "' was not gathered (the checkpoint's collect runs first)");
    return mine.detach().to(torch::kCPU, false, true);
  };
  for (const auto& [name, lin] : adapted_layers(*model.module)) {
    f.tensors[kPeftPrefix + name + ".lora_A.weight"] = whole(name + ".lora_A.weight", lin->lora_A->weight);
    f.tensors[kPeftPrefix + name + ".lora_B.weight"] = whole(name + ".lora_B.weight", lin->lora_B->weight);
  }
  nlohmann::json j;
  j["peft_type"] = "LORA";
  j["r"] = c.rank;
  j["lora_alpha"] = c.alpha;
  j["target_modules"] = c.targets;
  j["lora_dropout"] = c.dropout;
  j["bias"] = "none";
  j["base_model_name_or_path"] = base_model.empty() ? nlohmann::json(nullptr) : nlohmann::json(base_model);
  j["task_type"] = nullptr;
  // HF Conv1D layers (GPT-2's) are fan_in_fan_out; PEFT's config has one flag for all.
  bool transposed = false;
  for (const auto& [name, lin] : adapted_layers(*model.module)) transposed = transposed || lin->fan_in_fan_out();
  for (const auto& [name, lin] : adapted_layers(*model.module))
    if (lin->fan_in_fan_out() != transposed)
      throw std::runtime_error("lora: the adapted layers mix Linear and Conv1D layouts ('" + name +
                               "'); PEFT's adapter_config has one fan_in_fan_out");
  j["fan_in_fan_out"] = transposed;
  j["inference_mode"] = true;
  j["init_lora_weights"] = true;
  j["modules_to_save"] = nullptr;
  j["layers_to_transform"] = nullptr;
  j["layers_pattern"] = nullptr;
  j["rank_pattern"] = nlohmann::json::object();
  j["alpha_pattern"] = nlohmann::json::object();
  j["use_rslora"] = false;
  j["use_dora"] = false;
  j["revision"] = nullptr;
  f.config_json = j.dump(2) + "\n";
  return f;
}

void write_peft(const std::string& dir, const PeftFiles& files) {
  fs::create_directories(dir);
  safetensors::save(dir + "/adapter_model.safetensors", files.tensors, {{"format", "pt"}});
  write_file_atomic(dir + "/adapter_config.json", files.config_json);
}

ModelState::ExportWriter peft_export(const ModelState& model) {
  if (!has_lora(model)) return {};
  return [files = peft_files(model)](const std::string& dir) { write_peft(dir, files); };
}

void load_peft(ModelState& model, const std::string& given_dir, uint64_t seed) {
  const std::string dir = resolve_latest(given_dir);  // a folder through a checkpoint's `latest`
  if (!model.module) throw std::runtime_error("lora: model '" + model.kind + "' has no module");
  const std::string cfg_path = dir + "/adapter_config.json", st_path = dir + "/adapter_model.safetensors";
  if (!std::filesystem::exists(cfg_path))
    throw std::runtime_error("lora: no " + cfg_path + " (a PEFT adapter folder has adapter_config.json)");
  Config c;
  try {
    const nlohmann::json j = read_json_file(cfg_path);
    if (!j.is_object()) throw std::runtime_error(cfg_path + ": not a JSON object");
    if (json_value<std::string>(j, cfg_path, "peft_type", "") != "LORA") throw std::runtime_error(cfg_path + ": peft_type is not \"LORA\"");
    if (json_value<bool>(j, cfg_path, "use_dora", false)) throw std::runtime_error(cfg_path + ": DoRA adapters are not supported");
    if (j.contains("rank_pattern") && j["rank_pattern"].is_object() && !j["rank_pattern"].empty())
      throw std::runtime_error(cfg_path + ": rank_pattern (per-layer ranks) is not supported");
    if (!j.contains("r") || !j.contains("lora_alpha") || !j.contains("target_modules"))
      throw std::runtime_error(cfg_path + ": r, lora_alpha and target_modules are required (PEFT writes them)");
    c.rank = json_value<int64_t>(j, cfg_path, "r", 0);
    c.alpha = json_value<double>(j, cfg_path, "lora_alpha", 0.0);
    c.dropout = json_value<double>(j, cfg_path, "lora_dropout", 0.0);
    // The same bounds as the graph's lora parameters (schemas): rank >= 1, alpha >= 0, dropout in [0, 1).
    if (c.rank < 1) throw std::runtime_error(cfg_path + ": key 'r': expected an integer >= 1, got " + std::to_string(c.rank));
    if (c.alpha < 0) throw std::runtime_error(cfg_path + ": key 'lora_alpha': expected a number >= 0, got " + j["lora_alpha"].dump());
    if (c.dropout < 0 || c.dropout >= 1)
      throw std::runtime_error(cfg_path + ": key 'lora_dropout': expected a number in [0, 1), got " + j["lora_dropout"].dump());
    if (j["target_modules"].is_string()) throw std::runtime_error(cfg_path + ": target_modules as a regular expression is not supported");
    c.targets = json_value<std::vector<std::string>>(j, cfg_path, "target_modules", {});
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(std::string("lora: ") + e.what());
  }
  if (!has_lora(model)) apply_lora(*model.module, c, seed);

  // The adapters, by their names in PEFT's file (PEFT may keep the adapter's name in a key,
  // ".lora_A.default.weight": accepted).
  NamedTensorMap mine;
  std::vector<std::string> disagree;
  for (auto& [name, lin] : adapted_layers(*model.module)) {
    mine[kPeftPrefix + name + ".lora_A.weight"] = lin->lora_A->weight;
    mine[kPeftPrefix + name + ".lora_B.weight"] = lin->lora_B->weight;
    if (lin->rank() != c.rank || lin->alpha() != c.alpha)
      disagree.push_back(name + ": the model's adapter has r=" + std::to_string(lin->rank()) + " alpha=" +
                         std::to_string(lin->alpha()) + ", the file's r=" + std::to_string(c.rank) +
                         " alpha=" + std::to_string(c.alpha));
  }
  LoadByNameOptions o;
  o.model = "the adapters of model '" + model.kind + "'";
  o.rename = [](const std::string& k) {
    for (const std::string s : {".lora_A.default.weight", ".lora_B.default.weight"})
      if (k.size() > s.size() && k.compare(k.size() - s.size(), s.size(), s) == 0)
        return k.substr(0, k.size() - s.size()) + s.substr(0, 7) + ".weight";
    return k;
  };
  o.check = [&disagree](const NamedTensorMap&) { return disagree; };
  std::map<std::string, torch::Tensor> file = safetensors::load(st_path).tensors;
  if (model.tp) {  // split over tp: this rank's parts of the file's whole adapters
    std::map<std::string, torch::Tensor> renamed;
    for (auto& [k, t] : file) renamed[o.rename(k)] = t;
    const std::string prefix = kPeftPrefix;
    file = model.tp->parts(
        renamed, [&](const std::string& k) { return k.rfind(prefix, 0) == 0 ? k.substr(prefix.size()) : k; }, "lora: " + st_path);
  }
  load_by_name(std::move(mine), file, "lora: " + st_path, o);
}

void merge_lora(ModelState& model) {
  if (!model.module) return;
  for (auto& [name, lin] : adapted_layers(*model.module)) lin->merge_adapter();
}

}  // namespace flowrun::lora
