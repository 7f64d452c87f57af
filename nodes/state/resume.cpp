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
  const auto nodes = checkpoint_nodes(g);
  auto dir_of = [&](const NodeSpec* n) { return (fs::path(out_dir) / n->params["dir"].as<std::string>()).string(); };

  // A checkpoint folder named by path.
  if (!resume.empty() && resume != "auto" && resume != "never") {
    if (!fs::is_directory(resume))
      throw std::runtime_error("run.resume: no checkpoint folder " + resume +
                               " (give a step_* folder, or auto for OUT_DIR's newest checkpoint)");
    return ResumePoint{resume, ckpt::read_manifest(resume).step};
  }
  if (resume == "never") return std::nullopt;  // the checkpoint node deletes the old ones
  if (nodes.empty()) {
    if (resume == "auto")
      throw std::runtime_error("run.resume=auto: the graph has no checkpoint node, so there is nothing to resume from");
    return std::nullopt;
  }

  // A fresh start ("") over checkpoints of an earlier run would replace them: refuse.
  if (resume.empty()) {
    for (const NodeSpec* n : nodes) {
      const auto found = ckpt::checkpoints(dir_of(n));
      if (found.empty()) continue;
      const std::string newest =
          found.front().problem.empty() ? " (newest: step " + std::to_string(found.front().step) + ", " + found.front().folder + ")" : "";
      throw std::runtime_error(dir_of(n) + " holds " + std::to_string(found.size()) + " checkpoint folder(s) of an earlier run" +
                               newest + "; starting at step 1 would replace them. Continue that run with run.resume=auto, " +
                               "start over with run.resume=never (deletes them), or give a new run.out_dir");
    }
    return std::nullopt;
  }

  // auto: `latest`, or else the newest complete checkpoint by its manifest.
  const std::string dir = dir_of(nodes[0]);
  const auto found = ckpt::checkpoints(dir);
  const std::string name = ckpt::latest(dir);
  std::string why;  // why `latest` is not used
  if (name.empty()) {
    why = fs::exists(dir + "/latest") ? dir + "/latest is empty or not a file" : "there is no " + dir + "/latest";
  } else {
    const std::string folder = dir + "/" + name;
    try {
      return ResumePoint{folder, ckpt::read_manifest(folder).step};
    } catch (const std::exception& e) {
      why = dir + "/latest names " + name + ", which cannot be used: " + e.what();
    }
  }
  if (!found.empty() && found.front().problem.empty()) {
    spdlog::warn("run.resume=auto: {}; resuming from the newest complete checkpoint, {} (step {})", why,
                 found.front().folder, found.front().step);
    return ResumePoint{found.front().folder, found.front().step};
  }
  if (!found.empty()) {
    std::string problems;
    for (const auto& f : found) problems += "\n  " + f.problem;
    throw std::runtime_error("run.resume=auto: " + why + ", and none of the " + std::to_string(found.size()) +
                             " step folders in " + dir + " is a complete checkpoint:" + problems +
                             "\nRepair one, name one with run.resume=PATH, or start over with run.resume=never "
                             "(deletes them) or a new run.out_dir");
  }
  if (!name.empty()) throw std::runtime_error("run.resume=auto: " + why);
  spdlog::info("run.resume=auto: no checkpoint in {} yet; starting from step 1", dir);
  return std::nullopt;
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
