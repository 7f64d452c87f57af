// Registry: node type name -> schema + factory. The built-in node types are known from their
// schemas (schemas/TYPE.yaml, embedded in the engine at build time) from the start: checking,
// drawing and explaining a graph (flowrun validate, dot, explain, nodes) load neither the node
// library nor libtorch. Their factories come with the node library: FLOWRUN_NODE registers each
// as libflowrun_nodes.so loads. Plugins register theirs from their entry point (plugin_api.hpp).
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "node.hpp"
#include "schema.hpp"

namespace flowrun {

struct NodeType {
  NodeSchema schema;
  NodeFactory factory;
};

class Registry {
 public:
  // The process-wide registry: every built-in type (its factory works once the node library is
  // loaded), and what plugins add.
  static Registry& global();

  // Register a type; the schema's `type:` is its name. From a plugin (while its entry point
  // runs), a name that is already registered (a built-in, another plugin's) is refused with
  // std::runtime_error naming the type and both origins: a plugin's `optimizer` would change
  // what every graph that names `optimizer` runs (MediaPipe and DALI refuse a second
  // registration too). replace() is the same but says it is meant: it replaces the type and
  // logs a warning naming both. Elsewhere (built-ins, tests) a second registration replaces
  // the first and is logged.
  void add(const std::string& schema_yaml, NodeFactory factory, const std::string& origin);
  void add(NodeSchema schema, NodeFactory factory);
  void replace(const std::string& schema_yaml, NodeFactory factory, const std::string& origin);
  const NodeType* find(const std::string& type) const;
  // Change a registered type's schema: a plugin that adds a choice to a built-in type (an update
  // rule of the optimizer, nodes/train/update_rule.hpp) adds its enum value and settings. Throws
  // naming the type when none is registered.
  void extend(const std::string& type, const std::function<void(NodeSchema&)>& edit);
  std::vector<std::string> types() const;  // sorted
  // The model families (types whose schema has `family:`: they split over tensor parallel and cut
  // into pipeline stages), sorted; for messages that say what a setting is built for.
  std::vector<std::string> families() const;
  std::vector<std::string> plugins() const { return plugins_; }
  void note_plugin(const std::string& path) { plugins_.push_back(path); }

 private:
  void add(NodeSchema schema, NodeFactory factory, bool replace);
  void parse_builtin(const std::string& type) const;  // if it is a built-in not parsed yet
  mutable std::map<std::string, NodeType> types_;
  mutable std::set<std::string> unparsed_;  // built-ins (global() only) whose schemas were not asked for yet
  mutable std::mutex parse_mu_;
  std::vector<std::string> plugins_;
};

// Whether the node library that makes built-in `type` is loaded (its FLOWRUN_NODE ran).
bool builtin_type_loaded(const std::string& type);
// The schema text of a built-in type, embedded from schemas/TYPE.yaml ("" if none).
const std::string& builtin_schema(const std::string& type);
// The node types that have an embedded schema (schemas/*.yaml but graph.yaml), sorted.
std::vector<std::string> builtin_types();
// The graph file's own schema (schemas/graph.yaml), parsed once.
struct GraphFileSchema {
  std::vector<ParamSchema> top;        // flowrun, name, run (with its fields), plugins, nodes
  std::vector<ParamSchema> node_keys;  // type, in, with, every, at, stream, doc
  const ParamSchema* run() const;
};
const GraphFileSchema& graph_schema();

namespace detail {
struct Registrar {
  Registrar(const char* type, NodeFactory f);
};
}  // namespace detail

}  // namespace flowrun

#define FLOWRUN_CONCAT_(a, b) a##b
#define FLOWRUN_CONCAT(a, b) FLOWRUN_CONCAT_(a, b)
// Built-in node type TYPE is implemented by CLASS (its factory, as the library loads); its schema
// is schemas/TYPE.yaml, which the registry already holds.
#define FLOWRUN_NODE(TYPE, CLASS)                                                    \
  static ::flowrun::detail::Registrar FLOWRUN_CONCAT(flowrun_registrar_, TYPE)(     \
      #TYPE, [] { return std::unique_ptr<::flowrun::Node>(new CLASS()); });
