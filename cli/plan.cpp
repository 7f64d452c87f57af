// flowrun plan (issue 50; docs/parallel.md "Planning a layout"): the layouts of N devices for a
// graph, each predicted by the cost model (nodes/parallel/cost_model.hpp) from a profile of the
// graph's own model on this device, ranked; the best written as overrides. Its parts (plan.hpp):
//
//   0. The links (plan_links.cpp, `--measure-links`, under mpirun, no graph): each collective the
//      steps use, timed and fitted to a latency and a bandwidth, written as a file `--links` reads.
//   1. The profile (plan_profile.cpp): the graph runs a few steps here, one process, as one replica
//      would, with a few of its blocks at a few sizes, within a time budget, extrapolated to the
//      whole model. `--save-profile FILE` keeps it, `--profile FILE` reads one instead
//      (bench/plan_at_scale.py writes them for H100s).
//   2. The search (here): every layout of the devices the graph can express (cost::layouts; tp
//      dividing the model's heads; ZeRO stages only with a zero node; pipeline stages only for the
//      families that cut, without LoRA), each predicted under the device memory.
//   3. The table (here), fastest first (the ones that do not fit after, saying why), and `--out
//      FILE`: the fastest that fits as KEY=VALUE lines (`mpirun -np N flowrun GRAPH $(cat FILE)`).
#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include "args.hpp"
#include "plan.hpp"
#include "comm.hpp"
#include "commands.hpp"
#include "common/device.hpp"
#include "common/memory.hpp"
#include "parallel/cost_model.hpp"
#include "parallel/layout.hpp"
#include "registry.hpp"
#include "spec.hpp"
#include "train/update_rule.hpp"

namespace flowrun::cli {

using namespace plan;  // NOLINT: the command's own parts
namespace cost = parallel::cost;
using nlohmann::json;

namespace plan {

const NodeSpec* node_named(const GraphSpec& g, const std::string& name) {
  const int i = g.index_of(name);
  return i < 0 ? nullptr : &g.nodes[static_cast<size_t>(i)];
}

Roles roles_of(const GraphSpec& g) {
  Roles r;
  const NodeSpec* fb = nullptr;
  for (const NodeSpec& n : g.nodes)
    if (n.type == "forward_backward") {
      if (fb) throw std::runtime_error(g.file + ": plans one forward_backward; nodes '" + fb->name + "' and '" + n.name + "' both train");
      fb = &n;
    }
  if (!fb) throw std::runtime_error(g.file + ": no forward_backward node: nothing trains, so there is no layout to plan");
  r.fb = fb->name;
  auto ref = [](const NodeSpec& n, const std::string& port) -> std::string {
    const InputSpec* in = n.input(port);
    return in && !in->refs.empty() ? in->refs.front().node : std::string();
  };
  r.model = ref(*fb, "model");
  r.zero = ref(*fb, "zero");
  const NodeSpec* model = node_named(g, r.model);
  if (!model) throw std::runtime_error(g.file + ": forward_backward '" + r.fb + "' reads no model");
  r.model_type = model->type;
  r.split_sizes = parallel::tp_split_sizes(*model);
  r.blocks_param = parallel::alike_blocks_param(*model);
  if (!r.blocks_param.empty() && model->params[r.blocks_param] && model->params[r.blocks_param].IsScalar())
    r.blocks = model->params[r.blocks_param].as<int64_t>();
  else
    r.blocks_param.clear();
  // The batch's rows: the data sources up forward_backward's inputs (their batch is per rank).
  for (const NodeSpec* n : parallel::batch_sources(g, r.fb)) {
    r.sources.emplace_back(n->name, n->params["batch"].as<int64_t>());
    r.batch += r.sources.back().second;
  }
  if (r.sources.empty())
    throw std::runtime_error(g.file + ": no data source (a node type with a `batch` output and parameter) feeds "
                             "forward_backward '" + r.fb + "': the plan sets the rows a replica reads there");
  for (const NodeSpec& n : g.nodes)
    if (n.type == "optimizer" && n.params["kind"]) {
      const std::string kind = n.params["kind"].as<std::string>();
      const std::string settings = n.params[kind] ? YAML::Dump(n.params[kind]) : "{}";
      r.whole_tensors = r.whole_tensors || !make_update_rule(kind, settings)->elementwise();
    }
  return r;
}

// Each source's share of `rows` as it shares the graph's batch (one source: all of them).
std::vector<std::string> Roles::batch_overrides(double rows) const {
  std::vector<std::string> o;
  for (const auto& [name, b] : sources) {
    const double share = batch > 0 ? static_cast<double>(b) / static_cast<double>(batch) : 1.0;
    o.push_back(name + ".batch=" + std::to_string(std::max<int64_t>(1, std::llround(rows * share))));
  }
  return o;
}

}  // namespace plan

namespace {

const char* kPlanUsage =
    "usage: flowrun plan FILE [KEY=VALUE...] --devices N [--gpus-per-node G] [--device-memory SIZE]\n"
    "                    [--links FILE | --bandwidth intra=GB/s,inter=GB/s --latency intra=us,inter=us]\n"
    "                    [--global-batch ROWS] [--peak-tflops X] [--profile FILE | --save-profile FILE]\n"
    "                    [--profile-rounds R] [--profile-blocks K|all] [--profile-seconds S]\n"
    "                    [--out FILE] [--table FILE] [--top K]\n"
    "       mpirun -np N flowrun plan --measure-links --out FILE\n"
    "  the layouts of N devices for FILE (dp x tp x pp, the ZeRO stage, checkpointing, micro-batches,\n"
    "  the pipeline schedule), predicted from a profile of its model on this device (a few steps, one\n"
    "  process) and the links between devices, fastest first; --out FILE writes the fastest that fits\n"
    "  as KEY=VALUE lines: mpirun -np N flowrun FILE $(cat FILE).\n"
    "  --device-memory  per device (80GB, 24GiB; default: this machine's available memory / N)\n"
    "  --gpus-per-node  devices a node (default N: one machine); groups within a node use intra\n"
    "  --bandwidth, --latency  the links (default intra 5 GB/s and 10 us: MPI between processes on\n"
    "                   one machine; inter 1.25 GB/s and 50 us)\n"
    "  --measure-links  under mpirun: time the collectives over the ranks' groups and write their fitted\n"
    "                   latency and bandwidth to --out FILE, which --links FILE reads (groups within a node)\n"
    "  --global-batch   rows a step over every replica (default N x the graph's batch: what dp N trains)\n"
    "  --peak-tflops    the device's datasheet peak at the training precision (989 for an H100's bf16):\n"
    "                   the table's MFU column (model FLOPs a second a device over it)\n"
    "  --table FILE     every layout predicted, as JSON (its overrides, times and memory by part)\n"
    "  --profile-rounds each profile size run R times, the medians kept (default 3 on a CPU, 1 on a GPU)\n"
    "  --profile-blocks the model's blocks that run in the profile (default 1; all: the whole model); a\n"
    "                   family whose blocks are alike (gpt) repeats the last one's times for the others\n"
    "  --profile-seconds the profile's budget (default 45): sizes of 1, 2, 4, ... rows up to a replica's,\n"
    "                   each predicted from the last, not started past it (the first always runs)\n";



// ---- 2. the search, 3. the table and the overrides

double parse_size(const std::string& s) {  // "80GB", "24GiB", "512MB", bytes
  size_t used = 0;
  const double v = std::stod(s, &used);
  std::string unit = s.substr(used);
  for (auto& ch : unit) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  static const std::map<std::string, double> units{{"", 1},      {"b", 1},          {"kb", 1e3}, {"mb", 1e6},
                                                   {"gb", 1e9},  {"tb", 1e12},      {"kib", 1024.0},
                                                   {"mib", 1048576.0}, {"gib", 1073741824.0}, {"tib", 1099511627776.0}};
  auto it = units.find(unit);
  if (it == units.end() || !(v > 0)) throw std::invalid_argument("expected a size such as 80GB or 24GiB, got '" + s + "'");
  return v * it->second;
}

// "intra=X,inter=Y" -> the two numbers.
std::pair<double, double> parse_pair(const std::string& s, double intra, double inter) {
  std::istringstream in(s);
  for (std::string part; std::getline(in, part, ',');) {
    const size_t eq = part.find('=');
    if (eq == std::string::npos) throw std::invalid_argument("expected intra=X,inter=Y, got '" + s + "'");
    const std::string key = part.substr(0, eq);
    const double v = std::stod(part.substr(eq + 1));
    if (!(v > 0)) throw std::invalid_argument("'" + part + "': expected a number above 0");
    if (key == "intra") intra = v;
    else if (key == "inter") inter = v;
    else throw std::invalid_argument("'" + key + "': expected intra or inter");
  }
  return {intra, inter};
}

// The layout as the run's settings: everything it sets, the pipeline's cut included (the cost
// model's, from the profiled times), so that the run is the layout predicted.
std::vector<std::string> overrides_of(const cost::Layout& l, const cost::Prediction& pr, const Roles& r, double global_rows) {
  std::vector<std::string> o{"run.parallel.tp=" + std::to_string(l.tp), "run.parallel.pp=" + std::to_string(l.pp)};
  if (l.ep > 1) o.push_back("run.parallel.ep=" + std::to_string(l.ep));
  if (l.pp > 1) {
    o.push_back("run.parallel.microbatches=" + std::to_string(l.microbatches));
    o.push_back(std::string("run.parallel.schedule=") + parallel::pipeline::name(l.schedule));
    if (l.virtual_stages > 1) o.push_back("run.parallel.virtual_stages=" + std::to_string(l.virtual_stages));
    std::string cut;
    for (int n : pr.stage_layers) cut += (cut.empty() ? "" : ",") + std::to_string(n);
    o.push_back("run.parallel.stage_layers=[" + cut + "]");
    o.push_back(r.fb + ".accumulate=1");
  } else {
    o.push_back(r.fb + ".accumulate=" + std::to_string(l.microbatches));
  }
  if (!r.zero.empty()) o.push_back(r.zero + ".stage=" + cost::name(l.zero));
  if (r.whole_tensors && (l.zero == cost::Zero::gradients || l.zero == cost::Zero::params)) o.push_back(r.zero + ".cut=tensors");
  o.push_back(r.model + ".checkpoint=" + CheckpointPolicy{l.checkpoint_every}.str());
  for (const std::string& b : r.batch_overrides(global_rows / l.dp)) o.push_back(b);
  return o;
}

}  // namespace

int cmd_plan(const std::vector<std::string>& args) {
  if (wants_help(args)) return std::fputs(kPlanUsage, stdout), 0;
  std::map<std::string, std::string> opt;
  std::vector<std::string> rest;
  static const std::set<std::string> kValued{"--devices", "--gpus-per-node", "--device-memory", "--bandwidth",
                                             "--latency", "--links", "--global-batch", "--peak-tflops", "--profile",
                                             "--save-profile", "--profile-rounds", "--profile-blocks",
                                             "--profile-seconds", "--out", "--table", "--top"};
  bool links_only = false;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--measure-links") {
      links_only = true;
    } else if (kValued.count(args[i])) {
      if (i + 1 >= args.size()) return usage_error("plan", args[i] + " needs a value", kPlanUsage);
      opt[args[i]] = args[i + 1];
      ++i;
    } else {
      rest.push_back(args[i]);
    }
  }
  if (links_only) {
    if (!rest.empty() || opt.size() != 1 || !opt.count("--out"))
      return usage_error("plan", "--measure-links takes --out FILE and nothing else (no graph: it times the links)", kPlanUsage);
    try {
      return measure_links(opt.at("--out"));
    } catch (const std::exception& e) {
      comm::abort_job(std::string("flowrun plan --measure-links: ") + e.what(), 2);
      return 2;
    }
  }
  FileArgs f = split_args(rest);
  if (!f.error.empty()) return usage_error("plan", f.error, kPlanUsage);
  if (!f.flags.empty()) return usage_error("plan", "unknown option " + f.flags.front(), kPlanUsage);
  if (!opt.count("--devices")) return usage_error("plan", "--devices N is required (the devices to lay the run out on)", kPlanUsage);
  if (comm::size() > 1) return usage_error("plan", "runs as one process (it profiles one replica here); not under mpirun", kPlanUsage);
  if (opt.count("--links") && (opt.count("--bandwidth") || opt.count("--latency")))
    return usage_error("plan", "--links (measured) or --bandwidth/--latency (given), not both", kPlanUsage);
  for (const char* profiling : {"--save-profile", "--profile-rounds", "--profile-blocks", "--profile-seconds"})
    if (opt.count("--profile") && opt.count(profiling))
      return usage_error("plan", std::string(profiling) + " belongs to a profile run here; --profile FILE reads one instead",
                         kPlanUsage);
  cost::Cluster c;
  int top = 20;
  double global_rows = 0, peak_flops = 0;
  int rounds = 0;  // profile rounds; 0: the device's default
  int64_t profile_blocks = 1;  // 0: all
  double profile_seconds = 45;
  try {
    auto count = [&](const std::string& key, int lo) {
      size_t used = 0;
      const int v = std::stoi(opt.at(key), &used);
      if (used != opt.at(key).size() || v < lo) throw std::invalid_argument(key + " " + opt.at(key) + ": expected a whole number >= " + std::to_string(lo));
      return v;
    };
    c.devices = count("--devices", 1);
    c.per_node = opt.count("--gpus-per-node") ? count("--gpus-per-node", 1) : c.devices;
    if (opt.count("--top")) top = count("--top", 1);
    if (opt.count("--global-batch")) global_rows = count("--global-batch", 1);
    const auto [bw_intra, bw_inter] = parse_pair(opt.count("--bandwidth") ? opt.at("--bandwidth") : "", 5.0, 1.25);
    const auto [lat_intra, lat_inter] = parse_pair(opt.count("--latency") ? opt.at("--latency") : "", 10.0, 50.0);
    c.intra = {lat_intra * 1e-6, bw_intra * 1e9}, c.inter = {lat_inter * 1e-6, bw_inter * 1e9};
    c.memory_bytes = opt.count("--device-memory") ? parse_size(opt.at("--device-memory")) : available_host_memory() / c.devices;
    if (opt.count("--peak-tflops")) {
      size_t used = 0;
      peak_flops = std::stod(opt.at("--peak-tflops"), &used) * 1e12;
      if (used != opt.at("--peak-tflops").size() || !(peak_flops > 0))
        throw std::invalid_argument("--peak-tflops " + opt.at("--peak-tflops") + ": expected a number above 0 (989 for an H100's bf16)");
    }
    if (opt.count("--links")) read_links(opt.at("--links"), c);
    if (opt.count("--profile-rounds")) rounds = count("--profile-rounds", 1);
    if (opt.count("--profile-blocks")) profile_blocks = opt.at("--profile-blocks") == "all" ? 0 : count("--profile-blocks", 1);
    if (opt.count("--profile-seconds")) profile_seconds = count("--profile-seconds", 1);
  } catch (const std::exception& e) {
    return usage_error("plan", e.what(), kPlanUsage);
  }
  GraphSpec g;
  if (!load(f.file, f.overrides, g)) return 2;
  try {
    const Roles r = roles_of(g);
    if (global_rows == 0) global_rows = static_cast<double>(r.batch) * c.devices;
    // On a CPU the devices of a node are its processes: each gets the cores / the node's devices
    // as intra-op threads (run.threads' default), profiled beside the others (Neighbours).
    const bool cpu = resolve_device(g.settings.device, 0) == "cpu";
    const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    const int threads = cpu ? std::max(1, cores / c.per_node) : 0;
    // A process's speed on a shared CPU varies by up to a quarter from one run to the next: three
    // rounds there, their medians; one on a GPU.
    if (rounds == 0) rounds = cpu ? 3 : 1;
    // The profile's neighbours fill the cores the node's other devices keep busy (beyond them the
    // devices take turns: the cost model's bound of a node's work over its cores).
    const int neighbours = cpu ? std::min(c.per_node, std::max(1, cores / threads)) - 1 : 0;
    Profile p;
    if (opt.count("--profile")) {
      std::ifstream in(opt.at("--profile"));
      if (!in) throw std::runtime_error("--profile " + opt.at("--profile") + ": cannot read it");
      try {
        p = profile_of(json::parse(in));
      } catch (const json::exception& e) {
        throw std::runtime_error("--profile " + opt.at("--profile") + ": not a profile flowrun plan --save-profile wrote (" + e.what() + ")");
      }
    } else {
      ProfileRequest q;
      q.rows = std::max<int64_t>(1, std::llround(global_rows / c.devices));  // one replica's, at dp = the devices
      q.threads = threads, q.neighbours = neighbours, q.cores = cpu ? cores : 0, q.rounds = rounds;
      q.blocks = profile_blocks, q.seconds = profile_seconds;
      p = profile_here(g, f.overrides, r, q);
      if (opt.count("--save-profile")) {
        std::ofstream out(opt.at("--save-profile"));
        out << profile_json(p).dump(2) << "\n";
        if (!out) throw std::runtime_error("--save-profile " + opt.at("--save-profile") + ": cannot write it");
      }
    }
    // A profile taken on a CPU (its threads recorded): the node's devices share this machine's cores.
    if (p.threads > 0) c.cores = cores, c.threads = p.threads;
    const cost::Model& m = p.model;
    double block_s = 0, fwd_s = 0, rec_s = 0;
    for (const auto& b : m.blocks) block_s += b.fwd_s + b.bwd_s, fwd_s += b.fwd_s, rec_s += b.rec_s;
    std::printf("model '%s' (%s): %zu blocks%s, %.2fM parameters; at %.0f rows a step: blocks %.1f ms, embeddings %.1f ms, "
                "head and loss %.1f ms, update %.1f ms, the rest %.1f ms\n",
                r.model.c_str(), r.model_type.c_str(), m.blocks.size(),
                p.profiled_blocks > 0 ? fmt::format(" ({} timed, the others repeating the last)", p.profiled_blocks).c_str() : "",
                m.params() / 1e6, m.rows, block_s * 1e3,
                (m.first.fwd_s + m.first.bwd_s) * 1e3, (m.last.fwd_s + m.last.bwd_s) * 1e3,
                m.update_s_per_param * m.trained() * 1e3, m.other_s * 1e3);
    if (!m.blocks.empty() && m.blocks.front().rec_s >= 0)
      std::printf("  checkpointing every block adds %.1f ms to the backward (the forwards: %.1f ms)\n", rec_s * 1e3, fwd_s * 1e3);
    if (!p.nodes.empty()) {  // what "the rest" is made of: each node's own time (some of it overlapped)
      std::vector<std::pair<double, std::string>> by_time;
      for (const auto& [name, sec] : p.nodes) by_time.emplace_back(sec, name);
      std::sort(by_time.rbegin(), by_time.rend());
      std::string text;
      for (const auto& [sec, name] : by_time) text += (text.empty() ? "" : ", ") + fmt::format("{} {:.1f} ms", name, sec * 1e3);
      std::printf("  the other nodes a step, each on its own (frozen encoders and data work on a replica's rows): %s\n", text.c_str());
    }

    // The layouts this graph can express.
    int max_tp = 1;
    if (p.splits)
      for (int t = 2; t <= c.devices && parallel::tp_divides(r.split_sizes, t); t *= 2) max_tp = t;
    std::vector<std::pair<cost::Layout, cost::Prediction>> ranked;
    for (const cost::Layout& l : cost::layouts(m, c, global_rows, max_tp)) {
      if (l.zero != cost::Zero::none && r.zero.empty()) continue;  // no zero node to set
      if (l.pp > 1 && (!p.splits || p.frozen)) continue;          // no stages for this model
      cost::Prediction pr = cost::predict(m, l, c, global_rows);
      if (pr.fits || pr.memory.total() > 0) ranked.emplace_back(l, pr);  // else it cannot run at all (pr.why)
    }
    // Fastest first; within 1 % the simpler (fewer ranks to a model copy, no ZeRO, no
    // recomputation, fewer micro-batches): what a user would pick between equals.
    auto simpler = [](const cost::Layout& l) {
      return std::make_tuple(l.tp * l.pp, l.ep, static_cast<int>(l.zero), l.checkpoint_every, l.microbatches, l.virtual_stages);
    };
    std::stable_sort(ranked.begin(), ranked.end(), [&](const auto& a, const auto& b) {
      if (a.second.fits != b.second.fits) return a.second.fits;
      const double ta = a.second.step_s, tb = b.second.step_s;
      if (std::abs(ta - tb) > 0.01 * std::min(ta, tb)) return ta < tb;
      return simpler(a.first) < simpler(b.first);
    });
    const std::string intra = opt.count("--links") ? "measured (" + opt.at("--links") + ")"
                                                   : fmt::format("{:.2f} GB/s {:.0f} us", c.intra.bytes_per_s / 1e9, c.intra.latency_s * 1e6);
    std::printf("%d devices (%d a node), %s each; links within a node %s, between nodes %.2f GB/s %.0f us; %.0f rows a step\n",
                c.devices, c.per_node, bytes_text(c.memory_bytes).c_str(), intra.c_str(), c.inter.bytes_per_s / 1e9,
                c.inter.latency_s * 1e6, global_rows);
    // Model FLOPs a second a device over the datasheet's peak; "-" where either is unknown.
    auto mfu = [&](const cost::Prediction& pr) {
      return peak_flops > 0 && m.flops_per_row > 0 ? m.flops_per_row * global_rows / pr.step_s / c.devices / peak_flops : -1.0;
    };
    auto memory_text = [](const cost::Memory& mem) {
      return bytes_text(mem.total()) + " = " + bytes_text(mem.weights) + " + " + bytes_text(mem.gradients) + " + " +
             bytes_text(mem.optimizer) + " + " + bytes_text(mem.ema) + " + " + bytes_text(mem.activations) +
             (mem.gathered > 0 ? " + " + bytes_text(mem.gathered) : std::string());
    };
    std::printf("%4s  %-62s %9s %10s %11s %6s  %-60s %7s %7s\n", "rank", "layout", "step s", "rows/s/dev", "tokens/s/dev",
                "MFU", "memory a device = weights + grads + optimizer + ema + activations (+ gathered)", "bubble", "comm");
    int shown = 0;
    for (const auto& [l, pr] : ranked) {
      if (shown++ >= top) break;
      const double per_dev = global_rows / pr.step_s / c.devices, u = mfu(pr);
      std::printf("%4d  %-62s %9.4f %10.1f %11s %6s  %-60s %6.1f%% %6.1f%%%s\n", shown, l.str().c_str(), pr.step_s, per_dev,
                  p.tokens_per_row > 0 ? fmt::format("{:.0f}", per_dev * p.tokens_per_row).c_str() : "-",
                  u >= 0 ? fmt::format("{:.1f}%", 100 * u).c_str() : "-", memory_text(pr.memory).c_str(), 100 * pr.bubble,
                  pr.step_s > 0 ? 100 * pr.comm_s / pr.step_s : 0.0, pr.fits ? "" : "  does not fit");
    }
    if (opt.count("--table")) {
      json rows = json::array();
      for (const auto& [l, pr] : ranked) {
        const cost::Memory& mem = pr.memory;
        rows.push_back({{"layout", l.str()}, {"dp", l.dp}, {"tp", l.tp}, {"pp", l.pp}, {"ep", l.ep}, {"zero", cost::name(l.zero)},
                        {"checkpoint_every", l.checkpoint_every}, {"microbatches", l.microbatches},
                        {"schedule", parallel::pipeline::name(l.schedule)}, {"virtual_stages", l.virtual_stages},
                        {"overrides", overrides_of(l, pr, r, global_rows)}, {"step_s", pr.step_s}, {"compute_s", pr.compute_s},
                        {"comm_s", pr.comm_s}, {"update_s", pr.update_s}, {"other_s", pr.other_s}, {"bubble", pr.bubble},
                        {"mfu", mfu(pr)}, {"fits", pr.fits}, {"why", pr.why},
                        {"memory", {{"total", mem.total()}, {"weights", mem.weights}, {"gradients", mem.gradients},
                                    {"optimizer", mem.optimizer}, {"ema", mem.ema}, {"activations", mem.activations},
                                    {"gathered", mem.gathered}}}});
      }
      std::ofstream out(opt.at("--table"));
      out << json{{"devices", c.devices}, {"global_rows", global_rows}, {"layouts", rows}}.dump(2) << "\n";
      if (!out) throw std::runtime_error("--table " + opt.at("--table") + ": cannot write it");
    }
    const auto best = std::find_if(ranked.begin(), ranked.end(), [](const auto& x) { return x.second.fits; });
    if (best == ranked.end()) {
      std::printf("no layout of %d devices fits %s a device; more devices, or a smaller model or batch\n", c.devices,
                  bytes_text(c.memory_bytes).c_str());
      return 1;
    }
    const std::vector<std::string> lines = overrides_of(best->first, best->second, r, global_rows);
    std::string joined;
    for (const auto& x : lines) joined += " " + x;
    std::printf("fastest that fits: %s\n  mpirun -np %d flowrun %s%s\n", best->first.str().c_str(), c.devices,
                g.file.c_str(), joined.c_str());
    if (opt.count("--out")) {
      std::ofstream out(opt.at("--out"));
      for (const auto& x : lines) out << x << "\n";
      if (!out) throw std::runtime_error("--out " + opt.at("--out") + ": cannot write it");
      std::printf("written to %s: mpirun -np %d flowrun %s $(cat %s)\n", opt.at("--out").c_str(), c.devices, g.file.c_str(),
                  opt.at("--out").c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flowrun plan: %s\n", e.what());
    return 2;
  }
}

}  // namespace flowrun::cli
