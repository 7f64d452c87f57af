#include "state/resume.hpp"

#include <spdlog/spdlog.h>

#include <yaml-cpp/yaml.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "formats/files.hpp"
#include "common/safetensors.hpp"
#include "common/state_io.hpp"
#include "comm.hpp"
#include "executor.hpp"
#include "parallel/layout.hpp"
#include "spec.hpp"
#include "formats/checkpoint_io.hpp"
#include "state/checkpoint_read.hpp"

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

namespace {

// Every state ref the graph's checkpoint nodes save ("model.params", ...).
std::set<std::string> saved_states(const GraphSpec& g) {
  std::set<std::string> refs;
  for (const NodeSpec* n : checkpoint_nodes(g))
    if (const InputSpec* in = n->input("state"))
      for (const auto& r : in->refs) refs.insert(r.str());
  return refs;
}

// The states of `want` that the checkpoint folder's manifest does not hold ("" when it holds all).
std::string missing_states(const ckpt::Manifest& m, const std::set<std::string>& want) {
  std::string missing;
  for (const auto& r : want)
    if (!m.states.count(r)) missing += (missing.empty() ? "" : ", ") + r;
  return missing;
}

}  // namespace

std::string verify_checkpoint(const std::string& folder, comm::Channel* channel) {
  std::string mine;
  try {
    const ckpt::Manifest m = ckpt::read_manifest(folder);
    const int rank = channel ? channel->rank() : 0, ranks = channel ? channel->size() : 1;
    int i = 0;
    for (const auto& [name, entry] : m.files)
      if (i++ % ranks == rank)
        if (const std::string p = ckpt::verify_file(folder, name, entry); !p.empty()) mine += (mine.empty() ? "" : "; ") + p;
  } catch (const std::exception& e) {
    mine = e.what();
  }
  if (!channel) return mine;
  std::string all;
  for (const std::string& p : comm::allgather_text(*channel, mine, "verifying " + folder))
    if (!p.empty() && all.find(p) == std::string::npos) all += (all.empty() ? "" : "; ") + p;
  return all;
}

std::optional<ResumePoint> find_resume_point(const GraphSpec& g, const std::string& out_dir,
                                             const std::map<std::string, std::string>& damaged) {
  const std::string& resume = g.settings.resume;
  const auto nodes = checkpoint_nodes(g);
  auto dir_of = [&](const NodeSpec* n) { return (fs::path(out_dir) / n->params["dir"].as<std::string>()).string(); };
  // Complete checkpoints in this graph's folders after `step`: resuming at `step` would write
  // those steps again, over them.
  // Damaged ones (a file whose bytes changed) are only named: resuming before them is the repair.
  auto later_than = [&](int64_t step) {
    std::string later;
    for (const NodeSpec* n : nodes)
      for (const auto& f : ckpt::checkpoints(dir_of(n))) {
        if (f.step <= step) continue;
        const std::string bad = f.problem.empty() ? verify_checkpoint(f.folder, nullptr) : f.problem;
        if (bad.empty())
          later += (later.empty() ? "" : ", ") + f.folder;
        else if (f.step > 0)
          spdlog::warn("run.resume={}: the later checkpoint {} is damaged ({}); resuming before it, this run writes "
                       "its step again (the damaged folder is moved aside to replaced.*)",
                       resume, f.folder, bad);
      }
    return later;
  };

  // A checkpoint folder named by path.
  if (!resume.empty() && resume != "auto" && resume != "never") {
    if (!fs::is_directory(resume))
      throw std::runtime_error("run.resume: no checkpoint folder " + resume +
                               " (give a step_* folder, or auto for OUT_DIR's newest checkpoint)");
    const int64_t step = ckpt::read_manifest(resume).step;
    const std::string later = later_than(step);
    if (!later.empty())
      throw std::runtime_error("run.resume=" + resume + " continues at step " + std::to_string(step + 1) +
                               ", but this run's checkpoint folder already holds later complete checkpoints (" + later +
                               "), which it would replace; move them away, give a new run.out_dir, or continue from "
                               "the newest with run.resume=auto");
    return ResumePoint{resume, step};
  }
  // never: the checkpoint node moves the earlier run's folders aside once its first is written.
  if (resume == "never") return std::nullopt;
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
                               "start over with run.resume=never (moves them aside once the new run's first checkpoint is " +
                               "written), or give a new run.out_dir");
    }
    return std::nullopt;
  }

  // auto: the newest complete checkpoint of any of the graph's checkpoint nodes that holds every
  // state the graph saves. `latest` normally names it; when it names an older one (a crash
  // between a folder's rename and the update of `latest`) or none, the newest still wins, with a
  // warning: resuming from `latest` would write the newer steps again, over their folders.
  const std::set<std::string> want = saved_states(g);
  std::optional<ResumePoint> best;
  std::vector<std::string> notes;  // why `latest` was not used, per folder
  size_t folders = 0;
  std::string problems;            // incomplete folders, for the error when none is usable
  for (const NodeSpec* n : nodes) {
    const std::string dir = dir_of(n);
    const auto found = ckpt::checkpoints(dir);
    folders += found.size();
    const std::string name = ckpt::latest(dir);
    int64_t latest_step = -1;
    if (name.empty()) {
      if (!found.empty())
        notes.push_back(fs::exists(dir + "/latest") ? dir + "/latest is empty or not a file" : "there is no " + dir + "/latest");
    } else {
      try {
        latest_step = ckpt::read_manifest(dir + "/" + name).step;
        // Its manifest reads, but a file is missing or of another size (the folders with a
        // problem come last in `found`: the loop below stops before them).
        for (const auto& f : found)
          if (fs::path(f.folder).filename().string() == name && !f.problem.empty()) {
            notes.push_back(dir + "/latest names " + name + ", which cannot be used: " + f.problem);
            latest_step = -1;
          }
      } catch (const std::exception& e) {
        notes.push_back(dir + "/latest names " + name + ", which cannot be used: " + e.what());
      }
    }
    for (const auto& f : found) {
      // The folder `latest` names, passed over: the warning says why (issue 47: it said only
      // what it resumed from instead).
      const bool named = !name.empty() && fs::path(f.folder).filename().string() == name;
      if (const auto d = damaged.find(f.folder); d != damaged.end() && f.problem.empty()) {
        problems += "\n  " + f.folder + ": damaged: " + d->second;
        notes.push_back(f.folder + (named ? ", which latest names," : "") + " is damaged: " + d->second);
        continue;
      }
      if (!f.problem.empty()) {
        problems += "\n  " + f.problem;
        if (named && latest_step >= 0)  // (an unreadable manifest was noted above)
          notes.push_back(dir + "/latest names " + name + ", which cannot be used: " + f.problem);
        continue;
      }
      const std::string missing = missing_states(ckpt::read_manifest(f.folder), want);
      if (!missing.empty()) {
        problems += "\n  " + f.folder + ": has no state " + missing + ", which this graph saves";
        if (named) notes.push_back(dir + "/latest names " + name + ", which has no state " + missing + " (this graph saves it)");
        continue;
      }
      if (latest_step >= 0 && f.step > latest_step)
        notes.push_back(dir + "/latest names step " + std::to_string(latest_step) + ", but " + f.folder +
                        " is complete and newer (a run stopped between writing it and updating latest)");
      if (!best || f.step > best->step) best = ResumePoint{f.folder, f.step};
      break;  // newest first: the first usable one of this folder
    }
  }
  if (best) {
    if (!notes.empty()) {
      std::string why;
      for (const auto& w : notes) why += (why.empty() ? "" : "; ") + w;
      spdlog::warn("run.resume=auto: {}; resuming from the newest complete checkpoint, {} (step {})", why, best->folder,
                   best->step);
    }
    return best;
  }
  if (folders > 0) {
    std::string why;
    for (const auto& w : notes) why += (why.empty() ? "" : "; ") + w;
    throw std::runtime_error("run.resume=auto: " + (why.empty() ? std::string("no usable checkpoint") : why) +
                             ", and none of the " + std::to_string(folders) +
                             " step folders is a complete checkpoint of this graph:" + problems +
                             "\nRepair one, name one with run.resume=PATH, or start over with run.resume=never "
                             "(moves them aside) or a new run.out_dir");
  }
  for (const auto& w : notes) throw std::runtime_error("run.resume=auto: " + w);
  spdlog::info("run.resume=auto: no checkpoint in {} yet; starting from step 1", dir_of(nodes[0]));
  return std::nullopt;
}

namespace {

// A resolved config as flat "KEY.PATH: value" settings, keyed as an override names them: run.seed,
// opt.lr (nodes.opt.with.lr), fb.every. Empty for a config that does not read (older manifests).
std::map<std::string, std::string> flat_settings(const std::string& config) {
  auto key = [](const std::string& path) {
    std::string k = path.rfind("nodes.", 0) == 0 ? path.substr(6) : path;
    const size_t with = k.find(".with.");
    if (with != std::string::npos && k.find('.') == with) k.erase(with, 5);
    return k;
  };
  std::map<std::string, std::string> out;
  std::function<void(const YAML::Node&, const std::string&)> flat = [&](const YAML::Node& n, const std::string& path) {
    if (n.IsMap()) {
      for (const auto& kv : n) flat(kv.second, path.empty() ? kv.first.as<std::string>() : path + "." + kv.first.as<std::string>());
    } else {
      YAML::Emitter e;
      e << YAML::Flow << n;
      out[key(path)] = e.c_str();
    }
  };
  try {
    flat(YAML::Load(config), "");
  } catch (const std::exception&) {
    return {};
  }
  return out;
}

// An integer setting of flat settings `s`, `dflt` when absent or not an integer.
int64_t int_setting(const std::map<std::string, std::string>& s, const std::string& k, int64_t dflt) {
  auto it = s.find(k);
  if (it == s.end()) return dflt;
  char* end = nullptr;
  const long long v = std::strtoll(it->second.c_str(), &end, 10);
  return end != it->second.c_str() && *end == 0 ? v : dflt;
}

// A run's mesh as its settings and processes give it.
struct MeshOf {
  int64_t world, tp, pp, dp;  // world and dp 0: not recorded
  MeshOf(const std::map<std::string, std::string>& s, int processes)
      : world(processes), tp(int_setting(s, "run.parallel.tp", 1)), pp(int_setting(s, "run.parallel.pp", 1)),
        dp(processes > 0 && tp * pp > 0 ? processes / (tp * pp) : 0) {}
  std::string str() const {
    const std::string shape = "pp " + std::to_string(pp) + " x tp " + std::to_string(tp);
    return world > 0 ? std::to_string(world) + " (dp " + std::to_string(dp) + " x " + shape + ")"
                     : "? (" + shape + "; its processes were not recorded)";
  }
};

}  // namespace

std::vector<std::string> changed_settings(const RunRecord& saved, const RunRecord& now,
                                          const std::vector<std::string>& batch_keys) {
  const std::map<std::string, std::string> a = flat_settings(saved.config), b = flat_settings(now.config);
  if (a.empty() || b.empty()) return {};  // a manifest without a readable config: nothing to compare
  std::vector<std::string> out;
  // The mesh, one line.
  const MeshOf was(a, saved.world), is(b, now.world);
  if ((was.world > 0 && was.world != is.world) || was.tp != is.tp || was.pp != is.pp)
    out.push_back("processes " + is.str() + "; the checkpoint's run had " + was.str());
  // The global batch of each data source (its batch is per rank): batch x dp a step.
  std::set<std::string> folded;
  for (const std::string& k : batch_keys) {
    if (!a.count(k) || !b.count(k)) continue;
    folded.insert(k);
    const int64_t bn = int_setting(b, k, 0), bs = int_setting(a, k, 0);
    const std::string node = k.substr(0, k.rfind('.'));
    auto global = [](int64_t batch, int64_t dp) {
      return std::to_string(batch) + " x dp " + (dp > 0 ? std::to_string(dp) + " = " + std::to_string(batch * dp) : "?");
    };
    if (was.dp > 0 && bn * is.dp != bs * was.dp)
      out.push_back("global batch (" + node + "): " + global(bn, is.dp) + " a step; the checkpoint's run had " +
                    global(bs, was.dp) + " (" + k + " is per rank)");
    else if (bn != bs)
      out.push_back("global batch (" + node + "): " + global(bn, is.dp) + " a step" +
                    (was.dp > 0 ? ", as in the checkpoint's run (" + global(bs, was.dp) + ")"
                                : "; the checkpoint's run had " + k + " " + std::to_string(bs)));
  }
  // Every other setting, where it was in effect.
  static const std::set<std::string> kHow = {"run.steps",   "run.resume",  "run.progress", "run.trace",
                                             "run.profile", "run.out_dir", "run.workers",  "run.threads",
                                             "run.comm_timeout_s", "run.heartbeat_timeout_s", "run.stop_grace_s", "run.log_every", "run.prefetch", "run.compute_thread", "run.cuda_graph", "run.cpu_gemm",
                                             "run.parallel.tp", "run.parallel.pp"};  // the mesh line above
  const bool pipelined = was.pp > 1 || is.pp > 1;  // run.parallel's other settings are the pipeline's
  // 1.0e-2 and 0.01 are one setting.
  auto same = [](const std::string& x, const std::string& y) {
    if (x == y) return true;
    char* ex = nullptr;
    char* ey = nullptr;
    const double dx = std::strtod(x.c_str(), &ex), dy = std::strtod(y.c_str(), &ey);
    return ex != x.c_str() && *ex == 0 && ey != y.c_str() && *ey == 0 && dx == dy;
  };
  auto relevant = [&](const std::string& k) {
    const size_t dot = k.rfind('.');
    if (kHow.count(k) || folded.count(k) || (dot == std::string::npos ? k : k.substr(dot + 1)) == "doc") return false;
    return pipelined || k.rfind("run.parallel.", 0) != 0;
  };
  for (const auto& [k, v] : b) {
    if (!relevant(k)) continue;
    auto it = a.find(k);
    if (it == a.end())
      out.push_back(k + ": " + v + " (not in the checkpoint's settings)");
    else if (!same(it->second, v))
      out.push_back(k + ": " + v + " (the checkpoint's run had " + it->second + ")");
  }
  for (const auto& [k, v] : a)
    if (relevant(k) && !b.count(k)) out.push_back(k + ": gone (the checkpoint's run had " + v + ")");
  return out;
}

void restore(Executor& ex, const GraphSpec& g, const ResumePoint& p) {
  const CheckpointReader reader(p.folder);
  const ckpt::Manifest& m = reader.manifest();
  // Settings that differ from the run that wrote the checkpoint: allowed (a new lr for the rest
  // of a run is a common recipe), never silent.
  if (!m.config.empty()) {
    std::vector<std::string> batch_keys;  // the data sources' batch, per rank
    for (const NodeSpec* n : parallel::batch_sources(g)) batch_keys.push_back(n->name + ".batch");
    const std::vector<std::string> changed =
        changed_settings({m.config, m.world}, {to_yaml(resolved_config(g)), ex.info().world}, batch_keys);
    if (!changed.empty()) {
      std::string list;
      for (const auto& c : changed) list += "\n  " + c;
      spdlog::warn("resuming from {} with settings that differ from the run that wrote it:{}", p.folder, list);
    }
  }
  // Every state this graph checkpoints must be there (a changed graph is caught here).
  for (const NodeSpec* n : checkpoint_nodes(g))
    if (const InputSpec* in = n->input("state"))
      for (const auto& r : in->refs)
        if (!m.states.count(r.str()))
          throw std::runtime_error("checkpoint " + p.folder + " has no state '" + r.str() +
                                   "', which node '" + n->name + "' saves; it was written by another graph?");
  // Each state reads what this rank holds of it (StateIO::load_from: only its boxes of the saved
  // chunks, whatever layout wrote them), or its tensors whole.
  for (const auto& [ref, _] : m.states) {
    const size_t dot = ref.find('.');
    Value* v = nullptr;
    try {
      v = &ex.state(ref.substr(0, dot), ref.substr(dot + 1));
    } catch (const std::exception&) {
      throw std::runtime_error("checkpoint " + p.folder + " holds state '" + ref + "', which this graph does not have");
    }
    const StateIO* io = find_state_io(*v);
    if (!io) throw std::runtime_error("state '" + ref + "' (" + v->type_name() + ") cannot be restored: no StateIO");
    const std::unique_ptr<StateSource> src = reader.state(ref);
    try {
      if (io->load_from) {
        io->load_from(*v, *src);
      } else {
        NamedTensors whole;
        for (const auto& name : src->names()) whole[name] = src->whole(name);
        io->load(*v, whole);
      }
    } catch (const DamagedCheckpoint&) {
      throw;
    } catch (const std::exception& e) {
      throw std::runtime_error("restoring '" + ref + "' from " + src->where() + ": " + e.what());
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

namespace flowrun {

std::string prepare_run_logs(const std::string& out_dir, int64_t first_step) {
  const fs::path dir(out_dir.empty() ? "." : out_dir);
  const fs::path metrics = dir / "metrics.jsonl", tb = dir / "tb";
  // Only what an earlier run wrote: a regular file and a folder (a link the user put there, to a
  // shared log or a device, is theirs and stays).
  const bool metrics_file = fs::is_regular_file(fs::symlink_status(metrics));
  std::string done;
  if (first_step <= 1) {
    const std::string stamp = local_timestamp();
    if (metrics_file) {
      const std::string to = move_aside(metrics.string(), (dir / ("metrics.previous-" + stamp)).string(), ".jsonl");
      done += "the earlier run's metrics.jsonl moved to " + to;
    }
    if (fs::is_directory(fs::symlink_status(tb)) && !fs::is_empty(tb)) {
      const std::string to = move_aside(tb.string(), (dir / ("tb.previous-" + stamp)).string());
      done += std::string(done.empty() ? "" : "; ") + "its TensorBoard events (tb/) to " + to;
    }
    return done;
  }
  if (!metrics_file) return "";
  std::istringstream in(read_file(metrics.string()));
  std::string line, kept;
  int64_t dropped = 0;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() >= first_step) {
      ++dropped;
      continue;
    }
    kept += line + "\n";
  }
  if (dropped == 0) return "";
  write_file_atomic(metrics.string(), kept);
  return "metrics.jsonl: dropped " + std::to_string(dropped) + " line(s) of steps from " + std::to_string(first_step) +
         " on, logged by the stopped run after its checkpoint (this run logs them again)";
}

}  // namespace flowrun
