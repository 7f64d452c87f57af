#include "registry.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <stdexcept>

#include "plugin_api.hpp"  // current_plugin_file(): set while a plugin registers

namespace flowrun {

namespace detail {
const std::map<std::string, std::string>& embedded_schemas();  // generated (schemas_embedded.cpp)
const std::map<std::string, std::string>& embedded_groups();   // the same, schemas/groups/*.yaml

Registrar::Registrar(const char* type, NodeFactory f) {
  const std::string& text = builtin_schema(type);
  if (text.empty()) {
    // A built-in without schemas/TYPE.yaml is a build mistake; say it loudly at start-up.
    spdlog::error("built-in node type '{}' has no schemas/{}.yaml; it is not registered", type, type);
    return;
  }
  Registry::global().add(text, std::move(f), "built-in");
}
}  // namespace detail

Registry& Registry::global() {
  static Registry r;
  return r;
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
  auto it = types_.find(type);
  if (it == types_.end()) throw std::runtime_error("no node type '" + type + "' is registered to extend");
  edit(it->second.schema);
}

const NodeType* Registry::find(const std::string& type) const {
  auto it = types_.find(type);
  return it == types_.end() ? nullptr : &it->second;
}

std::vector<std::string> Registry::types() const {
  std::vector<std::string> v;
  for (const auto& [k, _] : types_) v.push_back(k);
  return v;
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
