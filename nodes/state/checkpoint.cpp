// checkpoint: snapshot state fast, write it in the background (schemas/checkpoint.yaml).
//
// run() copies every saved tensor to CPU memory (the "snapshot") and returns; the next write of
// that state (the optimizer's) waits only for this copy, like big_vision's async checkpoints.
// A background thread writes the files; one write is in flight at a time (the next run()
// waits for the previous write: memory stays bounded). Layout: formats/checkpoint_io.hpp.
//
// Several ranks (issue 72), as PyTorch's distributed checkpoint: every rank writes what it holds
// and nothing is gathered. In order:
//   1. pieces   each state lists what this rank holds as pieces of the whole tensors (StateIO::
//               pieces: its tp parts, pipeline stage, ZeRO slices; a state without it is whole);
//   2. plan     the ranks exchange the pieces' names and boxes (run(), the plan channel) and
//               each element is given to one writer: a piece one rank holds is its own; one that
//               several hold (data-parallel replicas, a tied tensor on two stages) is cut along
//               its first dimension among them, so every rank writes about 1/world of it;
//   3. snapshot each rank copies the boxes it writes, and only those;
//   4. write    in the background each rank writes its own file per state into the step's
//               .tmp folder, with the CRC32C of each chunk and of the file computed from the
//               bytes it writes, and fsyncs it;
//   5. commit   the ranks send rank 0 what they wrote (the commit channel); rank 0 writes the
//               manifest, renames the folder and moves `latest`, then tells every rank. A crash
//               at any point leaves `latest` at the previous complete checkpoint; a failure on
//               any rank fails the checkpoint on every rank.
// The folder must be one that every rank sees (a shared file system): setup checks that every
// rank sees a file rank 0 wrote there, and names the hosts that do not.
//
// Nothing written is lost: a complete step folder is never removed except by keep_last's
// pruning of this run's own. With run.resume=never the earlier run's folders stay where they are
// until this run's first checkpoint is complete; then they move, with `latest`, into
// DIR.previous-STAMP beside DIR (a run that fails before its first checkpoint has lost nothing).
// A folder of the same name that is still there when a new one is written (run.resume=PATH over
// later steps is refused at start; this is the safety net) is moved to replaced.NAME.STAMP.
//
// exports: true still gathers what the models export (a PEFT or Hugging Face folder) on rank 0
// (StateIO::collect, on this node's dp/tp/pp channels): those formats are whole files.
#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <chrono>
#include <filesystem>
#include <future>
#include <thread>

#include <nlohmann/json.hpp>

#include "comm.hpp"
#include "hash.hpp"
#include "parallel/collectives.hpp"
#include "parallel/expert_parallel.hpp"
#include "parallel/tensor_parallel.hpp"
#include "common/device.hpp"
#include "formats/files.hpp"
#include "common/safetensors.hpp"
#include "common/state_io.hpp"
#include "models/model_state.hpp"
#include "registry.hpp"
#include "spec.hpp"
#include "formats/checkpoint_io.hpp"
#include "formats/crc32c.hpp"

namespace flowrun {

namespace fs = std::filesystem;

namespace {

// A box of a whole tensor that this rank writes, copied.
struct OwnChunk {
  std::string name, key;
  std::vector<int64_t> whole, offsets;
  torch::Tensor data;  // CPU, contiguous
};

struct Snapshot {
  int64_t step = 0;
  std::vector<std::pair<std::string, std::vector<OwnChunk>>> states;  // ref -> the boxes this rank writes
  std::shared_ptr<DeviceEvent> copied;  // device state: the copies are done after this event
  NamedTensors rng;                     // rank 0's
  std::vector<std::pair<std::string, ModelState::ExportWriter>> exports;  // exports: ref -> its writer
  double snapshot_s = 0;
};

// "name" for a whole tensor, else "name[0:4,8:16]": a chunk's key in its file.
std::string chunk_key(const std::string& name, const std::vector<int64_t>& whole, const std::vector<int64_t>& offsets,
                      const std::vector<int64_t>& sizes) {
  bool all = true;
  for (size_t d = 0; d < whole.size(); ++d) all = all && offsets[d] == 0 && sizes[d] == whole[d];
  if (all) return name;
  std::string k = name + "[";
  for (size_t d = 0; d < whole.size(); ++d)
    k += (d ? "," : "") + std::to_string(offsets[d]) + ":" + std::to_string(offsets[d] + sizes[d]);
  return k + "]";
}

// A piece held by several ranks is cut along its first dimension among them when it is at least
// this many elements (a smaller one is written whole by one of them, chosen by its key's hash).
constexpr int64_t kSplitElements = 1 << 16;

// Step 2 of the top: which rows [first, end) of each of this rank's pieces it writes (end <= first:
// none), from every rank's pieces (`all[r]`: rank r's, as "ref\tname\toffsets\tsizes" keys with
// their first dimension and size). The same answer on every rank.
struct PieceKey {
  std::string key;
  int64_t rows = 0, numel = 0;  // first dimension (0 for a 0-d tensor), elements
};
std::vector<std::pair<int64_t, int64_t>> assign(const std::vector<std::vector<PieceKey>>& all, int rank) {
  std::map<std::string, std::vector<int>> holders;
  for (size_t r = 0; r < all.size(); ++r)
    for (const PieceKey& k : all[r]) {
      auto& h = holders[k.key];
      if (h.empty() || h.back() != static_cast<int>(r)) h.push_back(static_cast<int>(r));
    }
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const PieceKey& k : all[static_cast<size_t>(rank)]) {
    const std::vector<int>& h = holders[k.key];
    const auto q = static_cast<int64_t>(std::find(h.begin(), h.end(), rank) - h.begin());
    const auto n = static_cast<int64_t>(h.size());
    if (n == 1) {
      out.emplace_back(0, std::max<int64_t>(k.rows, 1));
    } else if (k.numel >= kSplitElements && k.rows >= 2) {
      const int64_t parts = std::min(n, k.rows);
      out.emplace_back(q < parts ? q * k.rows / parts : 0, q < parts ? (q + 1) * k.rows / parts : 0);
    } else {  // small: one of them, by its key's hash (the small ones spread over the holders)
      const bool mine = static_cast<int64_t>(fnv1a(k.key) % static_cast<uint64_t>(n)) == q;
      out.emplace_back(0, mine ? std::max<int64_t>(k.rows, 1) : 0);
    }
  }
  return out;
}

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
  bool writer_rank_ = true;  // rank 0: makes the folder, writes the manifest, moves `latest`
  int rank_ = 0, world_ = 1;
  std::map<std::string, int64_t> mesh_;  // dp, tp, pp (the manifest records them)
  std::string host_;
  std::future<void> pending_;
  // run.resume=never: the earlier run's step folders and `latest`, moved aside by the first write.
  std::vector<std::string> earlier_;
  // Several processes: the plan's channel (run(): the pieces' keys) and the commit's (the writer
  // thread: the folder made, what each rank wrote, the outcome), each used by one thread in order.
  std::shared_ptr<comm::Channel> plan_, commit_;
  // exports: true: the channels to gather what models export (StateIO::collect).
  std::shared_ptr<parallel::Group> dp_group_, tp_group_, pp_group_, ep_group_;  // tp, pp, ep: with tp, pp, ep > 1

 public:
  void setup(SetupContext& c) override {
    dir_ = (fs::path(c.run().out_dir) / c.params().get<std::string>("dir")).string();
    keep_ = c.params().get<int>("keep_last");
    delay_ms_ = c.params().get<int>("write_delay_ms");
    exports_ = c.params().get<bool>("exports");
    rank_ = c.run().rank;
    world_ = c.run().world;
    writer_rank_ = rank_ == 0;
    host_ = comm::host_name();
    const parallel::Mesh mesh = parallel::mesh_of(c.run());
    mesh_ = {{"dp", mesh.size(parallel::Dim::dp)}, {"tp", mesh.size(parallel::Dim::tp)}, {"pp", mesh.size(parallel::Dim::pp)}};
    if (mesh.size(parallel::Dim::ep) > 1) mesh_["ep"] = mesh.size(parallel::Dim::ep);
    if (world_ > 1) {  // collective: setup runs in file order
      plan_ = comm::Channel::create(c.name() + " (plan)");
      commit_ = comm::Channel::create(c.name() + " (commit)");
      // The processes that really take part (a test may run one rank of a larger run alone).
      rank_ = plan_->rank();
      world_ = plan_->size();
      writer_rank_ = rank_ == 0;
      if (exports_) {
        dp_group_ = parallel::Group::along(c.name(), mesh, parallel::Dim::dp, rank_);
        tp_group_ = parallel::own_tp_group(c.name(), c.run());
        pp_group_ = parallel::own_pp_group(c.name(), c.run());
        ep_group_ = parallel::own_ep_group(c.name(), c.run());
      }
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
    std::string problem;
    if (writer_rank_) {
      try {
        prepare_folder(c);
      } catch (const std::exception& e) {
        problem = e.what();
      }
    }
    if (world_ > 1) {
      // Rank 0's problem ends every rank here (they would wait for it at the first checkpoint).
      const std::string first = comm::allgather_text(*plan_, problem, "checkpoint: the folder made").front();
      if (!first.empty()) throw std::runtime_error(writer_rank_ ? first : "rank 0: " + first);
      check_shared_folder();
    } else if (!problem.empty()) {
      throw std::runtime_error(problem);
    }
  }

  void run(StepContext& c) override {
    const auto t0 = std::chrono::steady_clock::now();
    const auto refs = c.refs("state");
    const auto values = c.states_all("state");
    // exports: what the models export, gathered whole on rank 0 (every rank takes part; only the
    // models that export something).
    auto exporting = [](const Value* v) {
      return v->is<std::shared_ptr<ModelState>>() && v->as<std::shared_ptr<ModelState>>() &&
             v->as<std::shared_ptr<ModelState>>()->exporter;
    };
    if (exports_ && dp_group_)
      for (Value* v : values)
        if (const StateIO* io = find_state_io(*v); io && io->collect && exporting(v))
          io->collect(*v, {writer_rank_, *dp_group_, tp_group_.get(), pp_group_.get(), ep_group_.get()});
    // 1. What this rank holds of each state.
    std::vector<std::vector<TensorPiece>> held;
    for (size_t i = 0; i < values.size(); ++i) {
      const StateIO* io = find_state_io(*values[i]);
      if (!io)
        throw std::runtime_error("state '" + refs[i] + "' holds a " + values[i]->type_name() +
                                 ", which registers no way to save it (FLOWRUN_STATE_TYPE in common/state_io.hpp, beside the type)");
      if (io->pieces) {
        held.push_back(io->pieces(*values[i]));
      } else {
        held.emplace_back();
        for (const auto& [k, t] : io->tensors(*values[i])) parallel::add_pieces(held.back(), k, t, {});
      }
    }
    // 2. Who writes what.
    std::vector<PieceKey> keys;
    for (size_t i = 0; i < held.size(); ++i)
      for (const TensorPiece& p : held[i]) {
        std::string k = refs[i] + "\t" + p.name + "\t";
        for (int64_t o : p.offsets) k += std::to_string(o) + ",";
        k += "\t";
        for (int64_t d : p.data.sizes()) k += std::to_string(d) + ",";
        keys.push_back({k, p.data.dim() > 0 ? p.data.size(0) : 0, p.data.numel()});
      }
    std::vector<std::vector<PieceKey>> all{keys};
    if (plan_) {
      nlohmann::json mine = nlohmann::json::array();
      for (const PieceKey& k : keys) mine.push_back({k.key, k.rows, k.numel});
      all.clear();
      for (const std::string& text : comm::allgather_text(*plan_, mine.dump(), "checkpoint: who holds what")) {
        all.emplace_back();
        for (const auto& e : nlohmann::json::parse(text)) all.back().push_back({e[0], e[1], e[2]});
      }
    }
    const auto rows = assign(all, plan_ ? rank_ : 0);
    // 3. The boxes this rank writes, copied.
    Snapshot snap;
    snap.step = c.step();
    bool on_device = false;
    size_t at = 0;
    for (size_t i = 0; i < held.size(); ++i) {
      std::vector<OwnChunk> chunks;
      for (const TensorPiece& p : held[i]) {
        const auto [first, end] = rows[at++];
        if (end <= first) continue;
        torch::Tensor box = p.data.detach();
        std::vector<int64_t> offsets = p.offsets;
        if (box.dim() > 0 && (first > 0 || end < box.size(0))) {
          box = box.narrow(0, first, end - first);
          offsets[0] += first;
        }
        OwnChunk own{p.name, chunk_key(p.name, p.whole, offsets, box.sizes().vec()), p.whole, offsets, {}};
        if (box.is_cpu()) {
          own.data = box.clone(at::MemoryFormat::Contiguous);
        } else {
          // Device state: copied into pinned host memory, queued on this node's stream (a side
          // stream in the graphs); the background writer waits for the copies, the step never.
          own.data = torch::empty(box.sizes(), box.options().device(torch::kCPU).pinned_memory(true));
          own.data.copy_(box, /*non_blocking=*/true);
          on_device = true;
        }
        chunks.push_back(std::move(own));
      }
      snap.states.emplace_back(refs[i], std::move(chunks));
      if (exports_ && writer_rank_ && values[i]->is<std::shared_ptr<ModelState>>()) {
        const auto& model = values[i]->as<std::shared_ptr<ModelState>>();
        if (model && model->exporter)
          if (ModelState::ExportWriter w = model->exporter(*model)) snap.exports.emplace_back(refs[i], std::move(w));
      }
    }
    if (exports_)  // what the collect gathered, let go once the exporters copied it
      for (Value* v : values)
        if (const StateIO* io = find_state_io(*v); io && io->release && exporting(v)) io->release(*v);
    if (on_device) {
      snap.copied = c.record();
      if (!snap.copied) synchronize_device(run_device(c.run()));  // no device streams: wait now
    }
    if (writer_rank_) snap.rng["cpu"] = torch::globalContext().defaultGenerator(torch::kCPU).get_state();
    wait();  // the previous write; rethrows its error
    // What the step waited for: the copies, and the previous write if it had not ended.
    snap.snapshot_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    pending_ = std::async(std::launch::async, [this, s = std::move(snap)]() { write(s); });
  }

  void finish(ContextBase&) override { wait(); }

 private:
  void wait() {
    if (pending_.valid()) pending_.get();
  }

  // Rank 0, at setup: the folder made and writable, the leftovers of a killed run removed, an
  // earlier run's checkpoints noted (run.resume=never).
  void prepare_folder(SetupContext& c) {
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

  // Several processes: every rank writes into the folder rank 0 made, and rank 0 renames what they
  // wrote, so they must all see one folder (a shared file system). Rank 0 writes a file there; a
  // rank that does not see it (another host's local disk) or cannot write there is named, with
  // its host, on every rank.
  void check_shared_folder() {
    const std::string token = host_ + "\n" + std::to_string(::getpid()) + "-" + local_timestamp();
    const std::string probe = (fs::path(dir_) / ".flowrun-shared-probe").string();
    if (writer_rank_) write_file_atomic(probe, token);
    const std::string sent = comm::allgather_text(*plan_, writer_rank_ ? token : "", "checkpoint: the folder check").front();
    std::string mine;
    std::error_code ec;
    if (!fs::is_regular_file(probe, ec) || read_file(probe) != sent)
      mine = "rank " + std::to_string(rank_) + " on host " + host_ + " does not see the file rank 0 wrote in " + dir_;
    else if (!writer_rank_)
      try {
        probe_writable(dir_);
      } catch (const std::exception& e) {
        mine = "rank " + std::to_string(rank_) + " on host " + host_ + ": " + e.what();
      }
    const std::vector<std::string> seen = comm::allgather_text(*plan_, mine, "checkpoint: the folder check");
    // Rank 0 removes its file before any rank goes on: a rank that then fails (here, on a folder
    // not shared) ends the job, which would otherwise kill rank 0 before it removed it.
    if (writer_rank_) fs::remove(probe, ec);
    comm::allgather_text(*plan_, "", "checkpoint: the folder check's file removed");
    std::string problems;
    for (const std::string& p : seen)
      if (!p.empty()) problems += (problems.empty() ? "" : "; ") + p;
    if (!problems.empty())
      throw std::runtime_error("checkpoint: every rank writes its own files into one folder, which every host must see "
                               "(a shared file system: NFS, Lustre, a cluster's /shared): " +
                               problems + " (rank 0 is on host " + sent.substr(0, sent.find('\n')) +
                               "); give run.out_dir a path on a file system every host mounts");
  }

  // Creates and removes a file in `dir`: an error naming the folder when that fails.
  static void probe_writable(const std::string& dir) {
    const std::string probe = (fs::path(dir) / (".flowrun-write-probe-" + std::to_string(::getpid()))).string();
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

  // Steps 4 and 5 of the top. A failure on any rank (a full disk) fails the checkpoint on every
  // rank; rank 0 removes the half-written folder and says so; `latest` still names the previous
  // checkpoint.
  void write(const Snapshot& s) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string name = ckpt::step_folder(s.step);
    const std::string tmp = dir_ + "/." + name + ".tmp";
    std::string error;  // this rank's
    if (writer_rank_) try {
        fs::remove_all(tmp);
        fs::create_directories(tmp);
      } catch (const std::exception& e) {
        error = e.what();
      }
    if (commit_) commit_->barrier("checkpoint of step " + std::to_string(s.step) + ": its folder made").wait();
    nlohmann::json report = {{"host", host_}, {"files", nlohmann::json::object()}, {"chunks", nlohmann::json::array()}};
    uint64_t bytes = 0;
    if (error.empty()) try {
        if (s.copied) s.copied->synchronize();
        write_files(s, tmp, report, bytes);
      } catch (const std::exception& e) {
        error = e.what();
      }
    report["error"] = error;
    std::vector<std::string> reports{report.dump()};
    if (commit_) reports = comm::allgather_text(*commit_, reports.front(), "checkpoint of step " + std::to_string(s.step) + ": what each rank wrote");
    std::string outcome;
    if (writer_rank_) outcome = commit(s, tmp, reports);
    if (commit_) outcome = comm::allgather_text(*commit_, outcome, "checkpoint of step " + std::to_string(s.step) + ": its outcome").front();
    if (!outcome.empty()) {
      std::error_code ec;
      if (writer_rank_) fs::remove_all(tmp, ec);
      const std::string latest = ckpt::latest(dir_);
      throw std::runtime_error("checkpoint of step " + std::to_string(s.step) + " failed: " + outcome +
                               (ec ? "; its half-written folder " + tmp + " could not be removed: " + ec.message()
                                   : "; its half-written folder was removed") +
                               (latest.empty() ? std::string("; there is no complete checkpoint yet")
                                               : "; latest still names " + latest));
    }
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (writer_rank_)
      spdlog::info("checkpoint {} written ({:.3f} s; {} rank{}, this one {:.1f} MB; the step waited {:.3f} s for the "
                   "snapshot and the write before)",
                   dir_ + "/" + name, took, world_, world_ == 1 ? "" : "s", static_cast<double>(bytes) / 1e6, s.snapshot_s);
  }

  // This rank's files: one per state it writes boxes of (REF.safetensors with one process,
  // REF.rankNNNNN.safetensors with several), and rank 0's rng.safetensors. Into `report`: each
  // file's size and CRC32C, each chunk's place, file, key and CRC32C.
  void write_files(const Snapshot& s, const std::string& tmp, nlohmann::json& report, uint64_t& bytes) {
    auto record = [&](const std::string& file, const safetensors::Written& w) {
      report["files"][file] = {{"bytes", w.bytes}, {"crc32c", crc32c_hex(w.crc32c)}};
      bytes += w.bytes;
    };
    char suffix[32];
    std::snprintf(suffix, sizeof suffix, ".rank%05d", rank_);
    for (const auto& [ref, chunks] : s.states) {
      if (chunks.empty()) continue;
      pause();
      const std::string file = ref + (world_ > 1 ? suffix : "") + ".safetensors";
      safetensors::Tensors tensors;
      for (const OwnChunk& c : chunks) tensors[c.key] = c.data;
      safetensors::Written w;
      safetensors::save(tmp + "/" + file, tensors,
                        {{"ref", ref}, {"step", std::to_string(s.step)}, {"rank", std::to_string(rank_)}}, &w);
      record(file, w);
      for (const OwnChunk& c : chunks)
        report["chunks"].push_back({ref, c.name, safetensors::dtype_name(c.data.scalar_type()), c.whole, c.offsets,
                                    c.data.sizes().vec(), file, c.key, crc32c_hex(w.tensor_crc32c.at(c.key))});
    }
    if (!s.rng.empty()) {
      pause();
      safetensors::Written w;
      safetensors::save(tmp + "/rng.safetensors", s.rng, {}, &w);
      record("rng.safetensors", w);
    }
  }

  // Rank 0: the manifest from every rank's report, then the folder renamed and `latest` moved.
  // Returns "" or why the checkpoint failed (naming the rank and host).
  std::string commit(const Snapshot& s, const std::string& tmp, const std::vector<std::string>& reports) {
    std::string failed;
    for (size_t r = 0; r < reports.size(); ++r) {
      const auto j = nlohmann::json::parse(reports[r]);
      if (!j["error"].get<std::string>().empty())
        failed += (failed.empty() ? "" : "; ") +
                  (world_ > 1 ? "rank " + std::to_string(r) + " (host " + j["host"].get<std::string>() + "): " : "") +
                  j["error"].get<std::string>();
    }
    if (!failed.empty()) return failed;
    try {
      const std::string name = ckpt::step_folder(s.step);
      const std::string final_dir = dir_ + "/" + name;
      ckpt::Manifest m;
      m.step = s.step;
      m.graph = graph_file_;
      m.name = name_;
      m.config = config_;
      m.world = world_;
      m.mesh = mesh_;
      for (const auto& [ref, _] : s.states) {
        m.states[ref] = "";
        m.tensors[ref];
      }
      for (size_t r = 0; r < reports.size(); ++r) {
        const auto j = nlohmann::json::parse(reports[r]);
        for (const auto& [file, f] : j["files"].items())
          m.files[file] = {f["bytes"].get<int64_t>(), f["crc32c"].get<std::string>(), static_cast<int>(r),
                           j["host"].get<std::string>()};
        for (const auto& c : j["chunks"]) {
          ckpt::TensorEntry& e = m.tensors[c[0].get<std::string>()][c[1].get<std::string>()];
          e.dtype = c[2].get<std::string>();
          e.shape = c[3].get<std::vector<int64_t>>();
          e.chunks.push_back({c[6].get<std::string>(), c[7].get<std::string>(), c[4].get<std::vector<int64_t>>(),
                              c[5].get<std::vector<int64_t>>(), c[8].get<std::string>()});
        }
      }
      if (!s.rng.empty()) m.rng_file = "rng.safetensors";
      // What models export (exports: true), whole, by rank 0: in the folder itself for one, in
      // REF/ each for several.
      for (const auto& [ref, writer] : s.exports) {
        pause();
        writer(s.exports.size() == 1 ? tmp : tmp + "/" + ref);
      }
      ckpt::write_manifest(tmp, m);  // last: a folder with a manifest is complete
      ckpt::read_manifest(tmp);      // every tensor covered exactly once (a wrong plan would fail here)
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
    } catch (const std::exception& e) {
      return (world_ > 1 ? "rank 0 (host " + host_ + "): " : std::string()) + e.what();
    }
    return "";
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
