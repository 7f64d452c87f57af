// ModelState's registration with checkpoint/resume (common/state_io.hpp), beside its definition.
// A checkpoint writes what this rank holds as pieces of the whole tensors (held_pieces: its tp
// parts, its stage's tensors, its ZeRO-3 slices) and a resume reads those boxes back at any layout
// (load_held); nothing is gathered. load() takes whole tensors into the parts or the slice; collect
// gathers the model whole on rank 0 only for exports: true (what the exporters write).
#include "models/model_state.hpp"

#include <set>

#include "common/state_io.hpp"
#include "parallel/placement.hpp"
#include "parallel/tensor_messages.hpp"
#include "parallel/tensor_parallel.hpp"

namespace {

using flowrun::ModelState;
using flowrun::NamedTensors;
using flowrun::Value;

std::shared_ptr<ModelState>& state_of(Value& v) { return v.as_mut<std::shared_ptr<ModelState>>(); }

// Whole tensors given to load(): under tp each is checked against the whole shape this
// rank's part belongs to before it is cut, so a mismatch reads the same at any layout (the
// whole shapes), this rank's part after it.
void check_whole_shapes(const ModelState& m, const NamedTensors& given) {
  if (!m.tp) return;  // whole: ModelState::load compares the shapes themselves
  std::map<std::string, std::vector<int64_t>> mine;  // this rank's shapes (ZeRO-3: its placeholders' sizes, not its slices)
  for (const auto& [name, t] : m.tensors()) mine[name] = t.sizes().vec();
  for (const auto& [name, v] : given) {
    auto it = mine.find(name);
    if (it == mine.end() || !v.defined()) continue;  // load() names unknown tensors
    const flowrun::parallel::TpSplit s = m.tp->split(name);
    const flowrun::parallel::Group* g = m.tp->group_of(s);
    std::vector<int64_t> whole = it->second;
    const bool split = g && static_cast<size_t>(s.dim) < whole.size();
    if (split) whole[static_cast<size_t>(s.dim)] *= g->size();
    if (v.sizes().vec() != whole)
      throw std::runtime_error("model '" + m.kind + "': tensor '" + name + "' has shape " + c10::str(c10::IntArrayRef(whole)) +
                               ", the one given has " + c10::str(v.sizes()) +
                               (split ? " [this rank holds " + c10::str(c10::IntArrayRef(it->second)) + " of it, its part of " +
                                            (s.experts ? "ep " : "tp ") + std::to_string(g->size()) + "]"
                                      : ""));
  }
}

// How the tensor `name` of this rank lies in the whole (its tp or ep split, or whole).
flowrun::parallel::Placement placement(const ModelState& m, const std::string& name) {
  if (!m.tp) return {};
  const flowrun::parallel::TpSplit s = m.tp->split(name);
  const flowrun::parallel::Group* g = m.tp->group_of(s);
  if (!g) return {};
  return {s, g->rank(), g->size()};
}

// What this rank holds, as pieces of the whole tensors: its tp parts, its stage's tensors, its
// ZeRO-3 slices (views of all of them).
std::vector<flowrun::TensorPiece> held_pieces(const ModelState& m) {
  std::vector<flowrun::TensorPiece> out;
  if (m.shards) {
    for (const auto& r : m.shards->ranges())
      flowrun::parallel::add_range_pieces(out, r.name, r.data, r.shape, r.offset, placement(m, r.name));
    for (const auto& [name, b] : m.named_buffers()) flowrun::parallel::add_pieces(out, name, b, placement(m, name));
    return out;
  }
  for (const auto& [name, t] : m.tensors()) flowrun::parallel::add_pieces(out, name, t, placement(m, name));
  return out;
}

// A load of what this rank holds, each piece read from its boxes of the saved tensors: checked
// whole first (the names as a strict load checks them, every shape against the whole one, every
// value finite), then copied in, so a refused load leaves the model as it was.
void load_held(ModelState& m, const flowrun::StateSource& src) {
  torch::NoGradGuard no_grad;
  std::vector<flowrun::TensorPiece> pieces = held_pieces(m);
  if (!m.stages) {  // a stage holds some of the tensors; a whole model, all of them (a ZeRO-3 rank may hold none of one)
    const NamedTensors known = m.tensors();
    for (const auto& name : src.names())
      if (!known.count(name)) throw std::runtime_error("model '" + m.kind + "': unknown tensor '" + name + "'");
  }
  std::vector<torch::Tensor> read;
  for (const auto& p : pieces) {
    if (!src.has(p.name)) throw std::runtime_error("model '" + m.kind + "': tensor '" + p.name + "' is missing");
    const std::vector<int64_t> whole = src.shape(p.name);
    if (whole != p.whole) {  // as check_whole_shapes says it (the whole shapes, then this rank's part)
      const flowrun::parallel::Placement at = placement(m, p.name);
      std::vector<int64_t> part = p.whole;
      const bool split = at.ranks > 1 && at.split.split() && static_cast<size_t>(at.split.dim) < part.size();
      if (split) part[static_cast<size_t>(at.split.dim)] /= at.ranks;
      throw std::runtime_error("model '" + m.kind + "': tensor '" + p.name + "' has shape " +
                               c10::str(c10::IntArrayRef(p.whole)) + ", the one given has " + c10::str(c10::IntArrayRef(whole)) +
                               (split ? " [this rank holds " + c10::str(c10::IntArrayRef(part)) + " of it, its part of tp " +
                                            std::to_string(at.ranks) + "]"
                                      : ""));
    }
    torch::Tensor t = torch::empty(p.data.sizes(), p.data.options().device(torch::kCPU));
    src.read(p.name, p.offsets, t);
    if (!flowrun::all_finite(t))
      throw std::runtime_error("model '" + m.kind + "': tensor '" + p.name + "' holds NaN or infinite values");
    read.push_back(t);
  }
  for (size_t i = 0; i < pieces.size(); ++i) pieces[i].data.copy_(read[i]);
}

const bool kModelStateIO = [] {
  flowrun::StateIO io;
  io.tensors = [](const Value& v) {
    const auto& m = v.as<std::shared_ptr<ModelState>>();
    // Whole (ZeRO-3 with one rank: views of its slice), or what the collect gathered whole.
    return m->gathered.empty() ? NamedTensors(m->tensors()) : m->gathered;
  };
  io.load = [](Value& v, const NamedTensors& t) {
    auto& m = state_of(v);
    if (m->shards) {  // the parameters: this rank's slice (of its tp parts, under tp)
      check_whole_shapes(*m, t);
      const NamedTensors rest = m->shards->load(m->tp ? m->tp->parts(t) : t);
      for (const auto& [name, b] : m->named_buffers())
        if (!rest.count(name)) throw std::runtime_error("model '" + m->kind + "': tensor '" + name + "' is missing");
      m->load(rest, /*strict=*/false);
      return;
    }
    if (m->stages) {  // pipeline parallel: the tensors this rank's chunks hold, each of them required
      const NamedTensors held = m->tensors();
      NamedTensors mine;
      for (const auto& [name, tensor] : t)
        if (held.count(name)) mine.emplace(name, tensor);
      check_whole_shapes(*m, mine);
      m->load(m->tp ? m->tp->parts(mine) : mine);
      return;
    }
    check_whole_shapes(*m, t);
    m->load(m->tp ? m->tp->parts(t) : t);
  };
  // exports: true only (a checkpoint's own files are held_pieces'). Every rank gathers: ZeRO-3's
  // slices over the data-parallel ranks (each tp rank's parts whole), then tp's parts over the tp
  // group (its all-gathers pair up); the writer (rank 0 of the world) keeps the whole tensors in
  // `gathered` for the exporters, the others drop them.
  // Under pipeline parallel, then the stages' tensors over the pp group of the writer's replica
  // and tp rank (the others' stages hold the same).
  io.collect = [](Value& v, const flowrun::StateIO::Groups& groups) {
    auto& m = state_of(v);
    if (!m->shards && !m->tp && !m->stages) return;
    m->gathered.clear();
    NamedTensors whole;
    if (m->shards) {  // the parameters gathered, and the buffers the module holds
      whole = m->shards->wholes(groups.dp);
      for (const auto& [name, b] : m->named_buffers()) whole[name] = b;
    } else {
      whole = m->tensors();
    }
    if (m->tp) whole = m->tp->wholes(whole, groups.tp, nullptr, groups.ep);
    if (m->stages && groups.pp) {
      if (groups.dp.rank() != 0 || (m->tp && m->tp->group && m->tp->group->rank() != 0)) return;
      whole = flowrun::parallel::gather_on_first(*groups.pp, whole, "model '" + m->kind + "' for a checkpoint");
    }
    if (groups.writer) m->gathered = std::move(whole);
  };
  io.release = [](Value& v) { state_of(v)->gathered.clear(); };
  io.pieces = [](const Value& v) { return held_pieces(*v.as<std::shared_ptr<ModelState>>()); };
  io.load_from = [](Value& v, const flowrun::StateSource& src) { load_held(*state_of(v), src); };
  io.partitioned = [](const Value& v) {
    const auto& m = v.as<std::shared_ptr<ModelState>>();
    return m->tp != nullptr || m->shards != nullptr || m->stages != nullptr;
  };
  flowrun::register_state_io(std::type_index(typeid(std::shared_ptr<ModelState>)), std::move(io));
  return true;
}();

}  // namespace
