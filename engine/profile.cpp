// The profile of a run from its node spans; what each figure means is in profile.hpp.
// Sections: reading a trace file, per-node statistics, overlap, waits, the critical path,
// the text table and the JSON.
#include "profile.hpp"

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>

#include "diag.hpp"
#include "spec.hpp"

namespace flowrun {

const NodeProfile* Profile::node(const std::string& name) const {
  for (const auto& n : nodes)
    if (n.name == name) return &n;
  return nullptr;
}

double Profile::mean_wait_us(const std::string& from, const std::string& to) const {
  const NodeProfile* t = node(to);
  if (!t || t->runs == 0) return 0;
  double total = 0;
  for (const auto& w : waits)
    if (w.from == from && w.to == to) total += w.total_us;
  return total / static_cast<double>(t->runs);
}

// ---- reading a trace file ---------------------------------------------------------------------

std::vector<TraceSpan> read_trace_file(const std::string& path) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (std::filesystem::is_directory(st))
    throw std::runtime_error(path + " is a folder; --trace takes the file a run wrote with run.trace=FILE");
  if (std::filesystem::exists(st) && !std::filesystem::is_regular_file(st))
    throw std::runtime_error(path + " is not a regular file (a device or a pipe?); --trace takes the file a run wrote with "
                             "run.trace=FILE");
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read the trace " + path + " (write one with run.trace=FILE)");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const std::exception& e) {
    throw std::runtime_error(path + ": not a trace-event JSON file (" + e.what() + ")");
  }
  if (!j.is_object() || !j.contains("traceEvents") || !j["traceEvents"].is_array())
    throw std::runtime_error(path + ": no \"traceEvents\" array: not a trace flowrun wrote (run.trace=FILE)");
  std::vector<TraceSpan> spans;
  for (const auto& e : j["traceEvents"]) {
    // Node spans are the complete events ("X") whose args list their deps.
    if (!e.is_object() || e.value("ph", "") != "X" || !e.contains("args") || !e["args"].is_object() ||
        !e["args"].contains("deps"))
      continue;
    try {
      TraceSpan s;
      s.node = e.at("name").get<std::string>();
      s.type = e.value("cat", "");
      s.t0 = e.at("ts").get<double>();
      s.t1 = s.t0 + e.at("dur").get<double>();
      s.tid = e.value("tid", 0);
      const auto& a = e["args"];
      s.step = a.at("step").get<int64_t>();
      s.stream = a.value("stream", "");
      for (const auto& d : a["deps"]) s.deps.emplace_back(d.at(0).get<std::string>(), d.at(1).get<int64_t>());
      spans.push_back(std::move(s));
    } catch (const std::exception& ex) {
      throw std::runtime_error(path + ": a span that is not as flowrun writes it (" + ex.what() + "): " + e.dump());
    }
  }
  if (spans.empty())
    throw std::runtime_error(path + ": no node spans with their dependencies (a trace of this flowrun's `run.trace`?)");
  return spans;
}

namespace {

double percentile(const std::vector<double>& sorted, double p) {  // nearest rank
  if (sorted.empty()) return 0;
  const auto k = static_cast<size_t>(std::ceil(p * static_cast<double>(sorted.size())));
  return sorted[std::min(sorted.size() - 1, k == 0 ? 0 : k - 1)];
}

}  // namespace

Profile make_profile(const GraphSpec& g, const std::vector<TraceSpan>& all) {
  Profile p;
  std::map<std::string, size_t> order;  // node -> file position
  for (size_t i = 0; i < g.nodes.size(); ++i) order[g.nodes[i].name] = i;
  std::vector<const TraceSpan*> spans;
  std::set<std::string> foreign;  // "name : type" of nodes the graph does not have
  for (const auto& s : all) {
    auto it = order.find(s.node);
    if (it != order.end() && (s.type.empty() || s.type == g.nodes[it->second].type))
      spans.push_back(&s);
    else
      foreign.insert(s.node + " : " + s.type);
  }
  if (spans.empty() || !foreign.empty()) {
    std::set<std::string> graph;
    for (const auto& n : g.nodes) graph.insert(n.name + " : " + n.type);
    throw std::runtime_error("the trace's nodes (" + join({foreign.begin(), foreign.end()}) + ") are not the graph's (" +
                             join({graph.begin(), graph.end()}) +
                             "): give the graph file the trace was made with");
  }

  // ---- per-node statistics ----
  std::map<std::pair<std::string, int64_t>, const TraceSpan*> at;  // (node, step) -> span
  double t_first = spans.front()->t0, t_last = spans.front()->t1;
  std::set<int> threads;
  std::set<int64_t> steps;
  std::vector<std::vector<double>> durations(g.nodes.size());
  for (const TraceSpan* s : spans) {
    at.emplace(std::make_pair(s->node, s->step), s);
    t_first = std::min(t_first, s->t0);
    t_last = std::max(t_last, s->t1);
    threads.insert(s->tid);
    steps.insert(s->step);
    durations[order[s->node]].push_back(s->t1 - s->t0);
  }
  p.wall_us = t_last - t_first;
  p.steps = static_cast<int64_t>(steps.size());
  p.threads = static_cast<int>(threads.size());
  std::map<std::string, size_t> index;  // node -> position in p.nodes
  double busy = 0;
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    auto& d = durations[i];
    if (d.empty()) continue;
    std::sort(d.begin(), d.end());
    NodeProfile n;
    n.name = g.nodes[i].name;
    n.type = g.nodes[i].type;
    n.runs = static_cast<int64_t>(d.size());
    for (double x : d) n.total_us += x;
    n.mean_us = n.total_us / static_cast<double>(n.runs);
    n.p50_us = percentile(d, 0.50);
    n.p95_us = percentile(d, 0.95);
    n.max_us = d.back();
    n.share = p.wall_us > 0 ? n.total_us / p.wall_us : 0;
    busy += n.total_us;
    index[n.name] = p.nodes.size();
    p.nodes.push_back(n);
  }
  p.idle_fraction = p.wall_us > 0 && p.threads > 0 ? std::max(0.0, 1.0 - busy / (p.threads * p.wall_us)) : 0;

  // ---- overlap: per span, the time inside it when at least two spans ran ----
  // Segments between consecutive span boundaries, each with the number of spans running.
  std::vector<std::pair<double, int>> edges;
  for (const TraceSpan* s : spans) edges.push_back({s->t0, +1}), edges.push_back({s->t1, -1});
  std::sort(edges.begin(), edges.end());
  std::vector<double> seg_start, seg_end;
  std::vector<int> seg_count;
  int running = 0;
  for (size_t k = 0; k + 1 < edges.size(); ++k) {
    running += edges[k].second;
    if (edges[k + 1].first > edges[k].first) {
      seg_start.push_back(edges[k].first);
      seg_end.push_back(edges[k + 1].first);
      seg_count.push_back(running);
    }
  }
  for (const TraceSpan* s : spans) {
    double both = 0;
    auto k = static_cast<size_t>(std::upper_bound(seg_start.begin(), seg_start.end(), s->t0) - seg_start.begin());
    k = k == 0 ? 0 : k - 1;
    for (; k < seg_start.size() && seg_start[k] < s->t1; ++k)
      if (seg_count[k] >= 2) both += std::max(0.0, std::min(seg_end[k], s->t1) - std::max(seg_start[k], s->t0));
    p.nodes[index[s->node]].overlapped_us += both;
  }

  // ---- waits, and the dependency that ended last ----
  auto find = [&](const std::pair<std::string, int64_t>& d) -> const TraceSpan* {
    auto it = at.find(d);
    return it == at.end() ? nullptr : it->second;
  };
  std::map<int64_t, double> step_begin;  // the first start among a step's instances
  for (const TraceSpan* s : spans) {
    auto [it, fresh] = step_begin.emplace(s->step, s->t0);
    if (!fresh) it->second = std::min(it->second, s->t0);
  }
  std::map<std::tuple<std::string, std::string, bool>, DependencyWait> waits;
  for (const TraceSpan* s : spans) {
    const TraceSpan* self = nullptr;
    const TraceSpan* last = nullptr;
    for (const auto& d : s->deps) {
      const TraceSpan* x = find(d);
      if (!x) continue;  // a dependency outside the trace (before it started) or not of this graph
      if (x->node == s->node)
        self = x;
      else if (!last || x->t1 > last->t1)
        last = x;
    }
    if (!self || !last) continue;
    // Free: its previous run done and its step begun (a node every N steps is not waiting
    // during the steps it is not due).
    const double w = std::max(0.0, last->t1 - std::max(self->t1, step_begin[s->step]));
    if (w <= 0) continue;
    p.nodes[index[s->node]].waited_us += w;
    auto& dw = waits[{last->node, s->node, last->step == s->step}];
    dw.from = last->node;
    dw.to = s->node;
    dw.same_step = last->step == s->step;
    dw.total_us += w;
    ++dw.runs;
  }
  for (auto& [k, w] : waits) p.waits.push_back(w);

  // ---- the critical path of each step, and the most frequent one ----
  std::map<int64_t, const TraceSpan*> last_of_step;
  for (const TraceSpan* s : spans) {
    auto& l = last_of_step[s->step];
    if (!l || s->t1 > l->t1) l = s;
  }
  std::map<std::vector<std::string>, std::pair<int64_t, double>> paths;  // path -> (steps, total length)
  for (const auto& [step, end] : last_of_step) {
    std::vector<std::string> path{end->node};
    const TraceSpan* cur = end;
    for (size_t guard = 0; guard < g.nodes.size(); ++guard) {
      const TraceSpan* prev = nullptr;
      for (const auto& d : cur->deps) {
        const TraceSpan* x = find(d);
        if (x && (!prev || x->t1 > prev->t1)) prev = x;
      }
      if (!prev || prev->step != step || prev->node == cur->node) break;
      cur = prev;
      path.push_back(cur->node);
    }
    std::reverse(path.begin(), path.end());
    auto& [n, len] = paths[path];
    ++n;
    len += end->t1 - cur->t0;
  }
  for (const auto& [path, v] : paths)
    if (v.first > p.critical_path_steps || (v.first == p.critical_path_steps && path.size() > p.critical_path.size())) {
      p.critical_path = path;
      p.critical_path_steps = v.first;
      p.critical_path_us = v.second / static_cast<double>(v.first);
    }
  return p;
}

// ---- the text table and the JSON ----------------------------------------------------------------

namespace {

std::string ms(double us) { return fmt::format("{:.3f}", us / 1000.0); }

}  // namespace

std::string profile_table(const Profile& p) {
  std::ostringstream o;
  o << fmt::format("profile: {} steps in {:.3f} s, {} threads ran nodes, idle {:.1f} %\n", p.steps, p.wall_us / 1e6,
                   p.threads, 100 * p.idle_fraction);
  o << fmt::format("{:<12} {:<20} {:>6} {:>9} {:>9} {:>9} {:>9} {:>10} {:>6} {:>11} {:>10}\n", "node", "type", "runs",
                   "mean ms", "p50 ms", "p95 ms", "max ms", "total s", "wall%", "overlap%", "waited s");
  for (const auto& n : p.nodes)
    o << fmt::format("{:<12} {:<20} {:>6} {:>9} {:>9} {:>9} {:>9} {:>10.3f} {:>6.1f} {:>11.1f} {:>10.3f}\n", n.name,
                     n.type, n.runs, ms(n.mean_us), ms(n.p50_us), ms(n.p95_us), ms(n.max_us), n.total_us / 1e6,
                     100 * n.share, n.total_us > 0 ? 100 * n.overlapped_us / n.total_us : 0.0, n.waited_us / 1e6);
  o << fmt::format("critical path ({} of {} steps, {} ms): {}", p.critical_path_steps, p.steps,
                   ms(p.critical_path_us), join(p.critical_path, " -> "));
  return o.str();
}

std::string profile_json(const Profile& p) {
  nlohmann::ordered_json j;
  j["wall_s"] = p.wall_us / 1e6;
  j["steps"] = p.steps;
  j["threads"] = p.threads;
  j["idle_fraction"] = p.idle_fraction;
  j["nodes"] = nlohmann::ordered_json::array();
  for (const auto& n : p.nodes) {
    nlohmann::ordered_json x;
    x["name"] = n.name;
    x["type"] = n.type;
    x["runs"] = n.runs;
    x["mean_ms"] = n.mean_us / 1e3;
    x["p50_ms"] = n.p50_us / 1e3;
    x["p95_ms"] = n.p95_us / 1e3;
    x["max_ms"] = n.max_us / 1e3;
    x["total_s"] = n.total_us / 1e6;
    x["share_of_wall"] = n.share;
    x["overlapped_s"] = n.overlapped_us / 1e6;
    x["waited_s"] = n.waited_us / 1e6;
    j["nodes"].push_back(x);
  }
  j["waits"] = nlohmann::ordered_json::array();
  for (const auto& w : p.waits)
    j["waits"].push_back({{"from", w.from}, {"to", w.to}, {"same_step", w.same_step}, {"total_s", w.total_us / 1e6},
                          {"runs", w.runs}});
  j["critical_path"] = {{"nodes", p.critical_path}, {"steps", p.critical_path_steps},
                        {"mean_ms", p.critical_path_us / 1e3}};
  return j.dump(2) + "\n";
}

}  // namespace flowrun
