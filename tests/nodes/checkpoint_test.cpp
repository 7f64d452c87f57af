// checkpoint + run.resume, through the flowrun binary as a user runs it:
//   - 20 steps straight == 10 steps, then resume to 20: bit-identical parameters, optimizer
//     moments, EMA and losses (CPU);
//   - a run killed with SIGKILL while writing checkpoints resumes from the last complete one,
//     and ends bit-identical to the uninterrupted run;
//   - layout: manifest, latest, keep_last.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include "common/safetensors.hpp"
#include "data_test_helpers.hpp"
#include "formats/checkpoint_io.hpp"
#include "state/resume.hpp"
#include "support/run_graph.hpp"

namespace fs = std::filesystem;
using namespace flowrun;

extern char** environ;

namespace {

const std::string kFlowrun = std::string(FLOWRUN_BINARY_DIR) + "/engine/flowrun";
using test::run_flowrun;

const char* kGraph = R"(flowrun: 1
name: ckpt_regression
run: { steps: 20, seed: 3, prefetch: 2, log_every: 1, progress: off }
nodes:
  data:  { type: synthetic_regression, with: { in_dim: 8, out_dim: 1, batch: 64, hidden: 16, noise: 0.01 } }
  model: { type: mlp, with: { in_dim: 8, hidden: 32, layers: 2, out_dim: 1 } }
  loss:  { type: mse_loss }
  fb:    { type: forward_backward, in: { batch: data.batch, objective: loss.objective, model: model.params } }
  opt:   { type: optimizer, in: { grads: fb.grads, model: model.params }, with: { kind: adamw, lr: 1.0e-2, weight_decay: 0.01 } }
  ema:   { type: ema, in: { model: model.params }, with: { decay: 0.9 } }
  log:   { type: metrics, in: { loss: fb.loss } }
  ckpt:  { type: checkpoint, every: 5, at: [end], in: { state: [model.params, opt.state, ema.params, data.cursor] },
           with: { keep_last: 2 } }
)";

std::string write_graph(const std::string& dir) {
  std::ofstream(dir + "/g.yaml") << kGraph;
  return dir + "/g.yaml";
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::map<int64_t, double> losses(const std::string& out_dir) {
  std::map<int64_t, double> m;
  for (const auto& j : test::read_jsonl(out_dir + "/metrics.jsonl")) m[j["step"].get<int64_t>()] = j["loss"].get<double>();
  return m;
}

// Every tensor of every state file in a checkpoint folder, keyed "file/tensor".
std::map<std::string, torch::Tensor> checkpoint_tensors(const std::string& folder) {
  std::map<std::string, torch::Tensor> all;
  for (const auto& e : fs::directory_iterator(folder)) {
    if (e.path().extension() != ".safetensors" || e.path().filename() == "rng.safetensors") continue;
    for (const auto& [k, t] : safetensors::load(e.path().string()).tensors) all[e.path().filename().string() + "/" + k] = t;
  }
  return all;
}

void expect_identical(const std::string& a, const std::string& b) {
  auto ta = checkpoint_tensors(a), tb = checkpoint_tensors(b);
  ASSERT_EQ(ta.size(), tb.size());
  ASSERT_GT(ta.size(), 10u);
  for (const auto& [k, t] : ta) {
    ASSERT_TRUE(tb.count(k)) << k;
    EXPECT_TRUE(torch::equal(t, tb.at(k))) << k << " differs";
  }
}

}  // namespace

TEST(Checkpoint, ResumeIsBitIdenticalToAnUninterruptedRun) {
  const std::string dir = test::temp_dir("ckpt");
  const std::string g = write_graph(dir);
  ASSERT_EQ(run_flowrun({g, "run.out_dir=" + dir + "/straight"}, dir + "/a.log"), 0) << slurp(dir + "/a.log");
  ASSERT_EQ(run_flowrun({g, "run.out_dir=" + dir + "/split", "run.steps=10"}, dir + "/b1.log"), 0) << slurp(dir + "/b1.log");
  EXPECT_EQ(ckpt::latest(dir + "/split/checkpoints"), "step_00000010");
  ASSERT_EQ(run_flowrun({g, "run.out_dir=" + dir + "/split", "run.resume=auto"}, dir + "/b2.log"), 0) << slurp(dir + "/b2.log");
  EXPECT_NE(slurp(dir + "/b2.log").find("resumed from " + dir + "/split/checkpoints/step_00000010 (step 10)"), std::string::npos)
      << slurp(dir + "/b2.log");
  expect_identical(dir + "/straight/checkpoints/step_00000020", dir + "/split/checkpoints/step_00000020");
  auto la = losses(dir + "/straight"), lb = losses(dir + "/split");
  ASSERT_EQ(la.size(), 20u);
  ASSERT_EQ(lb.size(), 20u);  // 1..10 from the first part, 11..20 appended by the resumed run
  for (int64_t s = 1; s <= 20; ++s) EXPECT_EQ(la[s], lb[s]) << "loss at step " << s;
  // Nothing left to do: a second resume exits 0 without running.
  ASSERT_EQ(run_flowrun({g, "run.out_dir=" + dir + "/split", "run.resume=auto"}, dir + "/b3.log"), 0);
  EXPECT_NE(slurp(dir + "/b3.log").find("nothing to do"), std::string::npos);
}

// The same guarantee on graphs/gpt.yaml itself (token shards, gpt, AdamW with warmup + cosine,
// EMA), shrunk by overrides: 20 steps straight == 10 + resume + 10, bit for bit.
TEST(Checkpoint, GptGraphResumesBitIdentically) {
  const std::string src = FLOWRUN_SOURCE_DIR;
  const std::string shards = src + "/data/text/fortunes_byte";
  FLOWRUN_NEEDS_DATA(shards + ".train.bin");
  const std::string dir = test::temp_dir("ckpt_gpt");
  const std::vector<std::string> tiny = {src + "/graphs/gpt.yaml", "data.path=" + shards, "data.seq_len=16", "data.batch=4",
                                         "model.layers=1", "model.dim=32", "model.heads=2", "model.vocab=256",
                                         "model.context=16", "opt.warmup=5", "ckpt.every=10", "run.log_every=1",
                                         "run.progress=off"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = tiny;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  ASSERT_EQ(run_flowrun(with({"run.out_dir=" + dir + "/straight", "run.steps=20"}), dir + "/a.log"), 0) << slurp(dir + "/a.log");
  // The interrupted run: same run.steps (the cosine schedule depends on it); we keep only its
  // checkpoint of step 10, as if it had died after writing it, and resume from there.
  ASSERT_EQ(run_flowrun(with({"run.out_dir=" + dir + "/split", "run.steps=20", "ckpt.every=10"}), dir + "/b1.log"), 0);
  fs::remove_all(dir + "/split/checkpoints/step_00000020");
  ckpt::set_latest(dir + "/split/checkpoints", "step_00000010");
  // Forget what the first part logged after step 10: the resumed run must produce it again.
  {
    auto lines = test::read_jsonl(dir + "/split/metrics.jsonl");
    std::ofstream o(dir + "/split/metrics.jsonl", std::ios::trunc);
    for (const auto& j : lines)
      if (j["step"].get<int64_t>() <= 10) o << j.dump() << "\n";
  }
  ASSERT_EQ(run_flowrun(with({"run.out_dir=" + dir + "/split", "run.steps=20", "run.resume=auto"}), dir + "/b2.log"), 0)
      << slurp(dir + "/b2.log");
  EXPECT_NE(slurp(dir + "/b2.log").find("(step 10)"), std::string::npos);
  expect_identical(dir + "/straight/checkpoints/step_00000020", dir + "/split/checkpoints/step_00000020");
  auto la = losses(dir + "/straight"), lb = losses(dir + "/split");
  ASSERT_EQ(la.size(), 20u);
  ASSERT_EQ(lb.size(), 20u);
  for (int64_t s = 1; s <= 20; ++s) EXPECT_EQ(la[s], lb[s]) << "loss at step " << s;
}

TEST(Checkpoint, LayoutManifestAndKeepLast) {
  const std::string dir = test::temp_dir("ckpt");
  const std::string g = write_graph(dir);
  ASSERT_EQ(run_flowrun({g, "run.out_dir=" + dir + "/o"}, dir + "/a.log"), 0) << slurp(dir + "/a.log");
  std::vector<std::string> folders;
  for (const auto& e : fs::directory_iterator(dir + "/o/checkpoints")) folders.push_back(e.path().filename().string());
  std::sort(folders.begin(), folders.end());
  EXPECT_EQ(folders, (std::vector<std::string>{"latest", "step_00000015", "step_00000020"}));  // keep_last: 2
  ckpt::Manifest m = ckpt::read_manifest(dir + "/o/checkpoints/step_00000020");
  EXPECT_EQ(m.step, 20);
  EXPECT_EQ(m.name, "ckpt_regression");
  EXPECT_EQ(m.states.size(), 4u);
  // One process: a file per state, its tensors whole (issue 72: with several, a file per rank).
  EXPECT_EQ(m.version, 2);
  ASSERT_TRUE(m.files.count("model.params.safetensors"));
  const ckpt::TensorEntry& w = m.tensors.at("model.params").at("0.weight");
  ASSERT_EQ(w.chunks.size(), 1u);
  EXPECT_EQ(w.chunks[0].file, "model.params.safetensors");
  EXPECT_EQ(w.chunks[0].sizes, w.shape);
  EXPECT_NE(m.config.find("keep_last: 2"), std::string::npos);
  EXPECT_EQ(m.world, 1);  // the processes that wrote it: resume compares layouts
  auto cursor = safetensors::load(dir + "/o/checkpoints/step_00000020/data.cursor.safetensors");
  EXPECT_EQ(cursor.tensors.at("batches").item<int64_t>(), 20);
  EXPECT_EQ(cursor.metadata.at("ref"), "data.cursor");
}

// exports: true on states that offer nothing to export (no LoRA model among them) would
// silently write nothing: refused before step 1, naming the states.
TEST(Checkpoint, ExportsWithNothingToExportIsRefusedAtStart) {
  const std::string dir = test::temp_dir("ckpt");
  const std::string g = write_graph(dir);
  EXPECT_EQ(run_flowrun({g, "run.out_dir=" + dir + "/o", "ckpt.exports=true"}, dir + "/a.log"), 1);
  const std::string log = slurp(dir + "/a.log");
  EXPECT_NE(log.find("node 'ckpt' (checkpoint) failed in setup: exports: true, but none of the states it saves "
                     "(model.params, opt.state, ema.params, data.cursor) offers files to export"),
            std::string::npos)
      << log;
  EXPECT_TRUE(slurp(dir + "/o/metrics.jsonl").empty()) << "it ran steps before refusing";
}

TEST(Checkpoint, ResumeFromAnotherGraphIsAClearError) {
  const std::string dir = test::temp_dir("ckpt");
  const std::string g = write_graph(dir);
  ASSERT_EQ(run_flowrun({g, "run.out_dir=" + dir + "/o", "run.steps=5"}, dir + "/a.log"), 0);
  // Same folder, but the graph's model is bigger now.
  EXPECT_EQ(run_flowrun({g, "run.out_dir=" + dir + "/o", "run.resume=auto", "model.hidden=48"}, dir + "/b.log"), 1);
  const std::string b = slurp(dir + "/b.log");
  EXPECT_NE(b.find("restoring '"), std::string::npos) << b;
  EXPECT_NE(b.find("tensor '0.bias' has shape [48], the one given has [32]"), std::string::npos) << b;
  EXPECT_EQ(run_flowrun({g, "run.out_dir=" + dir + "/o", "run.resume=" + dir + "/nope"}, dir + "/c.log"), 2);
  EXPECT_NE(slurp(dir + "/c.log").find("run.resume: no checkpoint folder " + dir + "/nope"), std::string::npos);
}

// Issue 47: an opt.state lacking a moment resumed with it at zero, a transposed moment of the
// same size was taken, NaN moments or weights loaded silently. Each is refused at resume, naming
// the file and the tensor, and the run does not start.
TEST(Checkpoint, DamagedStateFilesAreRefusedNamingFileAndTensor) {
  const std::string dir = test::temp_dir("ckpt");
  const std::string g = write_graph(dir);
  ASSERT_EQ(run_flowrun({g, "run.out_dir=" + dir + "/o", "run.steps=5"}, dir + "/a.log"), 0) << slurp(dir + "/a.log");
  const std::string folder = dir + "/o/checkpoints/step_00000005";
  // The files edited by hand, under a version 1 manifest (a file per state, no checksums: a
  // version 2 one would refuse them as damaged before any tensor is read, ckpt_damage in
  // tests/mpi), so each state's own checks are what answers.
  ckpt::Manifest m = ckpt::read_manifest(folder);
  m.version = 1;
  for (auto& [ref, file] : m.states) file = ref + ".safetensors";
  ckpt::write_manifest(folder, m);
  const std::string opt_file = folder + "/opt.state.safetensors";
  const std::string model_file = folder + "/model.params.safetensors";
  const auto opt = safetensors::load(opt_file).tensors;
  const auto model = safetensors::load(model_file).tensors;
  ASSERT_TRUE(opt.count("0.weight.exp_avg"));  // [32, 8]
  using Damage = std::function<void(safetensors::Tensors&)>;
  struct Case {
    std::string file;
    Damage damage;
    std::string expect;
  } cases[] = {
      {opt_file, [](auto& t) { t.erase("0.weight.exp_avg_sq"); }, "tensor '0.weight.exp_avg_sq' is missing"},
      {opt_file, [](auto& t) { t["0.weight.exp_avg"] = t["0.weight.exp_avg"].t().contiguous(); },
       "tensor '0.weight.exp_avg' has shape [8, 32], expected [32, 8]"},
      {opt_file, [](auto& t) { t["0.bias.exp_avg"][3] = NAN; }, "tensor '0.bias.exp_avg' holds NaN or infinite values"},
      {opt_file, [](auto& t) { t["0.weight.momentum"] = t["0.weight.exp_avg"]; }, "unexpected tensor '0.weight.momentum'"},
      {opt_file, [](auto& t) { t.erase("0.weight.step"); }, "tensor '0.weight.step' is missing"},
      {model_file, [](auto& t) { t["0.weight"][0][0] = INFINITY; }, "tensor '0.weight' holds NaN or infinite values"},
  };
  for (const Case& c : cases) {
    auto t = c.file == opt_file ? opt : model;
    for (auto& [k, v] : t) v = v.clone();
    c.damage(t);
    safetensors::save(c.file, t);
    EXPECT_EQ(run_flowrun({g, "run.out_dir=" + dir + "/o", "run.resume=" + folder, "run.steps=8"}, dir + "/b.log"), 1);
    const std::string log = slurp(dir + "/b.log");
    EXPECT_NE(log.find(c.file), std::string::npos) << log;
    EXPECT_NE(log.find(c.expect), std::string::npos) << c.expect << "\n" << log;
    safetensors::save(c.file, c.file == opt_file ? opt : model);
  }
  // Undamaged again: it resumes.
  EXPECT_EQ(run_flowrun({g, "run.out_dir=" + dir + "/o", "run.resume=" + folder, "run.steps=8"}, dir + "/c.log"), 0)
      << slurp(dir + "/c.log");
}

TEST(Checkpoint, SigkillWhileWritingResumesFromThePreviousCheckpoint) {
  const std::string dir = test::temp_dir("ckpt");
  const std::string g = write_graph(dir);
  ASSERT_EQ(run_flowrun({g, "run.out_dir=" + dir + "/straight", "run.steps=30"}, dir + "/a.log"), 0);
  // Slow steps and slow checkpoint writes (5 files x 40 ms): a kill lands mid-write often.
  const std::string out = dir + "/killed";
  std::vector<std::string> args = {kFlowrun, g, "run.out_dir=" + out, "run.steps=30", "run.resume=auto", "data.delay_ms=15",
                                   "ckpt.write_delay_ms=40"};
  int kills = 0, resumed_from_complete = 0;
  for (int attempt = 0; attempt < 6; ++attempt) {
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, (dir + "/kill.log").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    const auto spawned = fs::file_time_type::clock::now();
    ASSERT_EQ(posix_spawn(&pid, kFlowrun.c_str(), &fa, nullptr, argv.data(), environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    // Kill it while a checkpoint folder is being written: a .step_*.tmp folder made by this
    // process (a killed one's leftover is older; the next start removes it).
    bool mid_write = false;
    for (int i = 0; i < 4000 && !mid_write; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      std::error_code ec;
      for (const auto& e : fs::directory_iterator(out + "/checkpoints", ec))
        if (e.path().filename().string().rfind(".step_", 0) == 0 && fs::last_write_time(e.path(), ec) > spawned &&
            !ckpt::latest(out + "/checkpoints").empty())  // a complete one exists to fall back to
          mid_write = true;
      if (waitpid(pid, nullptr, WNOHANG) == pid) break;  // finished before we could kill it
    }
    if (!mid_write) break;
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    if (WIFSIGNALED(status)) ++kills;  // killed mid-write
    // Whatever `latest` names is complete.
    const std::string name = ckpt::latest(out + "/checkpoints");
    if (!name.empty()) {
      ckpt::Manifest m = ckpt::read_manifest(out + "/checkpoints/" + name);  // throws if incomplete
      EXPECT_EQ(ckpt::step_folder(m.step), name);
      ++resumed_from_complete;
    }
  }
  EXPECT_GE(kills, 3) << slurp(dir + "/kill.log");
  EXPECT_GE(resumed_from_complete, 2);  // later attempts found a complete checkpoint to resume
  // Finish the run; it must end exactly where the uninterrupted one did.
  ASSERT_EQ(run_flowrun({g, "run.out_dir=" + out, "run.steps=30", "run.resume=auto"}, dir + "/final.log"), 0)
      << slurp(dir + "/final.log");
  expect_identical(dir + "/straight/checkpoints/step_00000030", out + "/checkpoints/step_00000030");
  for (const auto& e : fs::directory_iterator(out + "/checkpoints"))  // leftovers were cleaned up
    EXPECT_NE(e.path().filename().string().rfind(".step_", 0), 0u) << e.path();
}

// The warning at resume names what changed since the checkpoint's run, and only what matters:
// the layout as one mesh line, the global batch when it changes (a data source's batch is per
// rank), and settings that were in effect (issue 69: the layout was left out, and pipeline
// schedules were listed for runs without a pipeline).
TEST(Checkpoint, ResumeWarningNamesTheMeshTheGlobalBatchAndOnlySettingsInEffect) {
  auto config = [](int tp, int pp, int batch, const std::string& schedule, double lr) {
    return "run: { steps: 10, threads: 2, parallel: { tp: " + std::to_string(tp) + ", pp: " + std::to_string(pp) +
           ", microbatches: 4, schedule: " + schedule + " } }\nnodes:\n  data: { type: token_shards, with: { batch: " +
           std::to_string(batch) + " } }\n  opt: { type: optimizer, with: { lr: " + std::to_string(lr) + " } }\n";
  };
  const std::vector<std::string> data = {"data.batch"};
  // Same layout, same settings (run.steps and run.threads say how a process runs): nothing.
  EXPECT_TRUE(changed_settings({config(1, 1, 16, "1f1b", 0.1), 2}, {config(1, 1, 16, "1f1b", 0.1), 2}, data).empty());
  // dp 2 resumed by one process with the same batch per rank: the mesh, and the global batch halved.
  EXPECT_EQ(changed_settings({config(1, 1, 16, "1f1b", 0.1), 2}, {config(1, 1, 16, "1f1b", 0.1), 1}, data),
            (std::vector<std::string>{
                "processes 1 (dp 1 x pp 1 x tp 1); the checkpoint's run had 2 (dp 2 x pp 1 x tp 1)",
                "global batch (data): 16 x dp 1 = 16 a step; the checkpoint's run had 16 x dp 2 = 32 (data.batch is per rank)"}));
  // The same with the batch doubled: the global batch is kept, and said so.
  EXPECT_EQ(changed_settings({config(1, 1, 16, "1f1b", 0.1), 2}, {config(1, 1, 32, "1f1b", 0.1), 1}, data)[1],
            "global batch (data): 32 x dp 1 = 32 a step, as in the checkpoint's run (16 x dp 2 = 32)");
  // tp 2 -> pp 2 on two processes; a schedule that differs is listed only where a pipeline ran.
  EXPECT_EQ(changed_settings({config(2, 1, 16, "gpipe", 0.1), 2}, {config(1, 2, 16, "1f1b", 0.2), 2}, data),
            (std::vector<std::string>{"processes 2 (dp 1 x pp 2 x tp 1); the checkpoint's run had 2 (dp 1 x pp 1 x tp 2)",
                                      "opt.lr: 0.200000 (the checkpoint's run had 0.100000)",
                                      "run.parallel.schedule: 1f1b (the checkpoint's run had gpipe)"}));
  EXPECT_EQ(changed_settings({config(1, 1, 16, "gpipe", 0.1), 1}, {config(1, 1, 16, "1f1b", 0.1), 1}, data),
            std::vector<std::string>{});  // pp 1 on both sides: no schedule ran
  // A manifest from before processes were recorded: the shape still compares.
  EXPECT_EQ(changed_settings({config(2, 1, 16, "1f1b", 0.1), 0}, {config(1, 1, 16, "1f1b", 0.1), 2}, data),
            std::vector<std::string>{"processes 2 (dp 2 x pp 1 x tp 1); the checkpoint's run had ? (pp 1 x tp 2; its processes "
                                     "were not recorded)"});
}
