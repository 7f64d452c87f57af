// What the parity tests against Hugging Face's libraries share (tests/fixtures/hf: folders the
// reference library saved itself, and the reference outputs it computed): the fixtures' folder,
// a reference file's tensors by name, a fixture folder copied with its config.json edited, and
// the measure the parity bars are stated in.
#pragma once
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "common/safetensors.hpp"
#include "support/run_graph.hpp"

namespace flowrun::test {

inline const std::string kHfFixtures = std::string(FLOWRUN_SOURCE_DIR) + "/tests/fixtures/hf";

// Tensor `name` of kHfFixtures/FILE (read once per file).
inline const torch::Tensor& hf_reference(const std::string& file, const std::string& name) {
  static std::map<std::string, safetensors::Tensors> files;
  auto f = files.find(file);
  if (f == files.end()) f = files.emplace(file, safetensors::load(kHfFixtures + "/" + file).tensors).first;
  auto it = f->second.find(name);
  if (it == f->second.end()) throw std::runtime_error(file + " has no " + name);
  return it->second;
}

// ||a - b|| / ||b||, in float64: the measure the parity bars (1e-5) are stated in.
inline double rel_norm_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a.to(torch::kDouble) - b.to(torch::kDouble)).norm() / b.to(torch::kDouble).norm()).item<double>();
}

// A copy of fixture folder `folder` (in a fresh temporary folder tagged `tag`) with its
// config.json edited.
inline std::string edited_fixture(const std::string& folder, const std::function<void(nlohmann::json&)>& edit,
                                  const std::string& tag) {
  const std::string dir = temp_dir(tag) + "/" + folder;
  std::filesystem::copy(kHfFixtures + "/" + folder, dir, std::filesystem::copy_options::recursive);
  nlohmann::json c;
  std::ifstream(dir + "/config.json") >> c;
  edit(c);
  std::ofstream(dir + "/config.json") << c.dump(2);
  return dir;
}

}  // namespace flowrun::test
