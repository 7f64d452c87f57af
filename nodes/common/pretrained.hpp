// Pretrained components as diffusers and transformers save them (save_pretrained): a folder with
// config.json and the weights, as one safetensors file or as shards named by an index
// (NAME.safetensors.index.json: {"weight_map": {tensor: shard file}}); or a whole pipeline's
// folder (model_index.json, one sub-folder per component: transformer/, vae/, text_encoder/, ...).
//
//   PretrainedFolder f = open_pretrained(path, {"transformer", "HunyuanDiT2DModel", "diffusion_pytorch_model"});
//   config_value<int64_t>(f, "num_layers", 28) ...; safetensors::Tensors w = load_pretrained_weights(f);
//
// Every problem is an error naming the file: a folder with neither config.json nor
// model_index.json, a pipeline without the component, a config of another class, an index
// naming a shard that is not there or a tensor its shard lacks.
#pragma once
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include "common/safetensors.hpp"
#include "formats/json_file.hpp"

#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace flowrun {

struct RunInfo;  // engine/node.hpp

struct PretrainedKind {
  std::string component;     // its folder in a pipeline ("transformer")
  std::string class_name;    // config.json's _class_name ("HunyuanDiT2DModel"); "": not checked
  std::string weights_stem;  // "diffusion_pytorch_model" (diffusers), "model" (transformers)
};

struct PretrainedFolder {
  std::string dir;            // the component's folder
  std::string config_path;    // dir/config.json
  nlohmann::json config;
  std::string weights_index;  // the index file, if the weights are sharded ("" if one file)
  std::vector<std::string> weight_files;  // the files to read, in the index's order
  std::map<std::string, std::string> weight_map;  // sharded: tensor name -> its file
};

// `path`: the component's folder, or a pipeline's (then its `component` sub-folder).
PretrainedFolder open_pretrained(const std::string& path, const PretrainedKind& kind);

// Every tensor of the folder's weights (all shards), checked against the index: a shard that
// is missing, or lacks a tensor the index puts in it, is an error naming both files. Nothing is
// read yet: the tensors are views of the mapped files (safetensors::map), so a load copies shard
// by shard, tensor by tensor, giving each one's pages back after it (load_by_name), and under tp
// or pp a rank reads only the parts and stages it keeps.
safetensors::Tensors load_pretrained_weights(const PretrainedFolder& f);
// The error of a node given both a pretrained folder and a weights file (`who` names it).
inline std::runtime_error pretrained_and_weights(const std::string& who) {
  return std::runtime_error(who + ": both pretrained and weights are set; pretrained loads the folder's weights, so set one of them");
}
// The file that names the weights, for messages: the index if sharded, else the one file.
inline const std::string& weights_source(const PretrainedFolder& f) {
  return f.weights_index.empty() ? f.weight_files.front() : f.weights_index;
}

// Every key of the folder's config.json (but _private ones) is one the caller reads (`known`),
// or one whose value changes the math and must be the one `model` ("this DiT") computes with
// (`fixed`; null: the library's default, accepted). Anything else is an error naming the file
// and the key; several are listed in one error, a line each.
void check_config_keys(const PretrainedFolder& f, const std::set<std::string>& known,
                       const std::map<std::string, nlohmann::json>& fixed, const std::string& class_name,
                       const std::string& model);
// The same problems as a list (empty: none), for a node that adds its own to them before it
// refuses the folder, and the error of a list (one problem: its text; several: a line each).
std::vector<std::string> config_key_problems(const PretrainedFolder& f, const std::set<std::string>& known,
                                             const std::map<std::string, nlohmann::json>& fixed,
                                             const std::string& class_name, const std::string& model);
std::runtime_error config_error(const PretrainedFolder& f, const std::vector<std::string>& problems);

// The parameters of node `node` as the graph file wrote them (overrides applied, no defaults
// filled in): what a node checks against a folder's config.json. Undefined when not written.
YAML::Node written_params(const RunInfo& run, const std::string& node);

// A config value of the folder as a number/bool/string, or `fallback` when the key is absent
// or null (the library's default for keys an older save did not write).
// Read by formats/json_file.hpp's json_value: a value of another type (32.7 for an integer,
// "yes" for a bool, 1e30) is an error naming the file, the key, what was expected and the value.
template <class T>
T config_value(const PretrainedFolder& f, const std::string& key, T fallback) {
  return json_value<T>(f.config, f.config_path, key, fallback);
}

// The value of config.json's `key` that sets the node's parameter `param` (`fallback`: the
// library's default where the file lacks it). A parameter also written in the graph (`written`:
// written_params) must have the same value, else the error names both values and the file.
template <class T>
T config_agreed(const PretrainedFolder& f, const YAML::Node& written, const std::string& param, const std::string& key,
                T fallback) {
  const T v = config_value<T>(f, key, fallback);
  if (written && written[param] && !written[param].IsNull() && written[param].as<T>() != v) {
    std::string file;
    if constexpr (std::is_same_v<T, std::string>) file = v;
    else file = nlohmann::json(v).dump();
    throw std::runtime_error(param + " is " + written[param].Scalar() + " in the graph, " + f.config_path + " has " + key +
                             " = " + file + "; drop " + param + " from the graph (the folder sets it) or use another folder");
  }
  return v;
}

// The reverse of open_pretrained and load_pretrained_weights: `dir` made into a folder as
// transformers' save_pretrained writes one — `config` as config.json, the tensors (CPU, any
// dtype) as model.safetensors, or, past `max_shard_bytes`, as model-0000K-of-0000N.safetensors in
// name order with model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map"}) —
// and the tokenizer and generation files of `copy_from` (a pretrained folder; "" for none) copied
// beside them. Every file is written whole or not at all (a temporary, then renamed).
void write_pretrained(const std::string& dir, const nlohmann::json& config, const safetensors::Tensors& tensors,
                      int64_t max_shard_bytes, const std::string& copy_from = "");

}  // namespace flowrun
