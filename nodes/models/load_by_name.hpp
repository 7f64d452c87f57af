// Loading a state dict (a safetensors file's tensors) into a model by name, with every problem
// reported at once: missing, unexpected and mis-shaped tensors, in one error that starts with
// the file name. The one loader of gpt, dit, lora (PEFT adapters), bert, t5_encoder and vae:
// each states only how its files differ from its own names (prefixes, keys to ignore, renames)
// and what more it checks.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace flowrun {

using NamedTensorMap = std::map<std::string, torch::Tensor>;

struct LoadByNameOptions {
  std::string model;                   // "bert (layers=2 dim=32 ...)": what is loading, for the error
  std::vector<std::string> prefixes;   // name prefixes to strip ("bert.", "transformer.")
  // The file's name (prefix stripped) -> the model's name (PEFT's "x.lora_A.default.weight" ->
  // "x.lora_A.weight"); applied before `ignore`. Unset: names are kept.
  std::function<std::string(const std::string&)> rename;
  std::function<bool(const std::string&)> ignore;    // file names to skip silently
  std::function<bool(const std::string&)> optional;  // model names the file may lack (they keep their values)
  // More problems seen in the whole file (gpt: an lm_head.weight that is not wte.weight), each
  // listed as mis-shaped.
  std::function<std::vector<std::string>(const NamedTensorMap& file)> check;
  // A line appended to the error that says what the file holds ("the file looks like layers=2
  // dim=64 ..."), so a wrong size parameter is obvious.
  std::function<std::string(const NamedTensorMap& file)> describe_file;
};

// Copies every tensor of `targets` (aliases of the model's tensors, by the model's names) from
// `tensors` (floating dtypes, converted to the target's). Throws std::runtime_error listing
// every problem; copies nothing then. Tensors of a mapped file (safetensors::map) are read one
// at a time, their pages given back after the check and after the copy: a load's memory peaks
// near the model plus its largest tensor, however many shards the file has.
void load_by_name(NamedTensorMap targets, const NamedTensorMap& tensors, const std::string& source,
                  const LoadByNameOptions& options);
// The same for every parameter and buffer of `module`.
void load_by_name(torch::nn::Module& module, const NamedTensorMap& tensors, const std::string& source,
                  const LoadByNameOptions& options);

}  // namespace flowrun
