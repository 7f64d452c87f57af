// checkpoint: snapshot state fast, write it in the background (schemas/checkpoint.yaml).
//
// run() copies every saved tensor to CPU memory (the "snapshot") and returns; the next write of
// that state (the optimizer's) waits only for this copy, like big_vision's async checkpoints.
// A background thread writes the files; one write is in flight at a time (the next run()
// waits for the previous write: memory stays bounded). Layout: state/checkpoint_io.hpp.
//
// Several ranks: the saved state is replicated (data cursors count global batches; params,
// optimizer moments and EMA weights are equal after every all-reduced step; the start-up sync
// makes them equal before step 1), so rank 0 alone snapshots and writes; the other ranks'
// run() returns at once. `latest` therefore moves only when that one writer has finished.
#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <future>
#include <thread>

#include "common/device.hpp"
#include "common/safetensors.hpp"
#include "common/state_io.hpp"
#include "models/model_state.hpp"
#include "registry.hpp"
#include "spec.hpp"
#include "state/checkpoint_io.hpp"

namespace flowrun {

namespace fs = std::filesystem;

namespace {

struct Snapshot {
  int64_t step = 0;
  std::vector<std::pair<std::string, NamedTensors>> states;  // ref -> CPU copies
  std::shared_ptr<DeviceEvent> copied;  // device state: the copies are done after this event
  NamedTensors rng;
  std::vector<std::pair<std::string, ModelState::ExportWriter>> exports;  // exports: ref -> its writer
};

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

class Checkpoint : public Node {
  std::string dir_, graph_file_, name_, config_;
  int keep_ = 0;  // setup: the schema's (defaults there)
  int delay_ms_ = 0;
  bool exports_ = false;
  bool writer_rank_ = true;
  std::future<void> pending_;

 public:
  void setup(SetupContext& c) override {
    dir_ = (fs::path(c.run().out_dir) / c.params().get<std::string>("dir")).string();
    keep_ = c.params().get<int>("keep_last");
    delay_ms_ = c.params().get<int>("write_delay_ms");
    exports_ = c.params().get<bool>("exports");
    writer_rank_ = c.run().rank == 0;
    if (const GraphSpec* g = c.run().graph) {
      graph_file_ = g->file;
      name_ = g->name;
      config_ = to_yaml(resolved_config(*g));
    }
    if (writer_rank_) {
      fs::create_directories(dir_);
      // Folders a killed run left half-written; `latest` never names them. With
      // run.resume=never (start over, asked for by name) also the earlier run's checkpoints.
      const bool start_over = c.run().graph && c.run().graph->run["resume"].as<std::string>("") == "never";
      int removed = 0;
      for (const auto& e : fs::directory_iterator(dir_)) {
        const std::string n = e.path().filename().string();
        if (n.rfind(".step_", 0) == 0) fs::remove_all(e.path());
        if (start_over && (n.rfind("step_", 0) == 0 || n == "latest")) removed += fs::remove_all(e.path()) > 0;
      }
      if (removed) spdlog::warn("run.resume=never: deleted the earlier run's checkpoints in {}", dir_);
      // `latest` is a one-line file this node replaces by rename; a folder there would stop it.
      const fs::path latest = fs::path(dir_) / "latest";
      if (fs::is_directory(latest)) {
        if (!fs::is_empty(latest))
          throw std::runtime_error(latest.string() + " is a folder; flowrun keeps a file of that name there (naming the "
                                   "newest checkpoint): move the folder elsewhere");
        fs::remove(latest);
      }
    }
  }

  void run(StepContext& c) override {
    if (!writer_rank_) return;  // rank 0 writes the replicated state; a copy here would be wasted
    Snapshot snap;
    snap.step = c.step();
    bool on_device = false;
    const auto refs = c.refs("state");
    const auto values = c.states_all("state");
    for (size_t i = 0; i < values.size(); ++i) {
      const StateIO* io = find_state_io(*values[i]);
      if (!io)
        throw std::runtime_error("state '" + refs[i] + "' holds a " + values[i]->type_name() +
                                 ", which registers no way to save it (FLOWRUN_STATE_TYPE in common/state_io.hpp, beside the type)");
      NamedTensors copy;
      for (const auto& [k, t] : io->tensors(*values[i])) {
        if (t.is_cpu()) {
          copy[k] = t.detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true);
          continue;
        }
        // Device state: copied into pinned host memory, queued on this node's stream (a side
        // stream in the graphs); the background writer waits for the copies, the step never.
        torch::Tensor host = torch::empty(t.sizes(), t.options().device(torch::kCPU).pinned_memory(true));
        host.copy_(t.detach(), /*non_blocking=*/true);
        copy[k] = host;
        on_device = true;
      }
      snap.states.emplace_back(refs[i], std::move(copy));
      if (exports_ && values[i]->is<std::shared_ptr<ModelState>>()) {
        const auto& model = values[i]->as<std::shared_ptr<ModelState>>();
        if (model && model->exporter)
          if (ModelState::ExportWriter w = model->exporter(*model)) snap.exports.emplace_back(refs[i], std::move(w));
      }
    }
    if (on_device) {
      snap.copied = c.record();
      if (!snap.copied) synchronize_device(run_device(c.run()));  // no device streams: wait now
    }
    snap.rng["cpu"] = torch::globalContext().defaultGenerator(torch::kCPU).get_state();
    wait();  // the previous write; rethrows its error
    pending_ = std::async(std::launch::async, [this, s = std::move(snap)]() { write(s); });
  }

  void finish(ContextBase&) override { wait(); }

 private:
  void wait() {
    if (pending_.valid()) pending_.get();
  }

  void pause() const {
    if (delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
  }

  void write(const Snapshot& s) const {
    const auto t0 = std::chrono::steady_clock::now();
    if (s.copied) s.copied->synchronize();
    const std::string name = ckpt::step_folder(s.step);
    const std::string final_dir = dir_ + "/" + name;
    const std::string tmp = dir_ + "/." + name + ".tmp";
    fs::remove_all(tmp);
    fs::create_directories(tmp);
    ckpt::Manifest m;
    m.step = s.step;
    m.graph = graph_file_;
    m.name = name_;
    m.config = config_;
    for (const auto& [ref, tensors] : s.states) {
      pause();
      const std::string file = ref + ".safetensors";
      safetensors::save(tmp + "/" + file, tensors, {{"ref", ref}, {"step", std::to_string(s.step)}});
      m.states[ref] = file;
    }
    // What the models export (exports: true): in the folder itself for one, in REF/ each for several.
    for (const auto& [ref, writer] : s.exports) {
      pause();
      writer(s.exports.size() == 1 ? tmp : tmp + "/" + ref);
    }
    pause();
    safetensors::save(tmp + "/rng.safetensors", s.rng);
    m.rng_file = "rng.safetensors";
    ckpt::write_manifest(tmp, m);  // last: a folder with a manifest is complete
    fsync_dir(tmp);
    if (fs::exists(final_dir)) fs::remove_all(final_dir);  // a rerun over an old run's folder
    fs::rename(tmp, final_dir);
    fsync_dir(dir_);
    ckpt::set_latest(dir_, name);
    prune(name);
    spdlog::info("checkpoint {} written ({:.2f} s)", final_dir,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }

  // Keep the newest keep_last step folders (never the one just written).
  void prune(const std::string& newest) const {
    std::vector<std::string> folders;
    for (const auto& e : fs::directory_iterator(dir_)) {
      const std::string n = e.path().filename().string();
      if (e.is_directory() && n.rfind("step_", 0) == 0) folders.push_back(n);
    }
    std::sort(folders.begin(), folders.end());
    const int extra = static_cast<int>(folders.size()) - keep_;
    for (int i = 0; i < extra; ++i)
      if (folders[i] != newest) fs::remove_all(dir_ + "/" + folders[i]);
  }
};

}  // namespace

FLOWRUN_NODE(checkpoint, Checkpoint)

}  // namespace flowrun
