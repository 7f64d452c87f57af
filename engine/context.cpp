// The contexts a node sees (node.hpp), on top of NodeRuntime.
#include <stdexcept>

#include "runtime.hpp"
#include "trace.hpp"

namespace flowrun {

const std::string& ContextBase::name() const { return rt_->spec->name; }
const std::string& ContextBase::type() const { return rt_->spec->type; }
const Params& ContextBase::params() const { return rt_->params; }
const RunInfo& ContextBase::run() const { return *rt_->info; }
std::string ContextBase::who() const { return rt_->who; }
const Schedule& ContextBase::schedule() const { return rt_->spec->schedule; }

// ---- setup ------------------------------------------------------------------------------

void SetupContext::own_state(const std::string& port, Value v) {
  auto it = rt_->owned_state.find(port);
  if (it == rt_->owned_state.end())
    throw std::logic_error(rt_->who + ": own_state('" + port + "'): not a state output of its schema");
  (*rt_->states)[it->second] = std::move(v);
}

Value& SetupContext::state(const std::string& port) {
  if (const InputBinding* b = rt_->input(port); b && b->kind == PortKind::State) {
    Value& v = (*rt_->states)[b->slots.at(0)];
    if (v.empty())
      throw std::runtime_error(rt_->who + ": state input '" + port + "' was never created by its owner's setup()");
    return v;
  }
  auto it = rt_->owned_state.find(port);
  if (it != rt_->owned_state.end()) return (*rt_->states)[it->second];
  throw std::logic_error(rt_->who + ": state('" + port + "'): not a connected state port");
}

// A `many` state input's objects and any input's refs: the same at setup and in a step.
static std::vector<Value*> states_of(NodeRuntime* rt, const std::string& port) {
  const InputBinding* b = rt->input(port);
  if (!b || b->kind != PortKind::State) throw std::logic_error(rt->who + ": states_all('" + port + "'): not a connected state input");
  std::vector<Value*> out;
  for (int s : b->slots) out.push_back(&(*rt->states)[s]);
  return out;
}

static std::vector<std::string> refs_of(const NodeRuntime* rt, const std::string& port) {
  const InputBinding* b = rt->input(port);
  if (!b) throw std::logic_error(rt->who + ": refs('" + port + "'): not a connected input");
  return b->refs;
}

std::vector<Value*> SetupContext::states_all(const std::string& port) { return states_of(rt_, port); }

std::vector<std::string> SetupContext::refs(const std::string& port) const { return refs_of(rt_, port); }

bool SetupContext::connected(const std::string& port) const { return rt_->input(port) != nullptr; }

const Value* SetupContext::producer_state(const std::string& value_port, const std::string& state_port) const {
  const InputBinding* b = rt_->input(value_port);
  if (!b || b->kind != PortKind::Value || b->producers.empty() || !rt_->core) return nullptr;
  const Value* v = rt_->core->owned_state(b->producers.front(), state_port);
  return v && !v->empty() ? v : nullptr;
}

std::vector<std::string> SetupContext::input_ports() const {
  std::vector<std::string> v;
  for (const auto& b : rt_->inputs) v.push_back(b.port);
  return v;
}

std::vector<std::string> SetupContext::value_outputs() const {
  std::vector<std::string> v;
  for (const auto& [port, _] : rt_->out_slot) v.push_back(port);
  return v;
}

std::string SetupContext::what(const std::string& port) const { return rt_->who + " port '" + port + "'"; }

// ---- step -------------------------------------------------------------------------------

static Frame& frame_of(void* f) { return *static_cast<Frame*>(f); }

const Value& StepContext::in(const std::string& port) const {
  const InputBinding* b = rt_->input(port);
  if (!b || b->kind != PortKind::Value)
    throw std::logic_error(rt_->who + ": in('" + port + "'): not a connected value input");
  const Value& v = frame_of(frame_).values[b->slots.at(0)];
  if (v.empty())
    throw std::runtime_error(rt_->who + ": input '" + port + "' is empty: its producer did not set it this step");
  return v;
}

std::vector<const Value*> StepContext::in_all(const std::string& port) const {
  const InputBinding* b = rt_->input(port);
  if (!b) throw std::logic_error(rt_->who + ": in_all('" + port + "'): not a connected input");
  std::vector<const Value*> out;
  for (int s : b->slots)
    out.push_back(b->kind == PortKind::State ? &(*rt_->states)[s] : &frame_of(frame_).values[s]);
  return out;
}

std::vector<Value*> StepContext::states_all(const std::string& port) { return states_of(rt_, port); }

std::vector<std::string> StepContext::refs(const std::string& port) const { return refs_of(rt_, port); }

bool StepContext::connected(const std::string& port) const { return rt_->input(port) != nullptr; }

std::vector<std::string> StepContext::input_ports() const {
  std::vector<std::string> v;
  for (const auto& b : rt_->inputs) v.push_back(b.port);
  return v;
}

Value& StepContext::state(const std::string& port) {
  if (const InputBinding* b = rt_->input(port); b && b->kind == PortKind::State) return (*rt_->states)[b->slots.at(0)];
  auto it = rt_->owned_state.find(port);
  if (it != rt_->owned_state.end()) return (*rt_->states)[it->second];
  throw std::logic_error(rt_->who + ": state('" + port + "'): not a connected state port");
}

void StepContext::out(const std::string& port, Value v) {
  auto it = rt_->out_slot.find(port);
  if (it == rt_->out_slot.end()) {
    const PortSchema* o = rt_->schema->output(port);
    if (o && o->name == "*" && o->kind == PortKind::Value) return;  // a "*" output nobody reads by this name
    throw std::logic_error(rt_->who + ": out('" + port + "'): not a value output of its schema");
  }
  frame_of(frame_).values[it->second] = std::move(v);
}

void StepContext::emit(const std::string& port, Value v, int index, int count) {
  if (!rt_->stream_consumers.count(port) && !rt_->schema->output(port))
    throw std::logic_error(rt_->who + ": emit('" + port + "'): not a stream output of its schema");
  rt_->core->deliver_item(rt_->index, step_, port, std::move(v), index, count);
}

void StepContext::sync(const std::string& port) const {
  const InputBinding* b = rt_->input(port);
  if (!b || b->kind != PortKind::Value)
    throw std::logic_error(rt_->who + ": sync('" + port + "'): not a connected value input");
  const Frame& f = frame_of(frame_);
  if (f.recorded.empty()) return;  // no device streams: the producer's work is done
  for (int p : b->producers) {
    const auto& r = f.recorded.at(static_cast<size_t>(p));
    if (r && r->event) r->event->synchronize();
  }
}

std::shared_ptr<DeviceEvent> StepContext::record() const {
  return rt_->streams ? rt_->streams->record(rt_->stream) : nullptr;
}

void StepContext::trace_mark(const std::string& what, std::chrono::steady_clock::time_point t0,
                             std::chrono::steady_clock::time_point t1) const {
  if (rt_->tracer && rt_->tracer->enabled())
    rt_->tracer->span(rt_->spec->name + ": " + what, "mark", rt_->tracer->us(t0), rt_->tracer->us(t1), step_);
}

std::string StepContext::what(const std::string& port) const { return rt_->who + " port '" + port + "'"; }

}  // namespace flowrun
