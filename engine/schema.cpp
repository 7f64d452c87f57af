#include "schema.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace flowrun {

const char* to_string(PortKind k) {
  switch (k) {
    case PortKind::Value: return "value";
    case PortKind::State: return "state";
    case PortKind::Stream: return "stream";
  }
  return "?";
}
const char* to_string(Access a) {
  switch (a) {
    case Access::None: return "none";
    case Access::Read: return "read";
    case Access::Write: return "write";
  }
  return "?";
}
const char* to_string(ParamType t) {
  switch (t) {
    case ParamType::Int: return "int";
    case ParamType::Float: return "float";
    case ParamType::Bool: return "bool";
    case ParamType::String: return "string";
    case ParamType::Enum: return "enum";
    case ParamType::List: return "list";
    case ParamType::Map: return "map";
    case ParamType::Any: return "any";
  }
  return "?";
}

Mark mark_of(const YAML::Node& n, const std::string& file) {
  Mark m;
  YAML::Mark ym = n.Mark();
  // A map or list copied from an alias (parse.cpp: unshared) has no position of its own: its
  // first entry's is where it starts.
  if ((ym.is_null() || ym.line < 0) && (n.IsMap() || n.IsSequence()) && n.size() > 0)
    return mark_of(n.IsMap() ? n.begin()->first : n[0], file);
  if (ym.is_null() || ym.line < 0) {
    m.file = "command line";  // created by an override: no position in the file
    return m;
  }
  m.file = file;
  m.line = ym.line + 1;
  m.col = ym.column + 1;
  return m;
}

const ParamSchema* ParamSchema::field(const std::string& n) const {
  for (const auto& f : fields)
    if (f.name == n) return &f;
  return nullptr;
}
std::vector<std::string> ParamSchema::field_names() const {
  std::vector<std::string> v;
  for (const auto& f : fields) v.push_back(f.name);
  return v;
}

static std::string num(double d) {
  std::ostringstream o;
  o << d;
  return o.str();
}

std::string ParamSchema::type_str() const {
  std::string s = to_string(type);
  if (type == ParamType::Enum) s = "one of {" + join(values) + "}";
  if (type == ParamType::List && items) s = "list of " + items->type_str();
  if (min && max)
    s += " in [" + num(*min) + ", " + num(*max) + "]";
  else if (min)
    s += " >= " + num(*min);
  else if (max)
    s += " <= " + num(*max);
  if (nullable) s += " or null";
  return s;
}

const PortSchema* find_port(const std::vector<PortSchema>& ports, const std::string& name) {
  const PortSchema* wildcard = nullptr;
  for (const auto& p : ports) {
    if (p.name == name) return &p;
    if (p.name == "*") wildcard = &p;
  }
  return wildcard;
}
const PortSchema* NodeSchema::input(const std::string& name) const { return find_port(inputs, name); }
const PortSchema* NodeSchema::output(const std::string& name) const { return find_port(outputs, name); }
const ParamSchema* NodeSchema::param(const std::string& name) const {
  for (const auto& p : params)
    if (p.name == name) return &p;
  return nullptr;
}
static std::vector<std::string> names_of(const std::vector<PortSchema>& ports) {
  std::vector<std::string> v;
  for (const auto& p : ports)
    if (p.name != "*") v.push_back(p.name);
  return v;
}
std::vector<std::string> NodeSchema::input_names() const { return names_of(inputs); }
std::vector<std::string> NodeSchema::output_names() const { return names_of(outputs); }
std::vector<std::string> NodeSchema::param_names() const {
  std::vector<std::string> v;
  for (const auto& p : params) v.push_back(p.name);
  return v;
}

// ---- reading schema documents -------------------------------------------------------------

namespace {

struct SchemaReader {
  const std::string& origin;
  Diagnostics& diags;

  void unknown_keys(const YAML::Node& map, const std::vector<std::string>& known, const std::string& path) {
    if (!map.IsMap()) return;
    for (auto it = map.begin(); it != map.end(); ++it) {
      std::string k = it->first.as<std::string>();
      bool ok = false;
      for (const auto& kk : known) ok = ok || kk == k;
      if (!ok)
        diags.error(mark_of(it->first, origin), path + "." + k,
                    "unknown schema key '" + k + "'" + did_you_mean(k, known) + "; allowed: " + join(known));
    }
  }

  PortSchema port(const std::string& name, const YAML::Node& n, bool is_input, const std::string& path) {
    PortSchema p;
    p.name = name;
    if (!n.IsMap()) {
      diags.error(mark_of(n, origin), path, "a port is a map like { kind: value, type: tensor, doc: ... }");
      return p;
    }
    unknown_keys(n, {"kind", "access", "setup", "type", "dtype", "rank", "optional", "many", "doc"}, path);
    std::string kind = n["kind"] ? n["kind"].as<std::string>() : "value";
    if (kind == "value")
      p.kind = PortKind::Value;
    else if (kind == "state")
      p.kind = PortKind::State;
    else if (kind == "stream")
      p.kind = PortKind::Stream;
    else
      diags.error(mark_of(n["kind"], origin), path + ".kind", "kind must be value, state or stream, not '" + kind + "'");
    std::string access = n["access"] ? n["access"].as<std::string>() : "";
    if (p.kind == PortKind::State) {
      if (access == "read")
        p.access = Access::Read;
      else if (access == "write")
        p.access = Access::Write;
      else if (access == "none" || (access.empty() && !is_input))
        p.access = Access::None;
      else
        diags.error(mark_of(n, origin), path + ".access",
                    is_input ? "a state input needs access: read or write"
                             : "a state output's access is none (created only) or write (updated every step)");
      if (is_input && p.access == Access::None)
        diags.error(mark_of(n, origin), path + ".access", "a state input needs access: read or write");
    } else if (!access.empty()) {
      diags.error(mark_of(n["access"], origin), path + ".access", "only state ports have an access mode");
    }
    if (n["setup"]) {
      const std::string setup = n["setup"].IsScalar() ? n["setup"].as<std::string>() : "";
      if (setup != "write" || !is_input || p.kind != PortKind::State || p.access != Access::Read)
        diags.error(mark_of(n["setup"], origin), path + ".setup",
                    "setup: write belongs to a state input read each step (access: read) that the node writes once "
                    "in its setup; an input it writes each step is access: write");
      else
        p.setup_write = true;
    }
    if (n["type"]) p.type = n["type"].as<std::string>();
    if (n["dtype"]) p.dtype = n["dtype"].as<std::string>();
    if (n["rank"]) p.rank = n["rank"].as<int>();
    if (n["optional"]) p.optional = n["optional"].as<bool>();
    if (n["many"]) p.many = n["many"].as<bool>();
    if (n["doc"]) p.doc = n["doc"].as<std::string>();
    if (!is_input && (p.optional || p.many))
      diags.error(mark_of(n, origin), path, "optional and many apply to inputs only");
    return p;
  }

  std::vector<PortSchema> ports(const YAML::Node& n, bool is_input, const std::string& path) {
    std::vector<PortSchema> v;
    if (!n || n.IsNull()) return v;
    if (!n.IsMap()) {
      diags.error(mark_of(n, origin), path, "ports are a map: name: { kind: ..., type: ... }");
      return v;
    }
    for (auto it = n.begin(); it != n.end(); ++it) {
      std::string name = it->first.as<std::string>();
      v.push_back(port(name, it->second, is_input, path + "." + name));
    }
    return v;
  }
};

ParamType param_type(const std::string& s, bool& ok) {
  ok = true;
  if (s == "int") return ParamType::Int;
  if (s == "float") return ParamType::Float;
  if (s == "bool") return ParamType::Bool;
  if (s == "string" || s == "path") return ParamType::String;
  if (s == "enum") return ParamType::Enum;
  if (s == "list") return ParamType::List;
  if (s == "map") return ParamType::Map;
  if (s == "any") return ParamType::Any;
  ok = false;
  return ParamType::Any;
}

}  // namespace

// Append `p` to `to`, refusing a second parameter of the same name (a type's own parameter
// clashing with a group's, or two groups sharing a name).
static void add_param(std::vector<ParamSchema>& to, ParamSchema p, const YAML::Node& key, const std::string& origin,
                      const std::string& path, Diagnostics& diags) {
  for (const auto& q : to)
    if (q.name == p.name) {
      diags.error(mark_of(key, origin), path + "." + p.name,
                  "parameter '" + p.name + "' is declared twice (a shared group already has it: drop one)");
      return;
    }
  to.push_back(std::move(p));
}

// Append the parameters of the shared group named by `name` (a scalar) to `to`.
static void add_group_params(std::vector<ParamSchema>& to, const YAML::Node& name, const std::string& origin,
                             const std::string& path, Diagnostics& diags) {
  const std::string g = name.IsScalar() ? name.Scalar() : "";
  const ParamGroup* group = g.empty() ? nullptr : find_param_group(g);
  if (!group) {
    const std::vector<std::string> known = param_group_names();
    diags.error(mark_of(name, origin), path,
                "no shared parameter group '" + g + "'" + did_you_mean(g, known) + "; groups: " + join(known) +
                    " (schemas/groups/NAME.yaml)");
    return;
  }
  for (const auto& p : group->params) add_param(to, p, name, origin, path, diags);
}

ParamSchema parse_param_schema(const std::string& name, const YAML::Node& n, const std::string& origin,
                               const std::string& path, Diagnostics& diags) {
  ParamSchema ps;
  ps.name = name;
  SchemaReader r{origin, diags};
  if (!n.IsMap()) {
    diags.error(mark_of(n, origin), path, "a parameter is a map like { type: float, default: 1e-3, doc: ... }");
    return ps;
  }
  r.unknown_keys(n, {"type", "default", "required", "nullable", "infinite", "min", "max", "values", "items", "fields",
                     "group", "when", "doc"},
                 path);
  bool ok = true;
  std::string t = n["type"] ? n["type"].as<std::string>() : n["group"] ? "map" : "any";
  ps.type = param_type(t, ok);
  if (!ok)
    diags.error(mark_of(n["type"], origin), path + ".type",
                "unknown parameter type '" + t + "'; use int, float, bool, string, enum, list, map or any");
  try {
    if (n["min"]) ps.min = n["min"].as<double>();
    if (n["max"]) ps.max = n["max"].as<double>();
  } catch (const YAML::Exception&) {
    diags.error(mark_of(n, origin), path, "min and max must be numbers");
  }
  if (n["required"]) ps.required = n["required"].as<bool>();
  if (n["nullable"]) ps.nullable = n["nullable"].as<bool>();
  if (n["infinite"]) ps.infinite = n["infinite"].as<bool>();
  if (n["doc"]) ps.doc = n["doc"].as<std::string>();
  if (n["values"]) {
    for (const auto& v : n["values"]) ps.values.push_back(v.as<std::string>());
  }
  if (ps.type == ParamType::Enum && ps.values.empty())
    diags.error(mark_of(n, origin), path, "an enum parameter needs values: [...]");
  if (n["items"]) ps.items = std::make_shared<ParamSchema>(parse_param_schema("item", n["items"], origin, path + ".items", diags));
  if (n["when"]) {
    const YAML::Node w = n["when"];
    // Copies of the one entry (an iterator's -> points into the iterator, a temporary here).
    const bool one = w.IsMap() && w.size() == 1;
    const YAML::Node key = one ? YAML::Node(w.begin()->first) : YAML::Node();
    const YAML::Node value = one ? YAML::Node(w.begin()->second) : YAML::Node();
    if (!one || !key.IsScalar() || !(value.IsScalar() || value.IsSequence())) {
      diags.error(mark_of(w, origin), path + ".when", "when: names one sibling parameter and its value(s), e.g. { kind: adamw }");
    } else {
      ps.when_param = key.as<std::string>();
      if (value.IsScalar())
        ps.when_values.push_back(value.as<std::string>());
      else
        for (const auto& v : value) ps.when_values.push_back(v.as<std::string>());
    }
  }
  if (n["group"]) {
    // A map whose fields are a shared group's parameters (then its own `fields`, if any).
    if (ps.type != ParamType::Map) diags.error(mark_of(n["group"], origin), path + ".group", "only a map parameter takes a group's fields");
    add_group_params(ps.fields, n["group"], origin, path + ".group", diags);
  }
  if (n["fields"]) {
    const YAML::Node& f = n["fields"];
    for (auto it = f.begin(); it != f.end(); ++it) {
      std::string k = it->first.as<std::string>();
      add_param(ps.fields, parse_param_schema(k, it->second, origin, path + ".fields." + k, diags), it->first, origin,
                path, diags);
    }
  }
  if (n["default"]) {
    ps.default_value = YAML::Clone(n["default"]);
    ps.has_default = !n["default"].IsNull() || ps.nullable;
    if (!n["default"].IsNull()) {
      // A schema's own default must pass its own checks.
      Diagnostics d;
      check_param(ps, ps.default_value, origin, path + ".default", d);
      diags.append(d);
    } else if (!ps.nullable) {
      diags.error(mark_of(n["default"], origin), path + ".default", "default is null; add nullable: true");
    }
  }
  return ps;
}

NodeSchema parse_node_schema(const std::string& text, const std::string& origin) {
  Diagnostics diags;
  NodeSchema s;
  s.origin = origin;
  YAML::Node root = load_yaml(text, origin, diags);
  if (!root.IsMap()) {
    diags.error({origin, 1, 1}, "", "a schema is a map with type, doc, inputs, outputs, params");
    throw GraphError(diags);
  }
  SchemaReader r{origin, diags};
  r.unknown_keys(root, {"type", "doc", "stateless", "compute", "collectives", "family", "inputs", "outputs", "groups", "params",
                  "moved", "node"},
                 "schema");
  if (!root["type"]) diags.error({origin, 1, 1}, "type", "the schema must name its node type: type: NAME");
  try {
    if (root["type"]) s.type = root["type"].as<std::string>();
    if (root["doc"]) s.doc = root["doc"].as<std::string>();
    if (root["stateless"]) s.stateless = root["stateless"].as<bool>();
    if (root["compute"]) s.compute = root["compute"].as<bool>();
    if (const YAML::Node& all = root["collectives"]) {
      std::vector<YAML::Node> items;
      if (all.IsSequence())
        for (const auto& c : all) items.push_back(c);
      else
        items.push_back(all);
      for (const YAML::Node& c : items) {
        const YAML::Node group = c.IsMap() ? c["group"] : YAML::Node();
        const std::string g = group && group.IsScalar() ? group.as<std::string>() : "";
        if (c.IsMap()) r.unknown_keys(c, {"group", "doc"}, "collectives");
        if (g != "world" && g != "dp" && g != "tp" && g != "pp" && g != "ep" && g != "edp") {
          diags.error(mark_of(c, origin), "collectives",
                      "collectives is { group: world | dp | tp | pp | ep | edp, doc: what the node exchanges }, or a list of them");
          continue;
        }
        s.collectives.push_back({g, c["doc"] ? c["doc"].as<std::string>() : ""});
      }
    }
    if (const YAML::Node& f = root["family"]) {
      const char* form = "family is { tp_divides: [the size params run.parallel.tp must divide], alike_blocks: the param "
                         "counting the blocks when they are all alike }";
      if (!f.IsMap()) {
        diags.error(mark_of(f, origin), "family", form);
      } else {
        r.unknown_keys(f, {"tp_divides", "alike_blocks"}, "family");
        NodeSchema::Family fam;
        if (f["tp_divides"] && !f["tp_divides"].IsSequence()) diags.error(mark_of(f["tp_divides"], origin), "family.tp_divides", form);
        else if (f["tp_divides"]) fam.tp_divides = f["tp_divides"].as<std::vector<std::string>>();
        if (f["alike_blocks"]) fam.alike_blocks = f["alike_blocks"].as<std::string>();
        s.family = fam;
      }
    }
    if (const YAML::Node& m = root["moved"]) {
      if (!m.IsMap())
        diags.error(mark_of(m, origin), "moved", "moved is a map of retired parameter names to where their setting went");
      else
        for (auto it = m.begin(); it != m.end(); ++it) s.moved[it->first.as<std::string>()] = it->second.as<std::string>();
    }
    s.inputs = r.ports(root["inputs"], true, "inputs");
    s.outputs = r.ports(root["outputs"], false, "outputs");
    // Shared groups' parameters first, in the order listed, then the type's own.
    if (const YAML::Node& g = root["groups"]) {
      if (!g.IsSequence())
        diags.error(mark_of(g, origin), "groups", "groups is a list of shared parameter group names (schemas/groups/NAME.yaml)");
      else
        for (const auto& name : g) add_group_params(s.params, name, origin, "groups", diags);
    }
    if (const YAML::Node& p = root["params"]; p && p.IsMap()) {
      for (auto it = p.begin(); it != p.end(); ++it) {
        std::string k = it->first.as<std::string>();
        add_param(s.params, parse_param_schema(k, it->second, origin, "params." + k, diags), it->first, origin, "params",
                  diags);
      }
    }
  } catch (const YAML::Exception& e) {
    diags.error({origin, e.mark.line + 1, e.mark.column + 1}, "", e.what());
  }
  for (const auto& o : s.outputs)
    if (o.kind == PortKind::State && o.access == Access::Read)
      diags.error({origin, 0, 0}, "outputs." + o.name, "an owned state output has access none or write");
  for (const auto& p : s.params)
    if (!p.when_param.empty() && !s.param(p.when_param))
      diags.error({origin, 0, 0}, "params." + p.name + ".when",
                  "'" + p.when_param + "' is not a parameter of " + s.type + ": when: names a sibling parameter");
  if (s.family) {
    std::vector<std::string> named = s.family->tp_divides;
    if (!s.family->alike_blocks.empty()) named.push_back(s.family->alike_blocks);
    for (const auto& n : named)
      if (!s.param(n) || (s.param(n)->type != ParamType::Int))
        diags.error({origin, 0, 0}, "family", "'" + n + "' is not an int parameter of " + s.type +
                                                  ": family: names the size parameters tp must divide and the block count");
  }
  if (!diags.empty()) throw GraphError(diags);
  return s;
}

ParamGroup parse_param_group(const std::string& text, const std::string& origin) {
  Diagnostics diags;
  ParamGroup g;
  g.origin = origin;
  YAML::Node root = load_yaml(text, origin, diags);
  if (!root.IsMap() || !root["group"] || !root["params"] || !root["params"].IsMap()) {
    diags.error({origin, 1, 1}, "", "a parameter group is a map: group: NAME, doc: ..., params: { NAME: {...}, ... }");
    throw GraphError(diags);
  }
  SchemaReader r{origin, diags};
  r.unknown_keys(root, {"group", "doc", "params"}, "group");
  try {
    g.name = root["group"].as<std::string>();
    if (root["doc"]) g.doc = root["doc"].as<std::string>();
    for (auto it = root["params"].begin(); it != root["params"].end(); ++it) {
      const std::string k = it->first.as<std::string>();
      if (it->second.IsMap() && it->second["group"])
        diags.error(mark_of(it->second["group"], origin), "params." + k + ".group", "a group cannot use another group");
      else
        add_param(g.params, parse_param_schema(k, it->second, origin, "params." + k, diags), it->first, origin, "params",
                  diags);
    }
  } catch (const YAML::Exception& e) {
    diags.error({origin, e.mark.line + 1, e.mark.column + 1}, "", e.what());
  }
  if (!diags.empty()) throw GraphError(diags);
  return g;
}

// ---- checking values against parameter schemas -------------------------------------------

static std::string scalar_text(const YAML::Node& v) { return v.IsScalar() ? v.Scalar() : "(a " + std::string(v.IsMap() ? "map" : "list") + ")"; }

YAML::Node check_param(const ParamSchema& ps, const YAML::Node& value, const std::string& file,
                       const std::string& path, Diagnostics& diags) {
  const Mark m = mark_of(value, file);
  // A rejected value is reported and replaced by the default (or null), so that what the
  // checker returns has the schema's types everywhere and later reads cannot fail on it.
  auto bad = [&](const std::string& what) {
    diags.error(m, path, "expected " + ps.type_str() + ", got " + what + (ps.doc.empty() ? "" : " (" + ps.doc + ")"));
    if (ps.has_default) return YAML::Clone(ps.default_value);
    if (ps.type == ParamType::Map && !ps.fields.empty()) return check_params(ps.fields, YAML::Node(), m, file, path, diags);
    return YAML::Node(YAML::NodeType::Null);
  };
  if (value.IsNull()) {
    if (!ps.nullable) return bad("null");
    return value;
  }
  auto range = [&](double d) {
    if ((ps.min && d < *ps.min) || (ps.max && d > *ps.max))
      diags.error(m, path, "value " + scalar_text(value) + " is out of range: expected " + ps.type_str());
  };
  switch (ps.type) {
    case ParamType::Int: {
      long long i = 0;
      if (!value.IsScalar() || !YAML::convert<long long>::decode(value, i)) return bad("'" + scalar_text(value) + "'");
      range(static_cast<double>(i));
      return value;
    }
    case ParamType::Float: {
      double d = 0;
      if (!value.IsScalar() || !YAML::convert<double>::decode(value, d) || std::isnan(d))
        return bad("'" + scalar_text(value) + "'");
      if (std::isinf(d) && !ps.infinite)
        return bad("'" + scalar_text(value) + "' (infinite values are not allowed here; write a finite number)");
      range(d);
      return value;
    }
    case ParamType::Bool: {
      bool b = false;
      if (!value.IsScalar() || !YAML::convert<bool>::decode(value, b)) return bad("'" + scalar_text(value) + "'");
      return value;
    }
    case ParamType::String:
      if (!value.IsScalar()) return bad(scalar_text(value));
      return value;
    case ParamType::Enum: {
      if (!value.IsScalar()) return bad(scalar_text(value));
      const std::string s = value.Scalar();
      for (const auto& v : ps.values)
        if (v == s) return value;
      diags.error(m, path, "'" + s + "' is not one of {" + join(ps.values) + "}" + did_you_mean(s, ps.values));
      return ps.has_default ? YAML::Clone(ps.default_value) : YAML::Node(ps.values.front());
    }
    case ParamType::List: {
      if (!value.IsSequence()) return bad(scalar_text(value));
      if (!ps.items) return value;
      YAML::Node out(YAML::NodeType::Sequence);
      for (size_t i = 0; i < value.size(); ++i)
        out.push_back(check_param(*ps.items, value[i], file, path + "[" + std::to_string(i) + "]", diags));
      return out;
    }
    case ParamType::Map: {
      if (!value.IsMap()) return bad(scalar_text(value));
      if (ps.fields.empty()) return value;
      return check_params(ps.fields, value, m, file, path, diags);
    }
    case ParamType::Any:
      return value;
  }
  return value;
}

YAML::Node check_params(const std::vector<ParamSchema>& params, const YAML::Node& map, const Mark& where,
                        const std::string& file, const std::string& path, Diagnostics& diags,
                        const std::map<std::string, std::string>& moved) {
  YAML::Node out(YAML::NodeType::Map);
  std::vector<std::string> known;
  for (const auto& p : params) known.push_back(p.name);
  const std::string prefix = path.empty() ? "" : path + ".";
  if (map && !map.IsNull() && !map.IsMap()) {
    diags.error(mark_of(map, file), path, "expected a map of parameters");
    return out;
  }
  if (map && map.IsMap()) {
    for (auto it = map.begin(); it != map.end(); ++it) {
      const std::string k = it->first.as<std::string>();
      const ParamSchema* ps = nullptr;
      for (const auto& p : params)
        if (p.name == k) ps = &p;
      if (!ps && moved.count(k)) {
        diags.error(mark_of(it->first, file), prefix + k, "parameter '" + k + "' is no longer here: " + moved.at(k));
        continue;
      }
      if (!ps) {
        // A field of one of the map parameters, written one level too high (beta1 for adamw.beta1)?
        std::string inside;
        for (const auto& p : params)
          if (p.field(k)) inside += std::string(inside.empty() ? "" : " or ") + "'" + p.name + "." + k + "'";
        diags.error(mark_of(it->first, file), prefix + k,
                    "unknown parameter '" + k + "'" +
                        (inside.empty() ? did_you_mean(k, known) : "; it is a field of a map: did you mean " + inside + "?") +
                        (known.empty() ? "; this takes no parameters" : "; known: " + join(known)));
        continue;
      }
      // A choice's settings set to null (`opt.adamw=null` on the command line): as if not given.
      if (!ps->when_param.empty() && it->second.IsNull()) continue;
      out[k] = check_param(*ps, it->second, file, prefix + k, diags);
    }
  }
  for (const auto& p : params) {
    if (out[p.name]) continue;
    if (p.has_default)
      out[p.name] = YAML::Clone(p.default_value);
    else if (p.required)
      diags.error(where, prefix + p.name,
                  "missing required parameter '" + p.name + "' (" + p.type_str() + (p.doc.empty() ? "" : ": " + p.doc) + ")");
    else if (p.type == ParamType::Map && !p.fields.empty())
      out[p.name] = check_params(p.fields, YAML::Node(), where, file, prefix + p.name, diags);
  }
  // Parameters of one choice (`when:`): given while the choice is another, an error; not given,
  // left out (an optimizer's settings of the rules it does not use are not filled in).
  for (const auto& p : params) {
    if (p.when_param.empty() || !out[p.when_param] || !out[p.when_param].IsScalar()) continue;
    const std::string chosen = out[p.when_param].Scalar();
    if (std::find(p.when_values.begin(), p.when_values.end(), chosen) != p.when_values.end()) continue;
    if (!(map && map.IsMap() && map[p.name] && !map[p.name].IsNull())) {
      out.remove(p.name);
      continue;
    }
    diags.error(mark_of(map[p.name], file), prefix + p.name,
                "'" + p.name + "' applies with " + p.when_param + ": " + join(p.when_values) + " only, and " +
                    p.when_param + " is " + chosen + ": drop '" + p.name + "' (or set it to null), or set " +
                    p.when_param + ": " + p.when_values.front());
  }
  return out;
}

// ---- docs ---------------------------------------------------------------------------------

static void describe_params(std::ostringstream& o, const std::vector<ParamSchema>& ps, const std::string& indent) {
  for (const auto& p : ps) {
    o << indent << p.name << ": " << p.type_str();
    if (p.required) o << ", required";
    if (p.has_default) o << ", default " << (p.default_value.IsNull() ? "null" : YAML::Dump(p.default_value));
    if (!p.when_param.empty()) o << ", only with " << p.when_param << ": " << join(p.when_values);
    o << "\n";
    if (!p.doc.empty()) o << indent << "    " << p.doc << "\n";
    if (!p.fields.empty()) describe_params(o, p.fields, indent + "  ");
  }
}

std::string describe(const NodeSchema& s) {
  std::ostringstream o;
  o << s.type << (s.origin == "built-in" ? "" : "  [from " + s.origin + "]") << "\n";
  if (!s.doc.empty()) o << "  " << s.doc << "\n";
  o << "  scheduling: " << (s.stateless ? "stateless (steps may run in parallel)" : "serial (one step at a time, in order)")
    << (s.compute ? ", tensor math (on the compute thread)" : "") << "\n";
  for (const auto& c : s.collectives)
    o << "  collectives: over the " << c.group << " group" << (c.doc.empty() ? "" : ": " + c.doc) << "\n";
  if (s.family)
    o << "  family: splits over tensor parallel (run.parallel.tp dividing " << join(s.family->tp_divides)
      << ") and cuts into pipeline stages" << (s.family->alike_blocks.empty() ? "" : " (its " + s.family->alike_blocks + " blocks alike)")
      << "\n";
  auto ports = [&](const char* title, const std::vector<PortSchema>& v) {
    if (v.empty()) return;
    o << "\n" << title << ":\n";
    for (const auto& p : v) {
      o << "  " << p.name << ": " << to_string(p.kind);
      if (p.kind == PortKind::State) o << " (" << to_string(p.access) << (p.setup_write ? "; write at setup" : "") << ")";
      o << " " << p.type;
      if (!p.dtype.empty()) o << " " << p.dtype;
      if (p.rank >= 0) o << " rank " << p.rank;
      if (p.optional) o << ", optional";
      if (p.many) o << ", list";
      o << "\n";
      if (!p.doc.empty()) o << "      " << p.doc << "\n";
    }
  };
  ports("inputs", s.inputs);
  ports("outputs", s.outputs);
  if (!s.params.empty()) {
    o << "\nparameters (with:):\n";
    describe_params(o, s.params, "  ");
  }
  return o.str();
}

}  // namespace flowrun
