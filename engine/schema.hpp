// Node type schemas: the ports and parameters of a node type, read from schemas/TYPE.yaml
// (built-ins, embedded at build time) or from a string a plugin registers. The checker
// validates graph files against them and `flowrun nodes TYPE` prints them as docs.
//
// Format (see docs/schemas.md):
//   type: optimizer
//   doc: One line that says what the node does.
//   stateless: false          # true: may run several steps at once (no per-step order)
//   compute: true             # its run() is tensor math: runs on the compute thread
//   collectives: { group: dp, doc: "..." }   # it talks to other ranks: over which group of the
//                             # mesh (world, dp, tp, pp; nodes/parallel/mesh.hpp), and what
//   family: { tp_divides: [heads, vocab], alike_blocks: layers }   # a model family that
//                             # splits over tp and cuts into pipeline stages (models/family.hpp)
//   inputs:
//     grads: { kind: value, type: grads, doc: ... }
//     model: { kind: state, access: write, type: params }
//     src:   { kind: state, access: read, setup: write }   # read each step; written once at setup
//     "*":   { kind: value, type: any }        # any port name (e.g. metrics)
//   outputs:
//     lr:    { kind: value, type: scalar }
//     state: { kind: state, access: write, type: optimizer_state }  # owned, written each step
//   groups: [text_encoder]    # shared parameter groups (schemas/groups/NAME.yaml), see ParamGroup
//   params:
//     lr:    { type: float, default: 1e-3, min: 0, doc: ... }
//     kind:  { type: enum, values: [adamw, sgd], default: adamw }
//     vae:   { group: autoencoder_kl, doc: ... }   # a map whose fields are a group's
//     adamw: { type: map, when: { kind: adamw }, fields: {...} }  # set only with kind: adamw
//   moved:                    # parameters no longer taken, and where their setting went
//     shard: "the ZeRO plan is a node of its own now: ..."
#pragma once
#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <map>
#include <string>
#include <vector>

#include "diag.hpp"

namespace flowrun {

enum class PortKind { Value, State, Stream };
// State access. Inputs: read or write. Outputs (owned state): none (created once, only
// others access it) or write (the owner updates it every step it runs, e.g. a data cursor).
enum class Access { None, Read, Write };

const char* to_string(PortKind k);
const char* to_string(Access a);

struct PortSchema {
  std::string name;  // "*" matches any name
  PortKind kind = PortKind::Value;
  Access access = Access::None;
  std::string type = "any";  // what travels: tensor, scalar, batch, params, grads, ... ("any" matches all)
  std::string dtype;         // optional, e.g. float32; "" = unknown
  int rank = -1;             // optional tensor rank; -1 = unknown
  bool optional = false;     // inputs: may be left unconnected
  bool many = false;         // inputs: takes a list of refs, e.g. [model.params, opt.state]
  // State inputs read each step (access: read) that the node also writes once, in its setup
  // (schema `setup: write`): a note for the object's other users (an EMA's note of the memory it
  // keeps, on the model it averages). Setup runs in file order before any step, so the steps'
  // order is unchanged; `flowrun explain` and `dot` show the write.
  bool setup_write = false;
  std::string doc;
};

enum class ParamType { Int, Float, Bool, String, Enum, List, Map, Any };
const char* to_string(ParamType t);

struct ParamSchema {
  std::string name;
  ParamType type = ParamType::Any;
  YAML::Node default_value;  // IsDefined() && !IsNull() when there is a default
  bool has_default = false;
  bool required = false;
  bool nullable = false;  // null is a valid value (e.g. weights: null = random init)
  bool infinite = false;  // float: .inf and -.inf are valid values (NaN never is)
  std::optional<double> min, max;
  std::vector<std::string> values;     // enum choices
  std::shared_ptr<ParamSchema> items;  // list: schema of each item
  std::vector<ParamSchema> fields;     // map: known keys; empty = any keys
  // `when: { kind: adamw }`: the parameter belongs to one choice of a sibling enum (an
  // optimizer's settings of one update rule); setting it while the sibling has another value is
  // an error. when_param empty: always applies.
  std::string when_param;
  std::vector<std::string> when_values;
  std::string doc;

  const ParamSchema* field(const std::string& n) const;
  std::vector<std::string> field_names() const;
  std::string type_str() const;  // "float in [0, 1]", "enum {adamw, sgd}", "list of string"
};

struct NodeSchema {
  std::string type;
  std::string doc;
  bool stateless = false;
  bool compute = false;  // tensor math: on the compute thread (RunOptions::compute_thread)
  // Collectives with the other ranks: per mesh group they run over (world, dp, tp, pp), what is
  // exchanged there (schema `collectives:`, one { group, doc } or a list of them); none for a
  // node that talks to no one. `flowrun explain` and `flowrun nodes` print them.
  struct Collectives {
    std::string group, doc;
  };
  std::vector<Collectives> collectives;
  // A model family that splits over tensor parallel and cuts into pipeline stages (schema
  // `family:`; its module declares the rest, models/family.hpp): what the planner and the memory
  // advice read from a graph file before any model is built. tp_divides: the parameters
  // run.parallel.tp must divide (heads, MLP widths, the vocabulary); alike_blocks: the parameter
  // that counts the blocks when every block is the same (`flowrun plan` profiles a few and repeats
  // their times), "" when they differ. Absent: the node's model is whole on every rank and one stage.
  struct Family {
    std::vector<std::string> tp_divides;
    std::string alike_blocks;
  };
  std::optional<Family> family;
  std::vector<PortSchema> inputs, outputs;
  std::vector<ParamSchema> params;
  // Parameters this type no longer takes, and where their setting went (schema `moved:`): a
  // graph file still setting one is told that instead of "unknown parameter".
  std::map<std::string, std::string> moved;
  std::string origin = "built-in";  // or the plugin file it came from

  const PortSchema* input(const std::string& name) const;   // honours "*"
  const PortSchema* output(const std::string& name) const;
  const ParamSchema* param(const std::string& name) const;
  std::vector<std::string> input_names() const;
  std::vector<std::string> output_names() const;
  std::vector<std::string> param_names() const;
};

// A shared parameter group: parameters several node types declare the same way, written once
// in schemas/groups/NAME.yaml (`group: NAME`, `doc:`, `params:`). A schema uses one with
// `groups: [NAME, ...]` (its parameters join the type's own, first) or, for a map parameter,
// `group: NAME` (they become its fields, before any `fields:` of its own).
struct ParamGroup {
  std::string name, doc, origin;
  std::vector<ParamSchema> params;
};
ParamGroup parse_param_group(const std::string& text, const std::string& origin);
// The built-in groups (embedded from schemas/groups/*.yaml; registry.cpp), parsed once.
const ParamGroup* find_param_group(const std::string& name);
std::vector<std::string> param_group_names();

// Parse a schema document. `origin` names where it came from in error messages.
// Throws GraphError listing every problem in the schema itself.
NodeSchema parse_node_schema(const std::string& text, const std::string& origin);
ParamSchema parse_param_schema(const std::string& name, const YAML::Node& n, const std::string& origin,
                               const std::string& path, Diagnostics& diags);

// Check `value` against `ps`; report problems under `path`; return the value with defaults of
// map fields filled in (so nodes read every documented parameter without re-stating defaults).
YAML::Node check_param(const ParamSchema& ps, const YAML::Node& value, const std::string& file,
                       const std::string& path, Diagnostics& diags);
// Check a map of parameters (a node's `with:`, the graph's `run:`) and fill defaults.
// `moved`: retired parameter names and where their setting went (NodeSchema::moved).
YAML::Node check_params(const std::vector<ParamSchema>& params, const YAML::Node& map, const Mark& where,
                        const std::string& file, const std::string& path, Diagnostics& diags,
                        const std::map<std::string, std::string>& moved = {});

Mark mark_of(const YAML::Node& n, const std::string& file);

// YAML text from a user (graph file, override value, node schema) as a node (yaml_load.cpp).
// Throws GraphError (with `diags` and the problem, naming `file` and the line) for syntax
// errors, alias cycles, alias bombs, nesting over 64 levels and keys that are not plain
// scalars; adds duplicate keys and a second document to `diags` and returns the node, so that
// the checker goes on to report the rest. `aliased`, where given, is set to whether the text
// holds an alias (a node that may be shared: parse.cpp's unshared).
inline constexpr int kYamlMaxDepth = 64;                 // levels of nesting
inline constexpr uint64_t kYamlMaxNodes = 1'000'000;     // nodes, aliases expanded
YAML::Node load_yaml(const std::string& text, const std::string& file, Diagnostics& diags, bool* aliased = nullptr);

// The schema as human docs (for `flowrun nodes TYPE`).
std::string describe(const NodeSchema& s);

}  // namespace flowrun
