// sync_start_state (comm/startup.hpp): every rank starts from rank 0's state.
//
// Per state, in file order (the same on every rank, so the collectives match):
//   1. allgather a hash of its descriptor (tensor names, dtypes, shapes: comm/state_descriptor.hpp);
//      any difference is an error naming the state and the ranks, on every rank alike (they all
//      see the same gathered hashes), before anything is overwritten;
//   2. broadcast each tensor's bytes from rank 0, in place where the tensor is contiguous and
//      on the CPU, else through a contiguous CPU copy;
//   3. on ranks != 0, hand the received tensors to StateIO::load when the object does not
//      already hold them (see load_if_changed for why not always).
// A single-process world runs step 1 only (a few strings: cheap, and the same code path);
// the broadcasts and copies are skipped, so the state is left exactly as it was.
#include "comm/startup.hpp"

#include <spdlog/spdlog.h>

#include <chrono>
#include <vector>

#include "comm.hpp"
#include "comm/state_descriptor.hpp"
#include "common/state_io.hpp"
#include "executor.hpp"
#include "parallel/mesh.hpp"
#include "registry.hpp"
#include "spec.hpp"

namespace flowrun {

namespace {

// What each rank contributes to the check: the hash decides, the sizes make the error readable.
struct Summary {
  uint64_t hash = 0;
  int64_t tensors = 0;
  int64_t bytes = 0;
  int64_t stage = 0;  // compared only with the ranks of the same stage (a state cut over pipeline stages)
};

int64_t total_bytes(const NamedTensors& t) {
  int64_t n = 0;
  for (const auto& [k, v] : t)
    if (v.defined()) n += v.numel() * static_cast<int64_t>(v.element_size());
  return n;
}

std::string summary_text(const Summary& s) {
  return std::to_string(s.tensors) + " tensor" + (s.tensors == 1 ? "" : "s") + ", " + std::to_string(s.bytes) + " bytes";
}

// Step 1: throws on every rank if any rank's descriptor differs from rank 0's (a state cut over
// pipeline stages: from the first rank's of its stage, `stage`).
void check_same_everywhere(comm::Channel& ch, const std::string& ref, const std::string& descriptor,
                           const NamedTensors& tensors, int64_t stage = 0) {
  const Summary mine{descriptor_hash(descriptor), static_cast<int64_t>(tensors.size()), total_bytes(tensors), stage};
  std::vector<Summary> all(static_cast<size_t>(comm::size()));
  ch.allgather(&mine, all.data(), sizeof mine, "comparing state '" + ref + "' across ranks").wait();
  std::string differ, detail;
  for (size_t r = 1; r < all.size(); ++r) {
    size_t first = 0;  // the first rank of r's stage
    while (all[first].stage != all[r].stage) ++first;
    if (all[r].stage != all[0].stage) {
      if (all[r].hash == all[first].hash) continue;
      throw std::runtime_error("start-up check: state '" + ref + "' of rank " + std::to_string(r) + " (" +
                               summary_text(all[r]) + ") differs from rank " + std::to_string(first) + "'s of the same "
                               "pipeline stage (" + summary_text(all[first]) + "); every rank of a stage must build the "
                               "same state: same graph, same weights files, same plugins");
    }
    if (all[r].hash == all[0].hash) continue;
    differ += (differ.empty() ? "" : ", ") + std::to_string(r);
    detail += "; rank " + std::to_string(r) + ": " + summary_text(all[r]);
  }
  if (differ.empty()) return;
  // Every rank saw the same hashes, so every rank is here: rank 0 sends its descriptor, and a
  // differing rank names the first tensor that differs.
  uint64_t len = descriptor.size();
  comm::broadcast(ch, &len, sizeof len, 0, "sending rank 0's description of '" + ref + "'");
  std::string rank0(comm::rank() == 0 ? descriptor : std::string(len, '\0'));
  comm::broadcast(ch, rank0.data(), len, 0, "sending rank 0's description of '" + ref + "'");
  const std::string here = mine.hash == all[0].hash ? "" : "; on this rank (" + comm::where() + "): " +
                                                             first_difference(rank0, descriptor);
  throw std::runtime_error("start-up check: state '" + ref + "' of rank(s) " + differ +
                           " has other tensor names, dtypes or shapes than rank 0's (rank 0: " + summary_text(all[0]) +
                           detail + ")" + here + "; every rank must build the same state: same graph, same weights "
                           "files, same plugins (a resumed run: the same checkpoint)");
}

// Ranks != 0 after the broadcast: does the object already hold the received values? True when
// tensors() returned aliases of the live tensors and those were broadcast in place.
bool holds(const StateIO& io, const Value& v, const NamedTensors& received) {
  const NamedTensors now = io.tensors(v);
  for (const auto& [k, t] : received) {
    auto it = now.find(k);
    if (it == now.end() || !it->second.defined()) return false;
    if (!torch::equal(it->second.detach().to(torch::kCPU), t)) return false;  // NaN != NaN: loads; harmless
  }
  return true;
}

// Step 3. StateIO::load is not called unconditionally: OptimizerState::load before the first
// update (right after a resume) *replaces* the moments it keeps pending with what it is given,
// and its tensors() does not list those pending moments, so loading the broadcast "updates"
// alone would drop the moments every rank just restored from the checkpoint. When the object
// already holds rank 0's values (aliases broadcast in place, or equal fresh tensors such as a
// DataCursor's) there is nothing to load.
void load_if_changed(const StateIO& io, Value& v, const std::string& ref, const NamedTensors& received) {
  if (holds(io, v, received)) return;
  try {
    io.load(v, received);
  } catch (const std::exception& e) {
    throw std::runtime_error("start-up sync: loading rank 0's state '" + ref + "' on " + comm::where() + ": " + e.what());
  }
}

// Step 2 (+ 3). All of one state's broadcasts are in flight together; their buffers live in
// `received` until every request is done.
void broadcast_from_rank0(comm::Channel& ch, const std::string& ref, const StateIO& io, Value& v,
                          const NamedTensors& tensors) {
  torch::NoGradGuard no_grad;
  NamedTensors received;
  std::vector<comm::Request> pending;
  for (const auto& [name, t] : tensors) {
    if (!t.defined()) continue;  // same on every rank (part of the descriptor)
    const bool in_place = t.device().is_cpu() && t.is_contiguous() && t.layout() == torch::kStrided;
    torch::Tensor buf = in_place ? t.detach() : t.detach().to(torch::kCPU).contiguous();
    if (buf.numel() > 0)
      pending.push_back(ch.broadcast(buf.data_ptr(), static_cast<size_t>(buf.numel()) * buf.element_size(), 0,
                                     "broadcasting '" + ref + "' tensor '" + name + "' from rank 0"));
    received.emplace(name, std::move(buf));
  }
  for (auto& r : pending) r.wait();
  if (comm::rank() != 0) load_if_changed(io, v, ref, received);
}

}  // namespace

void sync_start_state(Executor& ex, const GraphSpec& g, comm::Channel& ch) {
  const auto t0 = std::chrono::steady_clock::now();
  const parallel::Mesh mesh(comm::size(), g.settings.parallel.tp, g.settings.parallel.pp);
  const int64_t pp_stage = mesh.coord(comm::rank()).pp;
  int64_t states = 0, bytes = 0;
  for (const NodeSpec& n : g.nodes) {
    const NodeType* type = Registry::global().find(n.type);
    if (!type) throw std::logic_error("start-up sync: node '" + n.name + "' has unregistered type '" + n.type + "'");
    for (const PortSchema& port : type->schema.outputs) {
      if (port.kind != PortKind::State) continue;
      const std::string ref = n.name + "." + port.name;
      Value& v = ex.state(n.name, port.name);
      // A state without a StateIO (a Dataset: read-only, built from files) cannot be compared
      // or sent; it still takes part in the check, so a rank where it has one (another plugin
      // build) is caught instead of issuing broadcasts the others never match.
      const StateIO* io = find_state_io(v);
      const NamedTensors tensors = io ? io->tensors(v) : NamedTensors{};
      // Cut over pipeline stages (partitioned, pp > 1): each stage holds its own tensors.
      const int64_t stage = io && io->partitioned && io->partitioned(v) ? pp_stage : 0;
      check_same_everywhere(ch, ref, io ? describe_tensors(tensors) : "no StateIO: " + v.type_name() + "\n", tensors,
                            stage);
      if (!io || !comm::distributed()) continue;
      if (io->partitioned && io->partitioned(v)) continue;  // tp parts: built alike from the whole (seeded or loaded), never the same
      broadcast_from_rank0(ch, ref, *io, v, tensors);
      ++states;
      bytes += total_bytes(tensors);
    }
  }
  if (comm::distributed() && comm::rank() == 0)
    spdlog::info("start-up: {} states ({:.1f} MB) checked and broadcast from rank 0 in {:.2f} s", states, bytes / 1e6,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

}  // namespace flowrun
