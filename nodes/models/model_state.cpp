// ModelState's registration with checkpoint/resume (common/state_io.hpp), beside its definition.
// A model split over tp (ModelState::tp) is saved whole and loaded into its parts; one sharded
// by ZeRO-3 (ModelState::shards) is gathered whole and loaded into this rank's slice.
#include "models/model_state.hpp"

#include "common/state_io.hpp"
#include "parallel/tensor_parallel.hpp"

namespace {

using flowrun::ModelState;
using flowrun::NamedTensors;
using flowrun::Value;

std::shared_ptr<ModelState>& state_of(Value& v) { return v.as_mut<std::shared_ptr<ModelState>>(); }

const bool kModelStateIO = [] {
  flowrun::StateIO io;
  io.tensors = [](const Value& v) {
    const auto& m = v.as<std::shared_ptr<ModelState>>();
    if (m->gathered.empty()) return NamedTensors(m->tensors());  // whole (ZeRO-3 with one rank: views of its slice)
    if (!m->shards) return m->gathered;                           // tp's parts gathered whole
    NamedTensors all = m->gathered;  // ZeRO-3: the gathered parameters, and the buffers the module holds
    for (const auto& [name, b] : m->named_buffers()) all[name] = b;
    return all;
  };
  io.load = [](Value& v, const NamedTensors& t) {
    auto& m = state_of(v);
    if (m->shards) {
      const NamedTensors rest = m->shards->load(t);  // the parameters: this rank's slice
      for (const auto& [name, b] : m->named_buffers())
        if (!rest.count(name)) throw std::runtime_error("model '" + m->kind + "': tensor '" + name + "' is missing");
      m->load(rest, /*strict=*/false);
      return;
    }
    m->load(m->tp ? m->tp->parts(t) : t);
  };
  // Every rank gathers (the tp group's all-gathers pair up); the writer (rank 0 of the
  // checkpoint's group) keeps the whole tensors for tensors(), the others drop them.
  io.collect = [](Value& v, flowrun::parallel::Group& writers) {
    auto& m = state_of(v);
    if (m->shards) {  // ZeRO-3: every rank's slices all-gathered over the checkpoint's group
      m->gathered.clear();
      NamedTensors whole = m->shards->wholes(writers);
      if (writers.rank() == 0) m->gathered = std::move(whole);
      return;
    }
    if (!m->tp) return;
    m->gathered.clear();
    NamedTensors whole = m->tp->wholes(m->tensors());
    if (writers.rank() == 0) m->gathered = std::move(whole);
  };
  io.partitioned = [](const Value& v) {
    const auto& m = v.as<std::shared_ptr<ModelState>>();
    return m->tp != nullptr || m->shards != nullptr;
  };
  flowrun::register_state_io(std::type_index(typeid(std::shared_ptr<ModelState>)), std::move(io));
  return true;
}();

}  // namespace
