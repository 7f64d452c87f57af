// ModelState's registration with checkpoint/resume (common/state_io.hpp), beside its definition.
// A model split over tp (ModelState::tp) is saved whole and loaded into its parts.
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
    return m->tp && !m->gathered.empty() ? m->gathered : NamedTensors(m->tensors());
  };
  io.load = [](Value& v, const NamedTensors& t) {
    auto& m = state_of(v);
    m->load(m->tp ? m->tp->parts(t) : t);
  };
  // Every rank gathers (the tp group's all-gathers pair up); the writer (rank 0 of the
  // checkpoint's group) keeps the whole tensors for tensors(), the others drop them.
  io.collect = [](Value& v, flowrun::parallel::Group& writers) {
    auto& m = state_of(v);
    if (!m->tp) return;
    m->gathered.clear();
    NamedTensors whole = m->tp->wholes(m->tensors());
    if (writers.rank() == 0) m->gathered = std::move(whole);
  };
  io.partitioned = [](const Value& v) { return v.as<std::shared_ptr<ModelState>>()->tp != nullptr; };
  flowrun::register_state_io(std::type_index(typeid(std::shared_ptr<ModelState>)), std::move(io));
  return true;
}();

}  // namespace
