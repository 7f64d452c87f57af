// `flowrun ckpt export GRAPH FOLDER OUT [KEY=VALUE ...]`: a checkpoint's models as the folders
// their libraries load, outside a run: a Hugging Face folder (config.json, model.safetensors)
// for a model without adapters, PEFT's adapter folder for one with LoRA adapters. What the
// checkpoint node's `exports: true` writes during a run, from a checkpoint written at any layout.
//
// A checkpoint holds tensors by name; what makes them a Hugging Face or PEFT folder (the config,
// the names the library expects, the adapters' settings, the tokenizer files beside the weights)
// is the model node's, so the graph that wrote the checkpoint is built again, as one process:
//   1. the graph loaded with the user's overrides (those the run had), then one process's layout
//      (run.parallel.* and every zero node's stage reset) and run.resume=FOLDER, in a scratch
//      out_dir beside OUT;
//   2. a run of no step (RunSession::setup_only): every node set up and the checkpoint restored
//      into it, re-sharded to one process as any resume is (settings that differ from the
//      checkpoint's run are warned about, as at a resume);
//   3. each state the checkpoint holds whose model offers an export (ModelState::exporter) writes
//      it: in OUT itself for one, in OUT/REF for several (as the checkpoint node lays them out);
//   4. OUT.tmp renamed to OUT at the end: a failure leaves no OUT, and the scratch folder is removed.
#include <spdlog/spdlog.h>

#include <filesystem>
#include <string>
#include <vector>

#include "args.hpp"
#include "comm.hpp"
#include "commands.hpp"
#include "executor.hpp"
#include "formats/checkpoint_io.hpp"
#include "models/model_state.hpp"
#include "run_session.hpp"
#include "spec.hpp"
#include "state/ckpt_command.hpp"

namespace flowrun::cli {

namespace fs = std::filesystem;

namespace {

const char* kExportUsage =
    "usage: flowrun ckpt export GRAPH.yaml FOLDER OUT [KEY=VALUE ...]\n"
    "  the models of checkpoint FOLDER (a step_* folder, or a folder holding `latest`) as the folders\n"
    "  their libraries load: a Hugging Face folder (from_pretrained), or PEFT's adapter folder for a\n"
    "  model with LoRA adapters; one model in OUT, several in OUT/REF. GRAPH and the overrides: those\n"
    "  of the run that wrote it (its layout need not be given: the export runs as one process).\n";

// Step 1 of the top: the user's overrides but their layout, then one process's.
std::vector<std::string> export_overrides(const std::string& graph, const std::vector<std::string>& user,
                                          const std::string& folder, const std::string& scratch) {
  std::vector<std::string> o;
  for (const auto& x : user)
    if (x.rfind("run.parallel.", 0) != 0) o.push_back(x);
  GraphSpec g;
  if (!load(graph, o, g)) throw std::invalid_argument(graph + " does not load with these overrides (above)");
  for (const NodeSpec& n : g.nodes)
    if (n.type == "zero") o.push_back(n.name + ".stage=none");
  for (const char* x : {"run.parallel.tp=1", "run.parallel.pp=1", "run.parallel.microbatches=1",
                        "run.parallel.virtual_stages=1", "run.parallel.stage_layers=[]", "run.progress=off"})
    o.emplace_back(x);
  o.push_back("run.resume=" + folder);
  o.push_back("run.out_dir=" + scratch);
  return o;
}

}  // namespace

int cmd_ckpt_export(const std::vector<std::string>& args) {
  if (wants_help(args)) {
    std::fputs(kExportUsage, stdout);
    return 0;
  }
  if (args.size() < 3) return usage_error("ckpt export", "expected GRAPH.yaml FOLDER OUT", kExportUsage);
  for (size_t i = 3; i < args.size(); ++i)
    if (args[i].find('=') == std::string::npos)
      return usage_error("ckpt export", "unexpected argument '" + args[i] + "' (overrides are KEY=VALUE)", kExportUsage);
  if (comm::distributed()) {
    spdlog::error("flowrun ckpt export runs as one process (it reads the checkpoint at any layout); run it without mpirun");
    return 2;
  }
  const std::string& graph = args[0];
  const std::string out = fs::path(args[2]).lexically_normal().string();
  if (fs::exists(out)) {
    std::fprintf(stderr, "flowrun ckpt export: %s is already there; give a new folder\n", out.c_str());
    return 2;
  }
  const std::string tmp = out + ".tmp", scratch = out + ".run.tmp";
  struct Cleanup {  // the scratch run's folder, the half-written OUT.tmp, and the log level, whatever happens
    std::string tmp, scratch;
    spdlog::level::level_enum level = spdlog::get_level();
    ~Cleanup() {
      spdlog::set_level(level);
      std::error_code ec;
      fs::remove_all(tmp, ec);
      fs::remove_all(scratch, ec);
    }
  } cleanup{tmp, scratch};
  std::string folder;
  ckpt::Manifest manifest;
  std::vector<std::string> o;
  try {
    folder = ckpt_step_folder(args[1]);
    manifest = ckpt::read_manifest(folder);
    fs::remove_all(tmp);
    fs::remove_all(scratch);
    o = export_overrides(graph, {args.begin() + 3, args.end()}, fs::absolute(folder).string(), scratch);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flowrun ckpt export: %s\n", e.what());
    return 2;
  }
  GraphSpec g;
  if (!load(graph, o, g)) return 2;

  // Steps 2 and 3: set up, restore, and write what each model exports.
  std::vector<std::string> exported;
  std::string failure;
  RunSession session(&g);
  session.setup_only = true;
  session.on_setup = [&](Executor& ex) {
    std::vector<std::pair<std::string, ModelState::ExportWriter>> writers;
    for (const auto& [ref, _] : manifest.states) {
      const size_t dot = ref.find('.');
      const Value& v = ex.state(ref.substr(0, dot), ref.substr(dot + 1));
      if (!v.is<std::shared_ptr<ModelState>>()) continue;
      const auto& model = v.as<std::shared_ptr<ModelState>>();
      if (model && model->exporter)
        if (ModelState::ExportWriter w = model->exporter(*model)) writers.emplace_back(ref, std::move(w));
    }
    if (writers.empty()) {
      std::string refs;
      for (const auto& [ref, _] : manifest.states) refs += (refs.empty() ? "" : ", ") + ref;
      failure = "none of the states of " + folder + " (" + refs +
                ") is a model that exports a folder (a model with LoRA adapters exports PEFT's adapters; gpt and "
                "llama without adapters a Hugging Face folder); `flowrun ckpt consolidate FOLDER OUT.safetensors "
                "--state REF` writes a state's tensors whole";
      return;
    }
    for (const auto& [ref, write] : writers) {
      write(writers.size() == 1 ? tmp : tmp + "/" + ref);
      exported.push_back(writers.size() == 1 ? out : out + "/" + ref);
    }
  };
  spdlog::set_level(spdlog::level::warn);  // the run's own lines are not the export's output
  int code = 0;
  if (auto end = session.start()) code = *end;
  else code = session.run();
  spdlog::set_level(cleanup.level);
  if (!failure.empty()) {
    std::fprintf(stderr, "flowrun ckpt export: %s\n", failure.c_str());
    return 2;
  }
  if (code != 0 || exported.empty()) {
    std::fprintf(stderr, "flowrun ckpt export: building %s to read %s failed (exit %d; the log above); the graph and "
                         "overrides must be those of the run that wrote it\n", graph.c_str(), folder.c_str(), code);
    return code != 0 ? code : 1;
  }
  // Step 4.
  try {
    fs::rename(tmp, out);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flowrun ckpt export: %s\n", e.what());
    return 1;
  }
  for (const auto& dir : exported)
    std::printf("%s: step %lld of %s\n", dir.c_str(), static_cast<long long>(manifest.step), folder.c_str());
  return 0;
}

}  // namespace flowrun::cli
