// checkpoint: snapshot state fast, write it in the background (schemas/checkpoint.yaml).
//
// run() copies every saved tensor to CPU memory (the "snapshot") and returns; the next write of
// that state (the optimizer's) waits only for this copy, like big_vision's async checkpoints.
// A background thread writes the files; one write is in flight at a time (the next run()
// waits for the previous write: memory stays bounded). Layout: formats/checkpoint_io.hpp.
//
// Nothing written is lost: a complete step folder is never removed except by keep_last's
// pruning of this run's own. With run.resume=never the earlier run's folders stay where they are
// until this run's first checkpoint is complete; then they move, with `latest`, into
// DIR.previous-STAMP beside DIR (a run that fails before its first checkpoint has lost nothing).
// A folder of the same name that is still there when a new one is written (run.resume=PATH over
// later steps is refused at start; this is the safety net) is moved to replaced.NAME.STAMP.
//
// Several ranks: a state the ranks hold pieces of (an optimizer under a ZeRO plan) is gathered
// first by every rank (StateIO::collect, on this node's channel); otherwise the saved state is
// replicated (data cursors count global batches; params,
// optimizer moments and EMA weights are equal after every all-reduced step; the start-up sync
// makes them equal before step 1), so rank 0 alone snapshots and writes; the other ranks'
// run() returns at once. `latest` therefore moves only when that one writer has finished.
#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <chrono>
#include <filesystem>
#include <future>
#include <thread>

#include "parallel/collectives.hpp"
#include "parallel/tensor_parallel.hpp"
#include "common/device.hpp"
#include "formats/files.hpp"
#include "common/safetensors.hpp"
#include "common/state_io.hpp"
#include "models/model_state.hpp"
#include "registry.hpp"
#include "spec.hpp"
#include "formats/checkpoint_io.hpp"

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
  int world_ = 1;  // the processes of this run (the manifest records them: resume compares layouts)
  std::future<void> pending_;
  // run.resume=never: the earlier run's step folders and `latest`, moved aside by the first write.
  std::vector<std::string> earlier_;
  // Several processes: its channels to gather sharded and split states (StateIO::collect).
  std::shared_ptr<parallel::Group> dp_group_, tp_group_, pp_group_;  // tp, pp: with tp, pp > 1

 public:
  void setup(SetupContext& c) override {
    dir_ = (fs::path(c.run().out_dir) / c.params().get<std::string>("dir")).string();
    keep_ = c.params().get<int>("keep_last");
    delay_ms_ = c.params().get<int>("write_delay_ms");
    exports_ = c.params().get<bool>("exports");
    writer_rank_ = c.run().rank == 0;
    world_ = c.run().world;
    if (c.run().world > 1) {  // collective: setup runs in file order
      dp_group_ = parallel::Group::along(c.name(), parallel::mesh_of(c.run()), parallel::Dim::dp, c.run().rank);
      tp_group_ = parallel::own_tp_group(c.name(), c.run());
      pp_group_ = parallel::own_pp_group(c.name(), c.run());
    }
    if (const GraphSpec* g = c.run().graph) {
      graph_file_ = g->file;
      name_ = g->name;
      config_ = to_yaml(resolved_config(*g));
    }
    // exports: true must export something: a saved model that offers files (a LoRA model's
    // adapters); otherwise the setting would silently do nothing.
    if (exports_) {
      bool any = false;
      for (Value* v : c.states_all("state"))
        if (v->is<std::shared_ptr<ModelState>>())
          if (const auto& m = v->as<std::shared_ptr<ModelState>>(); m && m->exporter) any = true;
      if (!any) {
        std::string refs;
        for (const auto& r : c.refs("state")) refs += (refs.empty() ? "" : ", ") + r;
        throw std::runtime_error("exports: true, but none of the states it saves (" + refs +
                                 ") offers files to export (a model with LoRA adapters does: its PEFT adapter folder); "
                                 "set exports: false or save such a model");
      }
    }
    if (writer_rank_) {
      // A folder it cannot write is found now, not at the first checkpoint (issue 47: a
      // read-only checkpoints/ surfaced as a raw filesystem error at the first write).
      std::error_code ec;
      fs::create_directories(dir_, ec);
      if (ec) throw std::runtime_error("cannot make the checkpoint folder " + dir_ + ": " + ec.message());
      probe_writable(dir_);
      // Folders a killed run left half-written; `latest` never names them. With
      // run.resume=never (start over, asked for by name) the earlier run's checkpoints are noted,
      // to move aside once this run has one of its own.
      const bool start_over = c.run().graph && c.run().graph->settings.resume == "never";
      earlier_.clear();
      for (const auto& e : fs::directory_iterator(dir_)) {
        const std::string n = e.path().filename().string();
        if (n.rfind(".step_", 0) == 0) fs::remove_all(e.path());
        if (start_over && (n.rfind("step_", 0) == 0 || n == "latest")) earlier_.push_back(n);
      }
      std::sort(earlier_.begin(), earlier_.end());
      if (!earlier_.empty()) probe_writable(fs::path(dir_).parent_path().string());  // DIR.previous-STAMP goes there
      if (!earlier_.empty())
        spdlog::info("run.resume=never: the earlier run's checkpoints in {} stay until this run's first is written, then "
                     "move to {}.previous-*",
                     dir_, dir_);
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
    // A state the ranks hold pieces of (sharded by ZeRO, split over tp) is gathered first, by every rank.
    if (dp_group_)
      for (Value* v : c.states_all("state"))
        if (const StateIO* io = find_state_io(*v); io && io->collect)
          io->collect(*v, {writer_rank_, *dp_group_, tp_group_.get(), pp_group_.get()});
    // What the collect gathered, let go once copied (here at once: rank 0 writes).
    auto release = [&c] {
      for (Value* v : c.states_all("state"))
        if (const StateIO* io = find_state_io(*v); io && io->release) io->release(*v);
    };
    if (!writer_rank_) return release();  // rank 0 writes the replicated state; a copy here would be wasted
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
    release();
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

  // Creates and removes a file in `dir`: an error naming the folder when that fails.
  static void probe_writable(const std::string& dir) {
    const std::string probe = (fs::path(dir) / ".flowrun-write-probe").string();
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0)
      throw std::runtime_error("checkpoint: cannot write in " + dir + " (" + std::strerror(errno) +
                               "); checkpoints are written there: make it writable, or give another run.out_dir or dir");
    ::close(fd);
    ::unlink(probe.c_str());
  }

  void pause() const {
    if (delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
  }

  // A failed write (a full disk) removes its half-written folder and says so; `latest` still
  // names the previous checkpoint.
  void write(const Snapshot& s) {
    const std::string tmp = dir_ + "/." + ckpt::step_folder(s.step) + ".tmp";
    try {
      write_folder(s, tmp);
    } catch (const std::exception& e) {
      std::error_code ec;
      fs::remove_all(tmp, ec);
      const std::string latest = ckpt::latest(dir_);
      throw std::runtime_error("checkpoint of step " + std::to_string(s.step) + " failed: " + e.what() +
                               (ec ? "; its half-written folder " + tmp + " could not be removed: " + ec.message()
                                   : "; its half-written folder was removed") +
                               (latest.empty() ? std::string("; there is no complete checkpoint yet")
                                               : "; latest still names " + latest));
    }
  }

  void write_folder(const Snapshot& s, const std::string& tmp) {
    const auto t0 = std::chrono::steady_clock::now();
    if (s.copied) s.copied->synchronize();
    const std::string name = ckpt::step_folder(s.step);
    const std::string final_dir = dir_ + "/" + name;
    fs::remove_all(tmp);
    fs::create_directories(tmp);
    ckpt::Manifest m;
    m.step = s.step;
    m.graph = graph_file_;
    m.name = name_;
    m.config = config_;
    m.world = world_;
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
    move_earlier_aside();
    if (fs::exists(final_dir)) {  // never lose a complete folder (see the top)
      const std::string aside = move_aside(final_dir, dir_ + "/replaced." + name + "." + local_timestamp());
      spdlog::warn("checkpoint: {} was already there (written by another run); moved to {}", final_dir, aside);
    }
    fs::rename(tmp, final_dir);
    fsync_dir(dir_);
    ckpt::set_latest(dir_, name);
    prune(name);
    spdlog::info("checkpoint {} written ({:.2f} s)", final_dir,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }

  // run.resume=never, at the first write: the earlier run's folders and `latest` to
  // DIR.previous-STAMP (this run's first checkpoint is complete in its .tmp folder by now).
  void move_earlier_aside() {
    if (earlier_.empty()) return;
    const std::string to = make_new_dir(dir_ + ".previous-" + local_timestamp());
    for (const auto& n : earlier_)
      if (fs::exists(dir_ + "/" + n)) fs::rename(dir_ + "/" + n, to + "/" + n);
    fsync_dir(dir_);
    spdlog::warn("run.resume=never: the earlier run's {} checkpoint entries moved from {} to {}", earlier_.size(), dir_, to);
    earlier_.clear();
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
