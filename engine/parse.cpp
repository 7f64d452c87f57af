// Reading a graph file: YAML, then command-line overrides, then ${...} substitution.
// Checking against schemas is check.cpp's job.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "registry.hpp"
#include "spec.hpp"

namespace flowrun {

namespace {

// Node entry keys that an override `NODE.KEY=v` sets directly (anything else goes under with:).
bool is_node_entry_key(const std::string& k) {
  for (const auto& p : graph_schema().node_keys)
    if (p.name == k && k != "with" && k != "in") return true;
  return false;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

// A copy of `n` without source marks, so errors about it say "command line", not a position
// inside the override's own text.
YAML::Node without_marks(const YAML::Node& n) {
  if (n.IsScalar()) return YAML::Node(n.Scalar());
  if (n.IsSequence()) {
    YAML::Node out(YAML::NodeType::Sequence);
    for (const auto& x : n) out.push_back(without_marks(x));
    return out;
  }
  if (n.IsMap()) {
    YAML::Node out(YAML::NodeType::Map);
    for (auto it = n.begin(); it != n.end(); ++it) out[it->first.Scalar()] = without_marks(it->second);
    return out;
  }
  return YAML::Node(YAML::NodeType::Null);
}

void apply_override(YAML::Node& root, const std::string& ov, Diagnostics& diags) {
  const Mark where{"command line", 0, 0};
  const std::string path = "override '" + ov + "'";
  size_t eq = ov.find('=');
  if (eq == std::string::npos || eq == 0) {
    diags.error(where, path, "an override is KEY.PATH=VALUE, e.g. run.steps=50 or opt.lr=1e-3");
    return;
  }
  std::vector<std::string> keys = split(ov.substr(0, eq), '.');
  for (const auto& k : keys)
    if (k.empty()) {
      diags.error(where, path, "empty key in '" + ov.substr(0, eq) + "'");
      return;
    }
  YAML::Node value;
  try {
    Diagnostics d;
    value = without_marks(load_yaml(ov.substr(eq + 1), "command line", d));  // typed like the file: 50 is an int, [a, b] a list
    if (!d.empty()) throw GraphError(d);
  } catch (const GraphError& e) {
    diags.error(where, path, "the value is not valid YAML: " + e.diagnostics().list().front().message);
    return;
  }
  if (!root["nodes"] || !root["nodes"].IsMap()) {
    diags.error(where, path, "the file has no nodes: map to override");
    return;
  }
  std::vector<std::string> walk;  // the keys below root to set
  if (keys[0] == "run") {
    if (keys.size() < 2) {
      diags.error(where, path, "name a run key, e.g. run.steps=50");
      return;
    }
    walk = keys;
  } else {
    std::string node = keys[0];
    if (!root["nodes"][node]) {
      std::vector<std::string> names;
      for (auto it = root["nodes"].begin(); it != root["nodes"].end(); ++it) names.push_back(it->first.as<std::string>());
      diags.error(where, path,
                  "no node '" + node + "' in the file" + did_you_mean(node, names) + "; overrides are run.KEY=V, NODE.PARAM=V, NODE.every=N or NODE.in.PORT=NODE.PORT");
      return;
    }
    if (keys.size() < 2) {
      diags.error(where, path, "name a parameter of node '" + node + "', e.g. " + node + ".PARAM=VALUE");
      return;
    }
    walk = {"nodes", node};
    // NODE.every=N, NODE.in.PORT=other.port, NODE.with.P=V; anything else is a parameter.
    if (!is_node_entry_key(keys[1]) && keys[1] != "in" && keys[1] != "with") walk.push_back("with");
    walk.insert(walk.end(), keys.begin() + 1, keys.end());
  }
  YAML::Node cur(root);
  for (size_t i = 0; i + 1 < walk.size(); ++i) {
    YAML::Node next = cur[walk[i]];
    if (!next || next.IsNull()) {
      cur[walk[i]] = YAML::Node(YAML::NodeType::Map);
      next.reset(cur[walk[i]]);
    } else if (!next.IsMap()) {
      diags.error(where, path, "'" + walk[i] + "' is not a map, so it has no key '" + walk[i + 1] + "'");
      return;
    }
    cur.reset(next);
  }
  cur[walk.back()] = value;
}

// ${VAR}, ${VAR:-default}, ${run.key}
const std::regex& var_re() {
  static const std::regex re(R"(\$\{([A-Za-z_][A-Za-z0-9_.]*)(:-([^}]*))?\})");
  return re;
}

std::string lookup_run(const YAML::Node& root, const std::string& key, bool& found) {
  found = false;
  // `run` may be anything a user wrote (a scalar, a list): the checker reports that; here it
  // only has no value for the key.
  const YAML::Node run = root.IsMap() ? root["run"] : YAML::Node();
  YAML::Node v = run && run.IsMap() ? run[key] : YAML::Node();
  if (v && v.IsScalar()) {
    found = true;
    return v.Scalar();
  }
  if (const ParamSchema* run = graph_schema().run())
    if (const ParamSchema* f = run->field(key); f && f->has_default && f->default_value.IsScalar()) {
      found = true;
      return f->default_value.Scalar();
    }
  return "";
}

void substitute(YAML::Node n, const YAML::Node& root, const std::string& file, const std::string& path,
                Diagnostics& diags, int depth = 0) {
  if (n.IsMap()) {
    for (auto it = n.begin(); it != n.end(); ++it)
      substitute(it->second, root, file, path + (path.empty() ? "" : ".") + it->first.as<std::string>(), diags, depth);
  } else if (n.IsSequence()) {
    for (size_t i = 0; i < n.size(); ++i) substitute(n[i], root, file, path + "[" + std::to_string(i) + "]", diags, depth);
  } else if (n.IsScalar()) {
    const std::string s = n.Scalar();
    if (s.find("${") == std::string::npos) return;
    std::string out;
    // Text between substitutions holding "${" is a substitution that did not parse.
    auto literal = [&](const std::string& text) {
      if (text.find("${") != std::string::npos)
        diags.error(mark_of(n, file), path,
                    "'" + s + "': a '${' that is not ${NAME}, ${NAME:-DEFAULT} or ${run.KEY} (a missing '}' or a name "
                    "with characters other than letters, digits, '_' and '.'); fix it, or remove the '${'");
      out += text;
    };
    auto begin = std::sregex_iterator(s.begin(), s.end(), var_re());
    size_t last = 0;
    for (auto it = begin; it != std::sregex_iterator(); ++it) {
      const std::smatch& m = *it;
      literal(s.substr(last, m.position() - last));
      last = m.position() + m.length();
      const std::string name = m[1];
      const bool has_default = m[2].matched;
      if (name.rfind("run.", 0) == 0) {
        bool found = false;
        std::string v = lookup_run(root, name.substr(4), found);
        if (!found) {
          diags.error(mark_of(n, file), path, "${" + name + "}: the file sets no run key '" + name.substr(4) + "'");
          continue;
        }
        out += v;
      } else if (const char* env = std::getenv(name.c_str()); env && *env) {
        out += env;
      } else if (has_default) {
        out += m[3].str();
      } else {
        diags.error(mark_of(n, file), path,
                    "environment variable " + name + " is not set; set it or give a default: ${" + name + ":-VALUE}");
      }
    }
    literal(s.substr(last));
    if (out != s) n = out;
  }
}

}  // namespace

YAML::Node parse_graph_file(const std::string& file, const std::vector<std::string>& overrides, Diagnostics& diags) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto status = fs::status(file, ec);
  std::string problem;
  if (!fs::exists(status))
    problem = "no such file";
  else if (fs::is_directory(status))
    problem = "it is a folder; name a .yaml file in it";
  else if (!fs::is_regular_file(status))
    problem = "it is not a regular file (a device or a pipe?)";
  else if (fs::file_size(file, ec) > (16u << 20))
    problem = "it is larger than 16 MiB; a graph file is a few KiB";
  std::ifstream in(file);
  if (problem.empty() && !in) problem = "permission denied";
  if (!problem.empty()) {
    diags.error({file, 0, 0}, "", "cannot read the graph file: " + problem);
    throw GraphError(diags);
  }
  std::stringstream text;
  text << in.rdbuf();
  YAML::Node root = load_yaml(text.str(), file, diags);
  if (!root.IsMap()) {
    diags.error({file, 1, 1}, "", "a graph file is a map with flowrun: 1, run:, nodes: ...");
    throw GraphError(diags);
  }
  for (const auto& ov : overrides) apply_override(root, ov, diags);
  substitute(root, root, file, "", diags);
  return root;
}

GraphSpec load_graph(const std::string& file, const std::vector<std::string>& overrides, Registry& reg) {
  Diagnostics diags;
  YAML::Node root = parse_graph_file(file, overrides, diags);
  GraphSpec g;
  try {
    g = check_graph(root, file, overrides, reg);
  } catch (const GraphError& e) {
    if (diags.empty()) throw;
    diags.append(e.diagnostics());
    throw GraphError(diags);
  }
  if (!diags.empty()) throw GraphError(diags);  // the parser's and the overrides' problems
  return g;
}

YAML::Node resolved_config(const GraphSpec& g) {
  YAML::Node r = YAML::Clone(g.root);
  r["run"] = g.run;
  for (const auto& n : g.nodes) r["nodes"][n.name]["with"] = n.params;
  return r;
}

std::string to_yaml(const YAML::Node& root) {
  YAML::Emitter e;
  e << root;
  return std::string(e.c_str()) + "\n";
}

}  // namespace flowrun
