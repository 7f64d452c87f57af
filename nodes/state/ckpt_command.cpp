#include "state/ckpt_command.hpp"

#include <cstdio>
#include <filesystem>
#include <stdexcept>

#include "common/safetensors.hpp"
#include "formats/checkpoint_io.hpp"
#include "formats/crc32c.hpp"
#include "formats/files.hpp"
#include "state/checkpoint_read.hpp"
#include "state/resume.hpp"

namespace flowrun {

namespace fs = std::filesystem;

namespace {

const char* kCkptUsage =
    "usage: flowrun ckpt list DIR                 the step folders of DIR (checkpoints/ or a run's out_dir)\n"
    "       flowrun ckpt verify FOLDER|DIR        every file read whole against its size and CRC32C\n"
    "       flowrun ckpt consolidate FOLDER OUT   one process's checkpoint in OUT: a file per state, tensors whole\n"
    "       flowrun ckpt consolidate FOLDER OUT.safetensors --state REF   one state whole in one file\n"
    "       flowrun ckpt export GRAPH.yaml FOLDER OUT [KEY=VALUE ...]   the models as Hugging Face / PEFT folders\n"
    "FOLDER: a step_* folder, or a folder holding `latest` (its newest). Exit: 0 ok, 1 damaged or failed, 2 usage.\n";

// DIR itself when it holds step folders, else DIR/checkpoints.
std::string checkpoints_dir(const std::string& dir) {
  if (!ckpt::checkpoints(dir).empty() || !fs::exists(dir + "/checkpoints")) return dir;
  return dir + "/checkpoints";
}

int list(const std::string& arg) {
  const std::string dir = checkpoints_dir(arg);
  const auto found = ckpt::checkpoints(dir);
  if (found.empty()) {
    std::fprintf(stderr, "flowrun ckpt list: no step folders in %s\n", dir.c_str());
    return 2;
  }
  const std::string latest = ckpt::latest(dir);
  std::printf("%-16s %8s %7s %-18s %6s %12s  %s\n", "folder", "step", "version", "mesh", "files", "bytes", "state");
  for (const auto& f : found) {
    const std::string name = fs::path(f.folder).filename().string();
    if (!f.problem.empty()) {
      std::printf("%-16s %8s %7s %-18s %6s %12s  incomplete: %s\n", name.c_str(), "-", "-", "-", "-", "-", f.problem.c_str());
      continue;
    }
    const ckpt::Manifest m = ckpt::read_manifest(f.folder);
    int64_t bytes = 0;
    for (const auto& [_, e] : m.files) bytes += e.bytes;
    std::string mesh = m.world > 0 ? std::to_string(m.world) + " proc" : "?";
    if (!m.mesh.empty())
      mesh = "dp" + std::to_string(m.mesh.count("dp") ? m.mesh.at("dp") : 1) + " tp" +
             std::to_string(m.mesh.count("tp") ? m.mesh.at("tp") : 1) + " pp" + std::to_string(m.mesh.count("pp") ? m.mesh.at("pp") : 1);
    std::printf("%-16s %8lld %7d %-18s %6zu %12lld  complete%s\n", name.c_str(), static_cast<long long>(m.step), m.version,
                mesh.c_str(), m.version >= 2 ? m.files.size() : m.states.size() + (m.rng_file.empty() ? 0 : 1),
                static_cast<long long>(bytes), name == latest ? " (latest)" : "");
  }
  return 0;
}

int verify(const std::string& arg) {
  std::vector<std::string> folders;
  if (fs::exists(arg + "/manifest.json")) {
    folders.push_back(arg);
  } else {
    for (const auto& f : ckpt::checkpoints(checkpoints_dir(arg))) folders.push_back(f.folder);
    if (folders.empty()) {
      std::fprintf(stderr, "flowrun ckpt verify: %s is not a checkpoint folder and holds no step folders\n", arg.c_str());
      return 2;
    }
  }
  int damaged = 0;
  for (const auto& folder : folders) {
    std::string problem;
    try {
      const ckpt::Manifest m = ckpt::read_manifest(folder);
      if (m.version < 2) {
        std::printf("%s: version 1 (no checksums): not verified\n", folder.c_str());
        continue;
      }
      problem = verify_checkpoint(folder, nullptr);
    } catch (const std::exception& e) {
      problem = e.what();
    }
    if (problem.empty()) {
      std::printf("%s: every file matches its size and CRC32C\n", folder.c_str());
    } else {
      std::printf("%s: DAMAGED: %s\n", folder.c_str(), problem.c_str());
      ++damaged;
    }
  }
  return damaged > 0 ? 1 : 0;
}

// A state's tensors whole (one state in memory at a time).
safetensors::Tensors whole_state(const CheckpointReader& r, const std::string& ref) {
  safetensors::Tensors out;
  const auto src = r.state(ref);
  for (const auto& name : src->names()) out[name] = src->whole(name);
  return out;
}

int consolidate(const std::string& from, const std::string& out, const std::string& state) {
  const std::string folder = ckpt_step_folder(from);
  const CheckpointReader r(folder);
  const ckpt::Manifest& m = r.manifest();
  if (!state.empty()) {
    if (!m.states.count(state)) {
      std::string have;
      for (const auto& [ref, _] : m.states) have += (have.empty() ? "" : ", ") + ref;
      std::fprintf(stderr, "flowrun ckpt consolidate: %s has no state '%s' (it has %s)\n", folder.c_str(), state.c_str(), have.c_str());
      return 2;
    }
    safetensors::save(out, whole_state(r, state), {{"ref", state}, {"step", std::to_string(m.step)}});
    std::printf("%s: state %s of step %lld, whole\n", out.c_str(), state.c_str(), static_cast<long long>(m.step));
    return 0;
  }
  // A complete checkpoint of one process: written beside OUT, renamed into place at the end.
  if (fs::exists(out)) {
    std::fprintf(stderr, "flowrun ckpt consolidate: %s is already there; give a new folder\n", out.c_str());
    return 2;
  }
  const std::string tmp = out + ".tmp";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  ckpt::Manifest c;
  c.step = m.step;
  c.graph = m.graph;
  c.name = m.name;
  c.config = m.config;
  c.world = 1;
  c.mesh = {{"dp", 1}, {"tp", 1}, {"pp", 1}};
  auto add_file = [&](const std::string& file, const safetensors::Written& w) {
    c.files[file] = {static_cast<int64_t>(w.bytes), crc32c_hex(w.crc32c), 0, ""};
  };
  for (const auto& [ref, _] : m.states) {
    const safetensors::Tensors t = whole_state(r, ref);
    const std::string file = ref + ".safetensors";
    safetensors::Written w;
    safetensors::save(tmp + "/" + file, t, {{"ref", ref}, {"step", std::to_string(m.step)}}, &w);
    add_file(file, w);
    c.states[ref] = "";
    auto& entries = c.tensors[ref];
    for (const auto& [name, x] : t)
      entries[name] = {safetensors::dtype_name(x.scalar_type()), x.sizes().vec(),
                       {{file, name, std::vector<int64_t>(static_cast<size_t>(x.dim()), 0), x.sizes().vec(),
                         crc32c_hex(w.tensor_crc32c.at(name))}}};
  }
  if (!m.rng_file.empty()) {
    safetensors::Written w;
    safetensors::save(tmp + "/rng.safetensors", safetensors::load(folder + "/" + m.rng_file).tensors, {}, &w);
    add_file("rng.safetensors", w);
    c.rng_file = "rng.safetensors";
  }
  ckpt::write_manifest(tmp, c);
  ckpt::read_manifest(tmp);
  fs::rename(tmp, out);
  std::printf("%s: step %lld of %s as one process's checkpoint (%zu states, tensors whole)\n", out.c_str(),
              static_cast<long long>(m.step), folder.c_str(), c.states.size());
  return 0;
}

}  // namespace

std::string ckpt_step_folder(const std::string& path) {
  if (fs::exists(path + "/manifest.json") || fs::path(path).filename().string().rfind("step_", 0) == 0) return path;
  const std::string dir = checkpoints_dir(path);
  const std::string latest = ckpt::latest(dir);
  if (latest.empty()) throw std::invalid_argument(path + " is not a checkpoint folder (no manifest.json) and holds no `latest`");
  return dir + "/" + latest;
}

int ckpt_command(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::fputs(kCkptUsage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  try {
    if (args[0] == "list" && args.size() == 2) return list(args[1]);
    if (args[0] == "verify" && args.size() == 2) return verify(args[1]);
    if (args[0] == "consolidate" && (args.size() == 3 || (args.size() == 5 && args[3] == "--state")))
      return consolidate(args[1], args[2], args.size() == 5 ? args[4] : "");
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "flowrun ckpt %s: %s\n", args[0].c_str(), e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flowrun ckpt %s: %s\n", args[0].c_str(), e.what());
    return 1;
  }
  std::fprintf(stderr, "flowrun ckpt: bad usage\n\n%s", kCkptUsage);
  return 2;
}

}  // namespace flowrun
