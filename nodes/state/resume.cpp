#include "state/resume.hpp"

#include <spdlog/spdlog.h>

#include <filesystem>
#include <mutex>

#include "common/safetensors.hpp"
#include "common/state_io.hpp"
#include "executor.hpp"
#include "spec.hpp"
#include "state/checkpoint_io.hpp"

namespace flowrun {

namespace fs = std::filesystem;

namespace {

// The checkpoint nodes' folders (their `dir` under out_dir).
std::vector<const NodeSpec*> checkpoint_nodes(const GraphSpec& g) {
  std::vector<const NodeSpec*> v;
  for (const auto& n : g.nodes)
    if (n.type == "checkpoint") v.push_back(&n);
  return v;
}

}  // namespace

std::optional<ResumePoint> find_resume_point(const GraphSpec& g, const std::string& out_dir) {
  const std::string resume = g.run["resume"].as<std::string>("");
  if (resume.empty()) return std::nullopt;
  std::string folder;
  if (resume == "auto") {
    auto nodes = checkpoint_nodes(g);
    if (nodes.empty())
      throw std::runtime_error("run.resume=auto: the graph has no checkpoint node, so there is nothing to resume from");
    const std::string dir = (fs::path(out_dir) / nodes[0]->params["dir"].as<std::string>()).string();
    const std::string name = ckpt::latest(dir);
    if (name.empty()) {
      spdlog::info("run.resume=auto: no checkpoint in {} yet; starting from step 1", dir);
      return std::nullopt;
    }
    folder = dir + "/" + name;
  } else {
    folder = resume;
    if (!fs::is_directory(folder)) throw std::runtime_error("run.resume: no checkpoint folder " + folder);
  }
  ckpt::Manifest m = ckpt::read_manifest(folder);
  return ResumePoint{folder, m.step};
}

void restore(Executor& ex, const GraphSpec& g, const ResumePoint& p) {
  ckpt::Manifest m = ckpt::read_manifest(p.folder);
  // Every state this graph checkpoints must be there (a changed graph is caught here).
  for (const NodeSpec* n : checkpoint_nodes(g))
    if (const InputSpec* in = n->input("state"))
      for (const auto& r : in->refs)
        if (!m.states.count(r.str()))
          throw std::runtime_error("checkpoint " + p.folder + " has no state '" + r.str() +
                                   "', which node '" + n->name + "' saves; it was written by another graph?");
  for (const auto& [ref, file] : m.states) {
    const size_t dot = ref.find('.');
    Value* v = nullptr;
    try {
      v = &ex.state(ref.substr(0, dot), ref.substr(dot + 1));
    } catch (const std::exception&) {
      throw std::runtime_error("checkpoint " + p.folder + " holds state '" + ref + "', which this graph does not have");
    }
    const StateIO* io = find_state_io(*v);
    if (!io) throw std::runtime_error("state '" + ref + "' (" + v->type_name() + ") cannot be restored: no StateIO");
    safetensors::File f = safetensors::load(p.folder + "/" + file);
    try {
      io->load(*v, f.tensors);
    } catch (const std::exception& e) {
      throw std::runtime_error("restoring '" + ref + "' from " + p.folder + "/" + file + ": " + e.what());
    }
  }
  if (!m.rng_file.empty()) {
    safetensors::File f = safetensors::load(p.folder + "/" + m.rng_file);
    if (f.tensors.count("cpu")) {
      at::Generator gen = torch::globalContext().defaultGenerator(torch::kCPU);
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(f.tensors.at("cpu"));
    }
  }
  spdlog::info("resumed from {} (step {})", p.folder, p.step);
}

}  // namespace flowrun
