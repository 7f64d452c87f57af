// ModelState's registration with checkpoint/resume (common/state_io.hpp), beside its definition.
// A model split over tp (ModelState::tp) is saved whole and loaded into its parts; one sharded
// by ZeRO-3 (ModelState::shards) is gathered whole and loaded into this rank's slice.
#include "models/model_state.hpp"

#include "common/state_io.hpp"
#include "parallel/tensor_messages.hpp"
#include "parallel/tensor_parallel.hpp"

namespace {

using flowrun::ModelState;
using flowrun::NamedTensors;
using flowrun::Value;

std::shared_ptr<ModelState>& state_of(Value& v) { return v.as_mut<std::shared_ptr<ModelState>>(); }

// A checkpoint holds whole tensors: under tp each is checked against the whole shape this
// rank's part belongs to before it is cut, so a mismatch reads the same at any layout (the
// whole shapes), this rank's part after it.
void check_whole_shapes(const ModelState& m, const NamedTensors& given) {
  if (!m.tp || !m.tp->group) return;  // tp 1: ModelState::load compares the shapes themselves
  std::map<std::string, std::vector<int64_t>> mine;  // this rank's shapes (ZeRO-3: its placeholders' sizes, not its slices)
  for (const auto& [name, t] : m.tensors()) mine[name] = t.sizes().vec();
  const int64_t ranks = m.tp->group->size();
  for (const auto& [name, v] : given) {
    auto it = mine.find(name);
    if (it == mine.end() || !v.defined()) continue;  // load() names unknown tensors
    const flowrun::parallel::TpSplit s = m.tp->split(name);
    std::vector<int64_t> whole = it->second;
    const bool split = s.split() && static_cast<size_t>(s.dim) < whole.size();
    if (split) whole[static_cast<size_t>(s.dim)] *= ranks;
    if (v.sizes().vec() != whole)
      throw std::runtime_error("model '" + m.kind + "': tensor '" + name + "' has shape " + c10::str(c10::IntArrayRef(whole)) +
                               ", the one given has " + c10::str(v.sizes()) +
                               (split ? " [this rank holds " + c10::str(c10::IntArrayRef(it->second)) +
                                            " of it, its part of tp " + std::to_string(ranks) + "]"
                                      : ""));
  }
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
  // Every rank gathers: ZeRO-3's slices over the data-parallel ranks (each tp rank's parts
  // whole), then tp's parts over the tp group (its all-gathers pair up); the writer (rank 0 of
  // the world) keeps the whole tensors for tensors(), the others drop them.
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
    if (m->tp) whole = m->tp->wholes(whole, flowrun::tp_channel(groups, "model '" + m->kind + "'"));
    if (m->stages && groups.pp) {
      if (groups.dp.rank() != 0 || (m->tp && m->tp->group->rank() != 0)) return;
      whole = flowrun::parallel::gather_on_first(*groups.pp, whole, "model '" + m->kind + "' for a checkpoint");
    }
    if (groups.writer) m->gathered = std::move(whole);
  };
  io.release = [](Value& v) { state_of(v)->gathered.clear(); };
  io.partitioned = [](const Value& v) {
    const auto& m = v.as<std::shared_ptr<ModelState>>();
    return m->tp != nullptr || m->shards != nullptr || m->stages != nullptr;
  };
  flowrun::register_state_io(std::type_index(typeid(std::shared_ptr<ModelState>)), std::move(io));
  return true;
}();

}  // namespace
