// Reading a graph file: YAML, a check of its shape with aliases expanded, then command-line
// overrides, then ${...} substitution. Checking against schemas is check.cpp's job.
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <vector>

#include "registry.hpp"
#include "schema.hpp"
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

// The tree as the walks after loading see it. yaml_load.cpp bounds nesting as written
// (kYamlMaxDepth levels) and the node count with aliases expanded, but there an alias is one
// level: 110 anchors, each a 60-deep list holding the previous one, pass it and expand to
// 6,600 levels, and every recursive walk after it (substitution, the checker, --print-config)
// overflowed the stack (exit 139). This walk measures depth with aliases expanded (an alias
// is as deep as the node it names); it recurses at most kYamlMaxDepth + 1 levels and stops after
// kYamlMaxNodes nodes, so it is bounded itself. The limits are load_yaml's (schema.hpp).

class ShapeCheck {
 public:
  // False (and `problem`, `at`, `where` set) if `n` is deeper or larger than the limits.
  bool ok(const YAML::Node& n) { return walk(n, 1, ""); }
  std::string problem, where;
  YAML::Node at;

 private:
  bool walk(const YAML::Node& n, int depth, const std::string& path) {
    if (++nodes_ > kYamlMaxNodes)
      return fail(n, path, "more than " + std::to_string(kYamlMaxNodes) +
                               " nodes once its aliases are expanded (an alias bomb?); a graph file is far smaller: copy "
                               "what you need instead");
    if (!n.IsMap() && !n.IsSequence()) return true;
    if (depth > kYamlMaxDepth)
      return fail(n, path, "nested more than " + std::to_string(kYamlMaxDepth) +
                               " levels deep once its aliases are expanded (an alias is as deep as the node it names, and "
                               "that node may hold aliases too); a graph file needs a few: copy what you need instead of "
                               "nesting anchors");
    // The path names where the deep part hangs in the file; a few levels say that.
    auto below = [&](const std::string& step) {
      if (depth > 6) return path.size() >= 3 && path.compare(path.size() - 3, 3, "...") == 0 ? path : path + "...";
      return path + step;
    };
    if (n.IsMap()) {
      for (auto it = n.begin(); it != n.end(); ++it)
        if (!walk(it->second, depth + 1, below((path.empty() ? "" : ".") + it->first.Scalar()))) return false;
    } else {
      for (size_t i = 0; i < n.size(); ++i)
        if (!walk(n[i], depth + 1, below("[" + std::to_string(i) + "]"))) return false;
    }
    return true;
  }
  bool fail(const YAML::Node& n, const std::string& path, std::string what) {
    at = n;
    where = path;
    problem = std::move(what);
    return false;
  }
  uint64_t nodes_ = 0;
};

// The tree with every alias made a copy of its own. yaml-cpp gives an alias the very node its
// anchor names, so an override of one place (`model.pretrained=X`) would change every place
// that shares the anchor, unseen. An anchor is a way to write a value twice, not a link: after
// this, an override changes its own path only (a value meant for several places is written
// once as ${...}). Maps and lists are new nodes; scalars are new handles on the file's own
// data, so they keep their positions for errors (mark_of takes a map's or list's position
// from its first entry). Bounded by ShapeCheck, which runs first. Only for a text that holds an
// alias (load_yaml says so): without one no node is shared, and the copy (yaml-cpp merging each
// new node's memory into its parent's) was a third of `flowrun dot`'s time.
YAML::Node unshared(const YAML::Node& n) {
  if (n.IsMap()) {
    YAML::Node out(YAML::NodeType::Map);
    for (auto it = n.begin(); it != n.end(); ++it) out.force_insert(it->first, unshared(it->second));
    return out;
  }
  if (n.IsSequence()) {
    YAML::Node out(YAML::NodeType::Sequence);
    for (const auto& x : n) out.push_back(unshared(x));
    return out;
  }
  // A new node that reads n's scalar (and its mark). `copy = n` would not do: assigning a
  // handle makes it n's node. Assigning through a list's element sets that element's data to
  // n's, and the element stays a node of its own.
  YAML::Node box(YAML::NodeType::Sequence);
  box.push_back(YAML::Node(YAML::NodeType::Null));
  box[0] = n;
  return box[0];
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
    value = load_yaml(ov.substr(eq + 1), "command line", d);  // typed like the file: 50 is an int, [a, b] a list
    if (!d.empty()) throw GraphError(d);
  } catch (const GraphError& e) {
    diags.error(where, path, "the value is not valid YAML: " + e.diagnostics().list().front().message);
    return;
  }
  if (ShapeCheck shape; !shape.ok(value)) {  // before without_marks(), a recursive walk
    diags.error(where, path, "the value is " + shape.problem);
    return;
  }
  value = without_marks(value);
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

// ${NAME}, ${NAME:-DEFAULT}, ${run.KEY}: one pass over the text the file (or an override)
// holds, with these rules (docs/graph-files.md "Substitution"):
//   - a DEFAULT may hold substitutions itself, expanded only when the default is used (as in
//     the shell: `${A:-${B}}` with A and B unset is an error naming B);
//   - `${run.KEY}` is the run key's value after its own substitutions, in any order of the
//     file (a cycle is an error);
//   - what an environment variable brings in is never substituted again: a '${' in it is an
//     error, not a literal that ends up as a folder name;
//   - everything substitution writes is bounded (kMaxSubstituted bytes in all): a 1.4 MB file
//     of `${run.KEY}` references to a long run key asked for about 20 GB.
// Phase 1 computes every result from the text as loaded; phase 2 (apply) assigns them, so
// that no result is read as input again. Aliases reach one node from several places: each
// scalar is computed once (keyed by the address of its text, which aliases share).
constexpr size_t kMaxSubstituted = 16u << 20;
constexpr int kMaxNesting = 16;  // ${A:-${B:-...}}: expand() recurses once per level

class Substitution {
 public:
  Substitution(const YAML::Node& root, const std::string& file, Diagnostics& diags)
      : root_(root), file_(file), diags_(diags) {}

  void walk(const YAML::Node& n, const std::string& path) {
    if (stopped_) return;
    if (n.IsMap()) {
      for (auto it = n.begin(); it != n.end(); ++it)
        walk(it->second, path + (path.empty() ? "" : ".") + it->first.Scalar());
    } else if (n.IsSequence()) {
      for (size_t i = 0; i < n.size(); ++i) walk(n[i], path + "[" + std::to_string(i) + "]");
    } else if (n.IsScalar() && n.Scalar().find("${") != std::string::npos) {
      scalar(n, path);
    }
  }

  void apply() {
    for (auto& [node, text] : results_) node = text;
  }

 private:
  enum class State { kResolving, kDone, kFailed };
  struct Entry {
    State state = State::kResolving;
    std::string value;
  };
  // One scalar being expanded: where errors point, and whether one was reported.
  struct Scalar {
    const YAML::Node& node;
    const std::string& path;
    const std::string& text;
    bool ok = true;
  };

  // The value after substitution of a scalar that holds "${"; kFailed once a problem in it
  // was reported.
  const Entry& scalar(const YAML::Node& n, const std::string& path) {
    static const Entry failed{State::kFailed, ""};
    const std::string& text = n.Scalar();
    auto [it, fresh] = memo_.try_emplace(&text);
    if (!fresh) return it->second;  // done, failed, or being resolved (the caller reports a cycle)
    Scalar sc{n, path, text};
    std::string out;
    size_t pos = 0;
    if (!expand(sc, pos, 0, true, out)) sc.ok = false;
    if (stopped_) return failed;
    Entry& e = it->second;  // std::map: still valid after expand() added entries
    if (!sc.ok) {
      e.state = State::kFailed;
      return e;
    }
    e = {State::kDone, out};
    if (out != text) results_.emplace_back(n, std::move(out));
    return e;
  }

  void error(Scalar& sc, const std::string& message) {
    diags_.error(mark_of(sc.node, file_), sc.path, message);
    sc.ok = false;
  }

  bool malformed(Scalar& sc) {
    error(sc, "'" + sc.text + "': a '${' that is not ${NAME}, ${NAME:-DEFAULT} or ${run.KEY} (a missing '}' or a name "
                              "with characters other than letters, digits, '_' and '.'); fix it, or remove the '${'");
    return false;
  }

  // Appends to `out` unless that would pass kMaxSubstituted (then stops everything, reported).
  void emit(Scalar& sc, std::string& out, const char* text, size_t n) {
    if (stopped_) return;
    written_ += n;
    if (written_ > kMaxSubstituted) {
      error(sc, "substitution makes more than " + std::to_string(kMaxSubstituted >> 20) +
                    " MiB of text in this file (a long value repeated through ${...}, or a run key whose value "
                    "repeats another's); a graph file is a few KiB: shorten what is substituted");
      stopped_ = true;
      return;
    }
    out.append(text, n);
  }

  // Expands sc.text from `pos` to its end or, in a default (`nesting` > 0: defaults this one
  // is inside), to the '}' that closes it (`pos` is left after it). `use`: the text is used;
  // an unused default is only read. False at a '${' that does not parse (reported; the rest
  // of the text is not read).
  bool expand(Scalar& sc, size_t& pos, int nesting, bool use, std::string& out) {
    const bool in_default = nesting > 0;
    const std::string& s = sc.text;
    while (pos < s.size() && !stopped_) {
      const size_t next = s.find_first_of(in_default ? "$}" : "$", pos);
      const size_t stop = next == std::string::npos ? s.size() : next;
      if (use) emit(sc, out, s.data() + pos, stop - pos);
      pos = stop;
      if (pos == s.size()) break;
      if (s[pos] == '}') {  // the end of this default
        ++pos;
        return true;
      }
      if (s.compare(pos, 2, "${") != 0) {  // a '$' alone is text
        if (use) emit(sc, out, "$", 1);
        ++pos;
        continue;
      }
      pos += 2;
      const size_t name_start = pos;
      if (pos < s.size() && (std::isalpha(static_cast<unsigned char>(s[pos])) || s[pos] == '_'))
        while (pos < s.size() && (std::isalnum(static_cast<unsigned char>(s[pos])) || s[pos] == '_' || s[pos] == '.')) ++pos;
      if (pos == name_start) return malformed(sc);
      const std::string name = s.substr(name_start, pos - name_start);
      bool has_default = false;
      if (s.compare(pos, 2, ":-") == 0) {
        has_default = true;
        pos += 2;
      } else if (pos < s.size() && s[pos] == '}') {
        ++pos;
      } else {
        return malformed(sc);
      }
      // The value: found (use it), missing (the default, or an error), or failed (reported).
      enum { kFound, kMissing, kFailed } got = kMissing;
      std::string value;
      if (use) got = lookup(sc, name, value) ? kFound : (sc.ok ? kMissing : kFailed);
      if (has_default) {
        if (nesting >= kMaxNesting) {
          error(sc, "defaults nested more than " + std::to_string(kMaxNesting) +
                        " deep (${A:-${B:-...}}); a few are enough: simplify it");
          return false;
        }
        if (!expand(sc, pos, nesting + 1, use && got == kMissing, out)) return false;
      }
      if (got == kFound) {
        emit(sc, out, value.data(), value.size());
      } else if (use && got == kMissing && !has_default) {
        if (name.rfind("run.", 0) == 0)
          error(sc, "${" + name + "}: the file sets no run key '" + name.substr(4) + "'");
        else
          error(sc, "environment variable " + name + " is not set; set it or give a default: ${" + name + ":-VALUE}");
      }
    }
    if (in_default) return malformed(sc);  // no '}' closes the default
    return true;
  }

  // The value of NAME; false if it has none (or a problem was reported: sc.ok is false then).
  bool lookup(Scalar& sc, const std::string& name, std::string& value) {
    if (name.rfind("run.", 0) == 0) return run_value(sc, name.substr(4), value);
    const char* env = std::getenv(name.c_str());
    if (!env || !*env) return false;
    value = env;
    if (value.find("${") != std::string::npos) {
      error(sc, "environment variable " + name + " is '" + value + "', which holds '${': a substituted value is used as "
                "it is, never substituted again; set the variable to the text you mean");
      return false;
    }
    return true;
  }

  // `run.KEY` after overrides and after its own substitutions, or the schema's default.
  bool run_value(Scalar& sc, const std::string& key, std::string& value) {
    // `run` may be anything a user wrote (a scalar, a list): the checker reports that; here it
    // only has no value for the key.
    const YAML::Node& root = root_;
    const YAML::Node run = root.IsMap() ? root["run"] : YAML::Node();
    const YAML::Node v = run && run.IsMap() ? run[key] : YAML::Node();
    if (v && v.IsScalar() && v.Scalar().find("${") == std::string::npos) {
      value = v.Scalar();
      return true;
    }
    if (v && v.IsScalar()) {
      resolving_.push_back(key);
      const Entry& e = scalar(v, "run." + key);
      if (e.state == State::kResolving) {
        // The circle: from the key's first time on the stack (or from the walk's scalar, the
        // key's node, when it is not there) back to the key.
        size_t from = 0;
        while (from + 1 < resolving_.size() && resolving_[from] != key) ++from;
        if (from + 1 == resolving_.size()) from = 0;
        std::string circle = resolving_[from] == key && from + 1 < resolving_.size() ? "" : "run." + key;
        for (size_t i = from; i < resolving_.size(); ++i) circle += (circle.empty() ? "run." : " -> run.") + resolving_[i];
        resolving_.pop_back();
        error(sc, "${run." + key + "}: run keys that refer to each other in a circle (" + circle +
                      "); give one of them a value of its own");
        return false;
      }
      resolving_.pop_back();
      if (e.state == State::kFailed) {  // reported at run.KEY
        sc.ok = false;
        return false;
      }
      value = e.value;
      return true;
    }
    if (const ParamSchema* r = graph_schema().run())
      if (const ParamSchema* f = r->field(key); f && f->has_default && f->default_value.IsScalar()) {
        value = f->default_value.Scalar();
        return true;
      }
    return false;
  }

  YAML::Node root_;
  const std::string& file_;
  Diagnostics& diags_;
  std::map<const std::string*, Entry> memo_;
  std::vector<std::pair<YAML::Node, std::string>> results_;
  std::vector<std::string> resolving_;  // run keys being resolved, outermost first
  size_t written_ = 0;
  bool stopped_ = false;  // over kMaxSubstituted: reported once, nothing more is done
};

void substitute(const YAML::Node& root, const std::string& file, Diagnostics& diags) {
  Substitution s(root, file, diags);
  s.walk(root, "");
  s.apply();
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
  bool aliased = false;
  YAML::Node root = load_yaml(text.str(), file, diags, &aliased);
  if (!root.IsMap()) {
    diags.error({file, 1, 1}, "", "a graph file is a map with flowrun: 1, run:, nodes: ...");
    throw GraphError(diags);
  }
  if (ShapeCheck shape; !shape.ok(root)) {  // before any recursive walk
    diags.error(mark_of(shape.at, file), shape.where, "this part of the file is " + shape.problem);
    throw GraphError(diags);
  }
  if (aliased) root.reset(unshared(root));
  for (const auto& ov : overrides) apply_override(root, ov, diags);
  substitute(root, file, diags);
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
  e << without_marks(root);  // each value written where it is: no anchors and aliases (see unshared)
  return std::string(e.c_str()) + "\n";
}

}  // namespace flowrun
