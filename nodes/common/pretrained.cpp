// Pretrained folders of diffusers and transformers (common/pretrained.hpp).
// Test: tests/nodes/pretrained_test.cpp.
#include "common/pretrained.hpp"

#include <filesystem>
#include <set>
#include <stdexcept>

#include "formats/files.hpp"
#include "node.hpp"

namespace flowrun {

namespace fs = std::filesystem;

PretrainedFolder open_pretrained(const std::string& given, const PretrainedKind& kind) {
  // A checkpoint that exported its model is a folder transformers loads: runs/x/checkpoints/latest reads the newest.
  const std::string path = resolve_latest(given);
  if (!fs::is_directory(path)) throw std::runtime_error("pretrained: " + path + " is not a folder");
  PretrainedFolder f;
  f.dir = path;
  if (!fs::exists(path + "/config.json")) {
    const std::string index = path + "/model_index.json";
    if (!fs::exists(index))
      throw std::runtime_error("pretrained: " + path + " has neither config.json (a component's folder, as " +
                               "save_pretrained writes it) nor model_index.json (a pipeline's)");
    const nlohmann::json pipeline = read_json_file(index);
    if (!pipeline.contains(kind.component)) {
      std::string have;
      for (const auto& [key, value] : pipeline.items())
        if (!key.empty() && key[0] != '_') have += (have.empty() ? "" : ", ") + key;
      throw std::runtime_error("pretrained: " + index + " has no component '" + kind.component + "' (it has: " + have +
                               "); give the component's folder instead");
    }
    f.dir = path + "/" + kind.component;
    if (!fs::exists(f.dir + "/config.json"))
      throw std::runtime_error("pretrained: " + f.dir + "/config.json is missing (" + index + " names the component '" +
                               kind.component + "')");
  }
  f.config_path = f.dir + "/config.json";
  f.config = read_json_file(f.config_path);
  if (!f.config.is_object()) throw std::runtime_error(f.config_path + ": not a JSON object");
  const std::string cls = config_value<std::string>(f, "_class_name", "");
  if (!kind.class_name.empty() && !cls.empty() && cls != kind.class_name)
    throw std::runtime_error(f.config_path + ": _class_name is " + cls + ", this node reads a " + kind.class_name);

  const std::string single = f.dir + "/" + kind.weights_stem + ".safetensors";
  const std::string index = single + ".index.json";
  if (fs::exists(single)) {
    f.weight_files = {single};
  } else if (fs::exists(index)) {
    f.weights_index = index;
    const nlohmann::json j = read_json_file(index);
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      throw std::runtime_error(index + ": no weight_map (a sharded checkpoint's index maps each tensor to its file)");
    std::set<std::string> seen;
    for (const auto& [name, entry] : j["weight_map"].items()) {  // a tensor named twice: refused by read_json_file
      std::string file;
      json_as(entry, index + ": weight_map key '" + name + "'", file);
      const std::string shard = f.dir + "/" + file;
      f.weight_map[name] = shard;
      if (seen.insert(shard).second) {
        if (!fs::exists(shard)) throw std::runtime_error(index + " names " + file + ", which is not in " + f.dir);
        f.weight_files.push_back(shard);
      }
    }
  } else {
    throw std::runtime_error("pretrained: " + f.dir + " has no " + kind.weights_stem + ".safetensors nor " +
                             kind.weights_stem + ".safetensors.index.json (only safetensors weights are read; " +
                             "convert .bin files with save_pretrained(safe_serialization=True))");
  }
  return f;
}

std::vector<std::string> config_key_problems(const PretrainedFolder& f, const std::set<std::string>& known,
                                             const std::map<std::string, nlohmann::json>& fixed,
                                             const std::string& class_name, const std::string& model) {
  std::vector<std::string> problems;
  for (const auto& [key, value] : f.config.items()) {
    if (key.empty() || key[0] == '_' || known.count(key)) continue;
    auto it = fixed.find(key);
    auto text = [](const nlohmann::json& j) { return j.is_string() ? j.get<std::string>() : j.dump(); };
    if (it == fixed.end())
      problems.push_back(key + " is not " +
                         (std::string("AEIOU").find(class_name.substr(0, 1)) != std::string::npos ? "an " : "a ") +
                         class_name + " setting " + model + " knows");
    else if (!value.is_null() && value != it->second)
      problems.push_back(key + " = " + text(value) + " is not built (" + model + " computes with " + text(it->second) + ")");
  }
  return problems;
}

std::runtime_error config_error(const PretrainedFolder& f, const std::vector<std::string>& problems) {
  if (problems.size() == 1) return std::runtime_error(f.config_path + ": " + problems[0]);
  std::string all = f.config_path + ": " + std::to_string(problems.size()) + " problems:";
  for (const auto& p : problems) all += "\n  " + p;
  return std::runtime_error(all);
}

void check_config_keys(const PretrainedFolder& f, const std::set<std::string>& known,
                       const std::map<std::string, nlohmann::json>& fixed, const std::string& class_name,
                       const std::string& model) {
  const auto problems = config_key_problems(f, known, fixed, class_name, model);
  if (!problems.empty()) throw config_error(f, problems);
}

YAML::Node written_params(const RunInfo& run, const std::string& node) {
  if (!run.graph) return YAML::Node();
  const YAML::Node with = run.graph->root["nodes"][node]["with"];
  return with ? with : YAML::Node();
}

safetensors::Tensors load_pretrained_weights(const PretrainedFolder& f) {
  safetensors::Tensors all;
  for (const std::string& file : f.weight_files) {
    safetensors::File shard = safetensors::map(file);  // read when copied: each rank reads what it keeps
    for (auto& [name, t] : shard.tensors) {
      if (!f.weights_index.empty()) {
        auto it = f.weight_map.find(name);
        if (it == f.weight_map.end() || it->second != file)
          throw std::runtime_error(file + " holds " + name + ", which " + f.weights_index + " puts " +
                                   (it == f.weight_map.end() ? std::string("nowhere") : "in " + it->second));
      }
      all[name] = t;
    }
  }
  for (const auto& [name, file] : f.weight_map)
    if (!all.count(name)) throw std::runtime_error(f.weights_index + " puts " + name + " in " + file + ", which lacks it");
  return all;
}

void write_pretrained(const std::string& dir, const nlohmann::json& config, const safetensors::Tensors& tensors,
                      int64_t max_shard_bytes, const std::string& copy_from) {
  fs::create_directories(dir);
  // Shards in name order, each up to max_shard_bytes (a tensor larger than that alone), as
  // save_pretrained's max_shard_size cuts them.
  std::vector<safetensors::Tensors> shards(1);
  int64_t in_shard = 0, total = 0;
  for (const auto& [name, t] : tensors) {
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    if (in_shard > 0 && in_shard + bytes > max_shard_bytes) shards.emplace_back(), in_shard = 0;
    shards.back()[name] = t;
    in_shard += bytes, total += bytes;
  }
  const safetensors::Metadata meta = {{"format", "pt"}};
  if (shards.size() == 1) {
    safetensors::save(dir + "/model.safetensors", shards[0], meta);
  } else {
    nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", nlohmann::json::object()}};
    char file[64];
    for (size_t k = 0; k < shards.size(); ++k) {
      std::snprintf(file, sizeof file, "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
      safetensors::save(dir + "/" + file, shards[k], meta);
      for (const auto& [name, _] : shards[k]) index["weight_map"][name] = file;
    }
    write_file_atomic(dir + "/model.safetensors.index.json", index.dump(2) + "\n");
  }
  write_file_atomic(dir + "/config.json", config.dump(2) + "\n");
  if (copy_from.empty()) return;
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                        "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja"})
    if (fs::exists(copy_from + "/" + f)) write_file_atomic(dir + "/" + f, read_file(copy_from + "/" + f));
}

}  // namespace flowrun
