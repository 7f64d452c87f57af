// Checking a parsed graph file: the graph schema, node types, parameters and wiring.
// Every problem is collected; nothing stops at the first error.
#include <filesystem>
#include <set>
#include <stdexcept>
#include <type_traits>

#include "plugin.hpp"
#include "registry.hpp"
#include "spec.hpp"

namespace flowrun {

namespace fs = std::filesystem;

std::string Schedule::str() const {
  std::vector<std::string> parts;
  if (every > 0) parts.push_back("every " + std::to_string(every));
  if (at_start) parts.push_back("at start");
  if (at_end) parts.push_back("at end");
  if (at_stop) parts.push_back("at stop");
  return join(parts);
}

const InputSpec* NodeSpec::input(const std::string& port) const {
  for (const auto& i : inputs)
    if (i.port == port) return &i;
  return nullptr;
}

int GraphSpec::index_of(const std::string& node) const {
  for (size_t i = 0; i < nodes.size(); ++i)
    if (nodes[i].name == node) return static_cast<int>(i);
  return -1;
}

namespace {

bool valid_name(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  return true;
}

// A consumer may take values from a periodic producer only on steps the producer runs.
bool runs_only_when(const Schedule& cons, const Schedule& prod) {
  if (!prod.periodic()) return true;
  if (!cons.periodic()) return false;
  if (cons.every > 0 && !(prod.every > 0 && cons.every % prod.every == 0)) return false;
  if (cons.at_start && !prod.at_start) return false;
  if (cons.at_end && !prod.at_end) return false;
  return true;
}

struct Checker {
  const std::string& file;
  Registry& reg;
  Diagnostics& diags;
  GraphSpec& g;

  Mark at(const YAML::Node& n) { return mark_of(n, file); }

  void load_plugins(const YAML::Node& top) {
    std::vector<std::pair<std::string, Mark>> paths;
    if (const char* env = std::getenv("FLOWRUN_PLUGIN_PATH"); env && *env)
      for (const auto& p : plugin_path_entries(env)) paths.push_back({p, Mark{"FLOWRUN_PLUGIN_PATH", 0, 0}});
    if (top["plugins"] && top["plugins"].IsSequence()) {
      for (const auto& p : top["plugins"]) {
        if (!p.IsScalar()) continue;  // reported by check_params
        fs::path path = p.Scalar();
        if (path.is_relative()) path = fs::path(g.dir) / path;
        paths.push_back({path.lexically_normal().string(), at(p)});
      }
    }
    for (const auto& [path, mark] : paths) {
      try {
        load_plugin(path, reg);
        g.plugins.push_back(path);
      } catch (const std::exception& e) {
        diags.error(mark, "plugins", e.what());
      }
    }
  }

  Schedule schedule(const YAML::Node& entry) {
    Schedule s;
    if (entry["every"] && entry["every"].IsScalar()) s.every = entry["every"].as<int64_t>(0);
    if (entry["at"] && entry["at"].IsSequence())
      for (const auto& a : entry["at"]) {
        if (a.Scalar() == "start") s.at_start = true;
        if (a.Scalar() == "end") s.at_end = true;
        if (a.Scalar() == "stop") s.at_stop = true;
      }
    return s;
  }

  std::vector<std::string> earlier_names(size_t before) {
    std::vector<std::string> v;
    for (size_t i = 0; i < before && i < g.nodes.size(); ++i) v.push_back(g.nodes[i].name);
    return v;
  }

  // Parse "node.port" and check it against the nodes declared before `self`.
  bool resolve_ref(const YAML::Node& n, const std::string& path, size_t self, const std::vector<std::string>& all_names,
                   PortRef& ref) {
    ref.mark = at(n);
    if (!n.IsScalar()) {
      diags.error(ref.mark, path, "an input names NODE.PORT, e.g. data.batch");
      return false;
    }
    const std::string s = n.Scalar();
    size_t dot = s.find('.');
    if (dot == std::string::npos || dot == 0 || dot + 1 == s.size() || s.find('.', dot + 1) != std::string::npos) {
      diags.error(ref.mark, path, "'" + s + "' is not NODE.PORT (e.g. data.batch)");
      return false;
    }
    ref.node = s.substr(0, dot);
    ref.port = s.substr(dot + 1);
    int idx = g.index_of(ref.node);
    if (idx < 0) {
      bool later = false;
      for (const auto& nm : all_names) later = later || nm == ref.node;
      if (later)
        diags.error(ref.mark, path,
                    "node '" + ref.node + "' is declared after '" + g.nodes[self].name +
                        "'; inputs must name earlier nodes (file order is program order): move it up");
      else
        diags.error(ref.mark, path, "no node '" + ref.node + "'" + did_you_mean(ref.node, earlier_names(self)));
      return false;
    }
    if (static_cast<size_t>(idx) == self) {
      diags.error(ref.mark, path, "a node cannot read its own output");
      return false;
    }
    ref.node_index = idx;
    const NodeType* pt = reg.find(g.nodes[idx].type);
    if (!pt) return false;  // its type error is already reported
    if (!pt->schema.output(ref.port)) {
      auto outs = pt->schema.output_names();
      diags.error(ref.mark, path,
                  "node '" + ref.node + "' (" + g.nodes[idx].type + ") has no output '" + ref.port + "'" +
                      did_you_mean(ref.port, outs) + (outs.empty() ? "; it has no outputs" : "; outputs: " + join(outs)));
      return false;
    }
    return true;
  }

  void check_port_match(const PortSchema& in, const PortRef& ref, const std::string& path, const NodeSpec& self) {
    const NodeSpec& prod = g.nodes[ref.node_index];
    const PortSchema& out = *reg.find(prod.type)->schema.output(ref.port);
    if (in.kind != out.kind) {
      diags.error(ref.mark, path,
                  ref.str() + " is a " + to_string(out.kind) + " port but input '" + in.name + "' of " + self.type +
                      " takes a " + to_string(in.kind) + " port");
      return;
    }
    if (in.type != "any" && out.type != "any" && in.type != out.type)
      diags.error(ref.mark, path,
                  "type mismatch: " + ref.str() + " gives '" + out.type + "' but input '" + in.name + "' takes '" + in.type + "'");
    if (!in.dtype.empty() && !out.dtype.empty() && in.dtype != out.dtype)
      diags.error(ref.mark, path,
                  "dtype mismatch: " + ref.str() + " gives " + out.dtype + " but input '" + in.name + "' takes " + in.dtype);
    if (in.rank >= 0 && out.rank >= 0 && in.rank != out.rank)
      diags.error(ref.mark, path,
                  "rank mismatch: " + ref.str() + " gives rank " + std::to_string(out.rank) + " but input '" + in.name +
                      "' takes rank " + std::to_string(in.rank));
    if (in.kind != PortKind::State && !runs_only_when(self.schedule, prod.schedule))
      diags.error(ref.mark, path,
                  ref.str() + " is produced only " + prod.schedule.str() + ", but '" + self.name + "' runs " +
                      (self.schedule.periodic() ? self.schedule.str() : "every step") +
                      "; give '" + self.name + "' a schedule within the producer's");
  }

  void inputs(NodeSpec& ns, const NodeType& t, const YAML::Node& in, size_t self, const std::vector<std::string>& all_names) {
    const std::string base = "nodes." + ns.name + ".in";
    std::set<std::string> given;
    if (in && in.IsMap()) {
      for (auto it = in.begin(); it != in.end(); ++it) {
        const std::string port = it->first.as<std::string>();
        const std::string path = base + "." + port;
        given.insert(port);
        const PortSchema* ps = t.schema.input(port);
        if (!ps) {
          auto names = t.schema.input_names();
          diags.error(at(it->first), path,
                      "node type '" + ns.type + "' has no input '" + port + "'" + did_you_mean(port, names) +
                          (names.empty() ? "; it takes no inputs" : "; inputs: " + join(names)));
          continue;
        }
        InputSpec is;
        is.port = port;
        is.schema = ps;
        is.mark = at(it->first);
        const YAML::Node v = it->second;  // a copy (a handle): it->second lives in a temporary
        if (v.IsSequence()) {
          if (!ps->many) {
            diags.error(at(v), path, "input '" + port + "' takes one NODE.PORT, not a list");
            continue;
          }
          for (size_t i = 0; i < v.size(); ++i) {
            PortRef r;
            if (resolve_ref(v[i], path + "[" + std::to_string(i) + "]", self, all_names, r)) {
              check_port_match(*ps, r, path, ns);
              is.refs.push_back(r);
            }
          }
        } else {
          PortRef r;
          if (resolve_ref(v, path, self, all_names, r)) {
            check_port_match(*ps, r, path, ns);
            is.refs.push_back(r);
          }
        }
        ns.inputs.push_back(std::move(is));
      }
    } else if (in && !in.IsNull()) {
      diags.error(at(in), base, "in: is a map PORT: NODE.PORT");
    }
    for (const auto& p : t.schema.inputs)
      if (p.name != "*" && !p.optional && !given.count(p.name))
        diags.error(ns.mark, base + "." + p.name,
                    "missing input '" + p.name + "' (" + to_string(p.kind) + " " + p.type + (p.doc.empty() ? "" : ": " + p.doc) +
                        "); connect it as in: { " + p.name + ": NODE.PORT }");
  }

  void nodes(const YAML::Node& nodes) {
    if (!nodes || !nodes.IsMap()) return;  // reported by the top-level check
    std::vector<std::string> all_names;
    for (auto it = nodes.begin(); it != nodes.end(); ++it) all_names.push_back(it->first.as<std::string>());
    std::set<std::string> seen;
    for (auto it = nodes.begin(); it != nodes.end(); ++it) {
      NodeSpec ns;
      ns.name = it->first.as<std::string>();
      ns.mark = at(it->first);
      const std::string path = "nodes." + ns.name;
      if (!seen.insert(ns.name).second) continue;
      if (!valid_name(ns.name))
        diags.error(ns.mark, path, "node names use letters, digits, '_' and '-' only (no '.')");
      const YAML::Node entry = it->second;  // a copy (a handle): it->second lives in a temporary
      if (!entry.IsMap()) {
        diags.error(at(entry), path, "a node is a map: { type: TYPE, in: {...}, with: {...} }");
        g.nodes.push_back(ns);
        continue;
      }
      // The entry's own keys (type, in, with, every, at, stream, doc).
      check_params(graph_schema().node_keys, entry, ns.mark, file, path, diags);
      ns.schedule = schedule(entry);
      if (entry["stream"] && entry["stream"].IsScalar()) {
        ns.stream = entry["stream"].Scalar();
        if (ns.stream == "default") ns.stream.clear();
        if (!ns.stream.empty() && !valid_name(ns.stream))
          diags.error(at(entry["stream"]), path + ".stream",
                      "a stream name uses letters, digits, '_' and '-' only (e.g. io, ema, comm)");
      }
      const NodeType* t = nullptr;
      if (entry["type"] && entry["type"].IsScalar()) {
        ns.type = entry["type"].Scalar();
        t = reg.find(ns.type);
        if (!t) {
          auto types = reg.types();
          auto plugins = reg.plugins();
          diags.error(at(entry["type"]), path + ".type",
                      "unknown node type '" + ns.type + "'" + did_you_mean(ns.type, types) + "; registered: " + join(types) +
                          (plugins.empty() ? " (no plugins loaded)" : " (plugins loaded: " + join(plugins) + ")"));
        }
      }
      g.nodes.push_back(ns);  // before its inputs: later nodes' refs see it, its own refs do not
      if (!t) continue;
      NodeSpec& me = g.nodes.back();
      me.origin = t->schema.origin;
      me.params = check_params(t->schema.params, entry["with"], ns.mark, file, path + ".with", diags, t->schema.moved);
      inputs(me, *t, entry["in"], g.nodes.size() - 1, all_names);
      if (me.schedule.at_stop)  // it runs after the last step retired: its values are gone
        for (const auto& in : me.inputs)
          if (in.schema->kind != PortKind::State)
            diags.error(in.mark, path + ".in." + in.port,
                        "'" + ns.name + "' runs at stop, after the last step's values are freed, so it can read "
                        "state inputs only; '" + in.port + "' is a " + to_string(in.schema->kind) +
                        " input: drop 'stop' from its at:, or split the node");
    }
  }
};

}  // namespace

GraphSpec check_graph(const YAML::Node& root, const std::string& file, const std::vector<std::string>& overrides,
                      Registry& reg) {
  Diagnostics diags;
  GraphSpec g;
  g.file = file;
  g.dir = fs::path(file).parent_path().string();
  if (g.dir.empty()) g.dir = ".";
  g.overrides = overrides;
  g.root = root;
  Checker c{file, reg, diags, g};
  YAML::Node top = check_params(graph_schema().top, root, Mark{file, 1, 1}, file, "", diags);
  g.name = top["name"] ? top["name"].as<std::string>() : fs::path(file).stem().string();
  g.run = top["run"];
  if (g.run["out_dir"].as<std::string>("").empty()) g.run["out_dir"] = "runs/" + g.name;
  if (g.run["device"]) {
    const std::string d = g.run["device"].as<std::string>("");
    const bool cuda_n = d.size() > 5 && d.rfind("cuda:", 0) == 0 &&
                        d.find_first_not_of("0123456789", 5) == std::string::npos && d.size() <= 8;
    if (d != "auto" && d != "cpu" && d != "cuda" && !cuda_n) {
      const YAML::Node at_device = root["run"] && root["run"].IsMap() ? root["run"]["device"] : YAML::Node();
      diags.error(at_device ? mark_of(at_device, file) : Mark{file, 1, 1}, "run.device",
                  "'" + d + "' is not a device: use auto, cpu, cuda or cuda:N (N = GPU index)");
    }
  }
  c.load_plugins(top);
  c.nodes(root["nodes"]);
  if (root["nodes"] && root["nodes"].IsMap() && root["nodes"].size() == 0)
    diags.error(mark_of(root["nodes"], file), "nodes", "the graph has no nodes");
  if (!diags.empty()) throw GraphError(diags);
  g.settings = run_settings(g.run);
  return g;
}

RunSettings run_settings(const YAML::Node& run) {
  RunSettings s;
  std::set<std::string> read;
  auto get = [&](const char* key, auto& field) {
    const YAML::Node v = run[key];
    if (!v) throw std::logic_error(std::string("run_settings: run.") + key + " is missing (a checked section has every key)");
    field = v.as<std::remove_reference_t<decltype(field)>>();
    read.insert(key);
  };
  get("steps", s.steps);
  get("seed", s.seed);
  get("device", s.device);
  get("precision", s.precision);
  get("prefetch", s.prefetch);
  get("out_dir", s.out_dir);
  get("log_every", s.log_every);
  get("threads", s.threads);
  get("workers", s.workers);
  get("compute_thread", s.compute_thread);
  get("cuda_graph", s.cuda_graph);
  get("cpu_gemm", s.cpu_gemm);
  get("trace", s.trace);
  get("profile", s.profile);
  get("progress", s.progress);
  get("stop_grace_s", s.stop_grace_s);
  get("resume", s.resume);
  get("comm_timeout_s", s.comm_timeout_s);
  get("heartbeat_timeout_s", s.heartbeat_timeout_s);
  {
    const YAML::Node par = run["parallel"];
    if (!par || !par["tp"] || !par["pp"]) throw std::logic_error("run_settings: run.parallel.tp/pp missing (a checked section has every key)");
    s.parallel.tp = par["tp"].as<int>();
    s.parallel.pp = par["pp"].as<int>();
    s.parallel.ep = par["ep"].as<int>();
    s.parallel.microbatches = par["microbatches"].as<int>();
    s.parallel.schedule = par["schedule"].as<std::string>();
    s.parallel.virtual_stages = par["virtual_stages"].as<int>();
    s.parallel.stage_layers = par["stage_layers"].as<std::vector<int>>();
    read.insert("parallel");
  }
  for (const auto& kv : run)
    if (!read.count(kv.first.as<std::string>()))
      throw std::logic_error("run_settings: run." + kv.first.as<std::string>() +
                             " is in schemas/graph.yaml but not in RunSettings (spec.hpp)");
  return s;
}

}  // namespace flowrun
