#include "registry.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <mutex>
#include <stdexcept>

#include "plugin_api.hpp"  // current_plugin_file(): set while a plugin registers

namespace flowrun {

namespace detail {
const std::map<std::string, std::string>& embedded_schemas();  // generated (schemas_embedded.cpp)
const std::map<std::string, std::string>& embedded_groups();   // the same, schemas/groups/*.yaml

namespace {
// The built-in types' factories, filled by FLOWRUN_NODE while the node library loads.
struct Factories {
  std::mutex mu;
  std::map<std::string, NodeFactory> by_type;
};
Factories& builtin_factories() {
  static Factories f;
  return f;
}
NodeFactory loaded_factory(const std::string& type) {
  Factories& f = builtin_factories();
  std::lock_guard<std::mutex> lock(f.mu);
  auto it = f.by_type.find(type);
  return it == f.by_type.end() ? NodeFactory() : it->second;
}
}  // namespace

Registrar::Registrar(const char* type, NodeFactory f) {
  if (builtin_schema(type).empty()) {
    // A built-in without schemas/TYPE.yaml is a build mistake; say it loudly at start-up.
    spdlog::error("built-in node type '{}' has no schemas/{}.yaml; it is not registered", type, type);
    return;
  }
  Factories& fs = builtin_factories();
  std::lock_guard<std::mutex> lock(fs.mu);
  fs.by_type[type] = std::move(f);
}
}  // namespace detail

bool builtin_type_loaded(const std::string& type) { return static_cast<bool>(detail::loaded_factory(type)); }

// Every built-in type from its embedded schema, so that checking, drawing and explaining a graph
// need neither the node library nor libtorch; a built-in's factory is its FLOWRUN_NODE's, looked
// up when a node is made (by then the run has loaded the node library). A schema is parsed the
// first time its type is asked for: a graph names a few of some sixty.
Registry& Registry::global() {
  static Registry* r = [] {
    auto* g = new Registry;  // never destroyed: plugins' and nodes' static objects may outlive main
    for (const std::string& type : builtin_types()) g->unparsed_.insert(type);
    return g;
  }();
  return *r;
}

void Registry::parse_builtin(const std::string& type) const {
  std::lock_guard<std::mutex> lock(parse_mu_);
  if (!unparsed_.erase(type)) return;
  NodeFactory make = [type]() -> std::unique_ptr<Node> {
    NodeFactory f = detail::loaded_factory(type);
    if (!f)
      throw std::runtime_error("built-in node type '" + type + "': the node library (libflowrun_nodes.so) is not " +
                               "loaded in this process; link it, or load a plugin that does");
    return f();
  };
  types_[type] = NodeType{parse_node_schema(builtin_schema(type), "built-in"), std::move(make)};
}

void Registry::add(const std::string& schema_yaml, NodeFactory factory, const std::string& origin) {
  add(parse_node_schema(schema_yaml, origin), std::move(factory));
}

void Registry::add(NodeSchema schema, NodeFactory factory) { add(std::move(schema), std::move(factory), false); }

void Registry::replace(const std::string& schema_yaml, NodeFactory factory, const std::string& origin) {
  add(parse_node_schema(schema_yaml, origin), std::move(factory), true);
}

void Registry::add(NodeSchema schema, NodeFactory factory, bool replace) {
  std::string name = schema.type;
  parse_builtin(name);  // a built-in replaced or refused is named as one
  auto it = types_.find(name);
  if (it != types_.end()) {
    const std::string& before = it->second.schema.origin;
    if (replace)
      spdlog::warn("node type '{}' from {} replaces the one from {} (registered with replace(): on purpose)", name,
                   schema.origin, before);
    else if (!current_plugin_file().empty())
      throw std::runtime_error("node type '" + name + "' is already registered (from " + before +
                               "); a plugin does not replace a type by accident: rename the type in the plugin, or, to "
                               "replace it on purpose, register it with reg.replace(...) instead of reg.add(...)");
    else
      spdlog::info("node type '{}' from {} replaces the one from {}", name, schema.origin, before);
  }
  types_[name] = NodeType{std::move(schema), std::move(factory)};
}

void Registry::extend(const std::string& type, const std::function<void(NodeSchema&)>& edit) {
  parse_builtin(type);
  auto it = types_.find(type);
  if (it == types_.end()) throw std::runtime_error("no node type '" + type + "' is registered to extend");
  edit(it->second.schema);
}

const NodeType* Registry::find(const std::string& type) const {
  parse_builtin(type);
  auto it = types_.find(type);
  return it == types_.end() ? nullptr : &it->second;
}

std::vector<std::string> Registry::types() const {
  std::vector<std::string> v;
  {
    std::lock_guard<std::mutex> lock(parse_mu_);
    v.assign(unparsed_.begin(), unparsed_.end());
  }
  for (const auto& [k, _] : types_) v.push_back(k);
  std::sort(v.begin(), v.end());
  return v;
}

std::vector<std::string> Registry::families() const {
  std::vector<std::string> out;
  for (const std::string& t : types())
    if (const NodeType* n = find(t); n && n->schema.family) out.push_back(t);
  return out;
}

const std::string& builtin_schema(const std::string& type) {
  static const std::string none;
  const auto& m = detail::embedded_schemas();
  auto it = m.find(type);
  return it == m.end() ? none : it->second;
}

std::vector<std::string> builtin_types() {
  std::vector<std::string> v;
  for (const auto& [type, _] : detail::embedded_schemas())
    if (type != "graph") v.push_back(type);
  return v;
}

// The built-in groups are parsed on first use: node types register at load time, in an order
// the linker picks, and their schemas ask for groups as they are parsed.
static const std::map<std::string, ParamGroup>& builtin_groups() {
  static const std::map<std::string, ParamGroup> m = [] {
    std::map<std::string, ParamGroup> g;
    for (const auto& [name, text] : detail::embedded_groups()) {
      ParamGroup pg = parse_param_group(text, "schemas/groups/" + name + ".yaml");
      if (pg.name != name)
        throw std::logic_error("schemas/groups/" + name + ".yaml names itself '" + pg.name + "'; make them equal");
      g.emplace(name, std::move(pg));
    }
    return g;
  }();
  return m;
}

const ParamGroup* find_param_group(const std::string& name) {
  auto it = builtin_groups().find(name);
  return it == builtin_groups().end() ? nullptr : &it->second;
}

std::vector<std::string> param_group_names() {
  std::vector<std::string> v;
  for (const auto& [name, _] : builtin_groups()) v.push_back(name);
  return v;
}

const ParamSchema* GraphFileSchema::run() const {
  for (const auto& p : top)
    if (p.name == "run") return &p;
  return nullptr;
}

const GraphFileSchema& graph_schema() {
  static const GraphFileSchema s = [] {
    GraphFileSchema g;
    const std::string& text = builtin_schema("graph");
    NodeSchema ns = parse_node_schema(text, "schemas/graph.yaml");
    g.top = ns.params;
    YAML::Node root = YAML::Load(text);
    Diagnostics d;
    for (auto it = root["node"].begin(); it != root["node"].end(); ++it) {
      std::string k = it->first.as<std::string>();
      g.node_keys.push_back(parse_param_schema(k, it->second, "schemas/graph.yaml", "node." + k, d));
    }
    if (!d.empty()) throw GraphError(d);
    return g;
  }();
  return s;
}

}  // namespace flowrun
