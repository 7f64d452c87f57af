// run.parallel as a layout (layout.hpp).
#include "parallel/layout.hpp"

#include <set>
#include <stdexcept>

#include "parallel/mesh.hpp"
#include "registry.hpp"

namespace flowrun::parallel {

pipeline::Config pipeline_config(const RunSettings::Parallel& p) {
  if (p.pp == 1) {
    auto refuse = [](const std::string& what) {
      throw std::runtime_error("run.parallel." + what + " is set, but run.parallel.pp is 1 (no pipeline stages); set pp, "
                               "or drop it" + (what.rfind("microbatches", 0) == 0
                                                   ? std::string(" (forward_backward's accumulate cuts a batch into micro-batches on one stage)")
                                                   : std::string()));
    };
    if (p.microbatches != 1) refuse("microbatches (" + std::to_string(p.microbatches) + ")");
    if (p.schedule != "1f1b") refuse("schedule (" + p.schedule + ")");
    if (p.virtual_stages != 1) refuse("virtual_stages (" + std::to_string(p.virtual_stages) + ")");
    if (!p.stage_layers.empty()) refuse("stage_layers");
  }
  const pipeline::Config c = pipeline::Config::of(p.pp, p.microbatches, p.schedule, p.virtual_stages);
  c.check();
  return c;
}

namespace {
const NodeSchema::Family* family_of(const NodeSpec& model) {
  const NodeType* t = Registry::global().find(model.type);
  return t && t->schema.family ? &*t->schema.family : nullptr;
}
}  // namespace

std::vector<int64_t> tp_split_sizes(const NodeSpec& model) {
  std::vector<int64_t> sizes;
  if (const NodeSchema::Family* f = family_of(model))
    for (const std::string& k : f->tp_divides)
      if (model.params[k] && model.params[k].IsScalar()) sizes.push_back(model.params[k].as<int64_t>());
  return sizes;
}

std::vector<const NodeSpec*> batch_sources(const GraphSpec& g, const std::string& feeding) {
  std::set<std::string> upstream;  // `feeding` and every node its inputs come from
  if (!feeding.empty()) {
    std::vector<std::string> todo{feeding};
    while (!todo.empty()) {
      const std::string at = todo.back();
      todo.pop_back();
      const int i = g.index_of(at);
      if (i < 0 || !upstream.insert(at).second) continue;
      for (const InputSpec& in : g.nodes[static_cast<size_t>(i)].inputs)
        for (const auto& ref : in.refs) todo.push_back(ref.node);
    }
  }
  std::vector<const NodeSpec*> out;
  for (const NodeSpec& n : g.nodes) {
    const NodeType* t = Registry::global().find(n.type);
    if (!t || !t->schema.output("batch") || !t->schema.param("batch") || !n.params["batch"] || !n.params["batch"].IsScalar())
      continue;
    if (feeding.empty() || upstream.count(n.name)) out.push_back(&n);
  }
  return out;
}

std::string alike_blocks_param(const NodeSpec& model) {
  const NodeSchema::Family* f = family_of(model);
  return f ? f->alike_blocks : "";
}

bool tp_divides(const std::vector<int64_t>& sizes, int t) {
  for (const int64_t s : sizes)
    if (t < 1 || s % t != 0) return false;
  return true;
}

std::string describe_layout(const GraphSpec& g, int world) {
  const RunSettings::Parallel& p = g.settings.parallel;
  std::string out = "processes: ";
  try {
    const Mesh mesh(world, p.tp, p.pp, p.ep);
    out += mesh.describe() + " (run.parallel, tp fastest" + (p.ep > 1 ? std::string("; ep cut out of dp") : "") + ")\n";
    for (const auto& line : mesh.table()) out += "  " + line + "\n";
    const pipeline::Config c = pipeline_config(p);
    if (p.pp > 1) {
      // The schedule each stage runs (the same rule forward_backward executes), with unit costs.
      const pipeline::Schedule s = pipeline::make(c);
      out += "pipeline: " + std::to_string(p.pp) + " stages, schedule " + p.schedule + ", " +
             std::to_string(p.microbatches) + " micro-batches" +
             (p.virtual_stages > 1 ? ", " + std::to_string(p.virtual_stages) + " chunks a stage" : std::string()) +
             "; each stage's program and its predicted idle share (costs F 1, B 1, W 1" +
             (c.kind == pipeline::Kind::zero_bubble ? "" : ", B without its W split off: 2") + "; .. = waiting):\n";
      for (const auto& line : s.render()) out += "  " + line + "\n";
    }
  } catch (const std::exception& e) {
    out += std::string("cannot run: ") + e.what() + "\n";
  }
  return out;
}

}  // namespace flowrun::parallel
