// flowrun plan (issue 50; docs/parallel.md "Planning a layout"): the layouts of N devices for a
// graph, each predicted by the cost model (nodes/parallel/cost_model.hpp) from a profile of the
// graph's own model on this device, ranked; the best written as overrides. In order:
//
//   1. The profile: the graph runs a few steps here, one process, as one replica would (tp = pp =
//      1, no checkpointing, no ZeRO, accumulate 1; its periodic nodes off), forward_backward
//      timing each block (time_blocks) into a trace. From the trace: each block's forward and
//      backward seconds, the layers before the first block and after the last, the optimizer's
//      and EMA's seconds a parameter, the rest of the step; from the model (read after setup):
//      each block's parameters and the share tensor parallel splits, and forward_backward's
//      activation estimates. `--save-profile FILE` keeps it, `--profile FILE` reads one instead.
//   2. The search: every layout of the devices the graph can express (cost::layouts; tp dividing
//      the model's heads; ZeRO stages only with a zero node; pipeline stages only for the
//      families that cut, without LoRA), each predicted under the device memory.
//   3. The table, fastest first (the ones that do not fit after, saying why), and `--out FILE`:
//      the fastest that fits as KEY=VALUE lines (`mpirun -np N flowrun GRAPH $(cat FILE)`).
#include <spdlog/spdlog.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include <unistd.h>

#include "args.hpp"
#include "comm.hpp"
#include "commands.hpp"
#include "common/memory.hpp"
#include "executor.hpp"
#include "models/activation_checkpoint.hpp"
#include "models/model_state.hpp"
#include "parallel/cost_model.hpp"
#include "registry.hpp"
#include "run_session.hpp"
#include "spec.hpp"
#include "train/update_rule.hpp"

namespace flowrun::cli {

namespace {

namespace cost = parallel::cost;
using nlohmann::json;

const char* kPlanUsage =
    "usage: flowrun plan FILE [KEY=VALUE...] --devices N [--gpus-per-node G] [--device-memory SIZE]\n"
    "                    [--bandwidth intra=GB/s,inter=GB/s] [--latency intra=us,inter=us] [--global-batch ROWS]\n"
    "                    [--profile FILE | --save-profile FILE] [--out FILE] [--top K]\n"
    "  the layouts of N devices for FILE (dp x tp x pp, the ZeRO stage, checkpointing, micro-batches,\n"
    "  the pipeline schedule), predicted from a profile of its model on this device (a few steps, one\n"
    "  process) and the links between devices, fastest first; --out FILE writes the fastest that fits\n"
    "  as KEY=VALUE lines: mpirun -np N flowrun FILE $(cat FILE).\n"
    "  --device-memory  per device (80GB, 24GiB; default: this machine's available memory / N)\n"
    "  --gpus-per-node  devices a node (default N: one machine); groups within a node use intra\n"
    "  --bandwidth, --latency  the links (default intra 5 GB/s and 10 us: MPI between processes on\n"
    "                   one machine; inter 1.25 GB/s and 50 us)\n"
    "  --global-batch   rows a step over every replica (default N x the graph's batch: what dp N trains)\n";

// The nodes the plan reads and overrides, found from forward_backward's inputs.
struct Roles {
  std::string fb, model, zero, data, model_type;
  int64_t batch = 0;  // the data node's rows a step
  bool whole_tensors = false;  // the optimizer's rule needs whole tensors a rank (Adafactor): ZeRO cuts at tensors
  std::vector<int64_t> split_sizes;  // the model's sizes tensor parallel must divide (heads, ...)
};

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
  for (const char* k : {"heads", "dec_heads", "mlp_dim", "dec_mlp_dim"})
    if (model->params[k] && model->params[k].IsScalar()) r.split_sizes.push_back(model->params[k].as<int64_t>());
  if (model->type == "gpt" && model->params["vocab"]) r.split_sizes.push_back(model->params["vocab"].as<int64_t>());
  // The batch's rows: the first node up forward_backward's batch input with a `batch` parameter.
  std::string at = ref(*fb, "batch");
  for (int hops = 0; hops < 8 && !at.empty(); ++hops) {
    const NodeSpec* n = node_named(g, at);
    if (!n) break;
    if (n->params["batch"] && n->params["batch"].IsScalar()) {
      r.data = n->name;
      r.batch = n->params["batch"].as<int64_t>();
      break;
    }
    at = n->inputs.empty() || n->inputs.front().refs.empty() ? std::string() : n->inputs.front().refs.front().node;
  }
  if (r.data.empty())
    throw std::runtime_error(g.file + ": found no node with a `batch` parameter up forward_backward '" + r.fb +
                             "''s batch input: the plan sets the rows a replica reads there");
  for (const NodeSpec& n : g.nodes)
    if (n.type == "optimizer" && n.params["kind"]) {
      const std::string kind = n.params["kind"].as<std::string>();
      const std::string settings = n.params[kind] ? YAML::Dump(n.params[kind]) : "{}";
      r.whole_tensors = r.whole_tensors || !make_update_rule(kind, settings)->elementwise();
    }
  return r;
}

// ---- 1. the profile

struct Profile {
  cost::Model model;
  bool splits = false;  // the family splits over tp and cuts into pipeline stages (gpt, dit, cappa)
  bool frozen = false;  // some parameters are frozen (LoRA): no pipeline stages
};

json block_json(const cost::Block& b) {
  return {{"fwd_s", b.fwd_s}, {"bwd_s", b.bwd_s}, {"params", b.params}, {"split", b.split},
          {"activation_bytes", b.activation_bytes}, {"output_bytes", b.output_bytes}};
}
cost::Block block_of(const json& j) {
  cost::Block b;
  b.fwd_s = j.at("fwd_s"), b.bwd_s = j.at("bwd_s"), b.params = j.at("params"), b.split = j.at("split");
  b.activation_bytes = j.at("activation_bytes"), b.output_bytes = j.at("output_bytes");
  return b;
}

json profile_json(const Profile& p) {
  const cost::Model& m = p.model;
  json blocks = json::array();
  for (const auto& b : m.blocks) blocks.push_back(block_json(b));
  return {{"rows", m.rows}, {"blocks", blocks}, {"first", block_json(m.first)}, {"last", block_json(m.last)},
          {"tied", m.tied}, {"weight_bytes", m.weight_bytes}, {"grad_bytes", m.grad_bytes},
          {"optimizer_bytes", m.optimizer_bytes}, {"ema_bytes", m.ema_bytes},
          {"update_s_per_param", m.update_s_per_param}, {"other_s", m.other_s}, {"splits", p.splits},
          {"frozen", p.frozen}};
}
Profile profile_of(const json& j) {
  Profile p;
  cost::Model& m = p.model;
  m.rows = j.at("rows");
  for (const auto& b : j.at("blocks")) m.blocks.push_back(block_of(b));
  m.first = block_of(j.at("first")), m.last = block_of(j.at("last"));
  m.tied = j.at("tied"), m.weight_bytes = j.at("weight_bytes"), m.grad_bytes = j.at("grad_bytes");
  m.optimizer_bytes = j.at("optimizer_bytes"), m.ema_bytes = j.at("ema_bytes");
  m.update_s_per_param = j.at("update_s_per_param"), m.other_s = j.at("other_s");
  p.splits = j.at("splits"), p.frozen = j.at("frozen");
  return p;
}

// Means of the profile run's trace over its steps after the first (the warm-up).
struct Timings {
  std::map<std::string, double> node_s;  // node name -> seconds a step
  std::vector<double> fwd_s, bwd_s;       // per block
  double first_fwd_s = 0, first_bwd_s = 0, last_s = 0;  // around the blocks, inside forward_backward
  double period_s = 0;  // from one forward_backward's start to the next one's: the step on its critical path
};

Timings read_timings(const std::string& trace, const std::string& fb, size_t blocks) {
  std::ifstream in(trace);
  if (!in) throw std::runtime_error("plan: the profile run wrote no trace " + trace);
  const json j = json::parse(in);
  struct Step {
    std::map<std::string, double> node_s;
    double fb_start = 0, fb_end = 0;
    std::map<size_t, std::pair<double, double>> fwd, bwd;  // block -> (start, end), µs
  };
  std::map<int64_t, Step> steps;
  const std::string mark = fb + ": block ";
  for (const auto& e : j.at("traceEvents")) {
    if (e.value("ph", "") != "X") continue;
    const int64_t step = e["args"].value("step", int64_t{-1});
    if (step < 2) continue;  // step 1: the warm-up
    Step& s = steps[step];
    const double ts = e.value("ts", 0.0), dur = e.value("dur", 0.0);
    const std::string name = e.value("name", ""), cat = e.value("cat", "");
    if (cat == "mark") {
      if (name.rfind(mark, 0) != 0) continue;
      std::istringstream rest(name.substr(mark.size()));
      size_t i = 0;
      std::string what;
      rest >> i >> what;
      auto& span = (what == "forward" ? s.fwd : s.bwd)[i];
      if (span.second == 0) span = {ts, ts + dur};  // the first: one micro-batch
      continue;
    }
    s.node_s[name] += dur * 1e-6;
    if (name == fb) s.fb_start = ts, s.fb_end = ts + dur;
  }
  if (steps.size() < 2) throw std::runtime_error("plan: the profile run's trace holds fewer than 2 steps after the first");
  Timings t;
  t.fwd_s.assign(blocks, 0.0), t.bwd_s.assign(blocks, 0.0);
  const double n = static_cast<double>(steps.size());
  t.period_s = (steps.rbegin()->second.fb_start - steps.begin()->second.fb_start) * 1e-6 / (n - 1);
  for (auto& [step, s] : steps) {
    if (s.fwd.size() != blocks || s.bwd.size() != blocks)
      throw std::runtime_error("plan: step " + std::to_string(step) + " of the profile timed " + std::to_string(s.fwd.size()) +
                               " block forwards and " + std::to_string(s.bwd.size()) + " backwards of the model's " +
                               std::to_string(blocks) + " blocks");
    for (size_t i = 0; i < blocks; ++i) {
      t.fwd_s[i] += (s.fwd[i].second - s.fwd[i].first) * 1e-6 / n;
      t.bwd_s[i] += (s.bwd[i].second - s.bwd[i].first) * 1e-6 / n;
    }
    // Before the first block: the embeddings (and the objective's own work on the batch); after
    // the last block's forward until its backward starts: the head, the loss and their backward;
    // after the first block's backward: the embeddings' backward.
    t.first_fwd_s += std::max(0.0, s.fwd[0].first - s.fb_start) * 1e-6 / n;
    t.last_s += std::max(0.0, s.bwd[blocks - 1].first - s.fwd[blocks - 1].second) * 1e-6 / n;
    t.first_bwd_s += std::max(0.0, s.fb_end - s.bwd[0].second) * 1e-6 / n;
    for (const auto& [name, sec] : s.node_s) t.node_s[name] += sec / n;
  }
  return t;
}

// The parameters of each block (blocks_of's order), and of the layers before and after them; the
// share of each block's parameters tensor parallel splits.
void count_parameters(const ModelState& m, cost::Model& out) {
  const std::vector<const torch::nn::Module*> blocks = blocks_of(*m.module);
  std::map<const c10::TensorImpl*, size_t> owner;
  for (size_t i = 0; i < blocks.size(); ++i)
    for (const auto& t : blocks[i]->parameters(true)) owner[t.unsafeGetTensorImpl()] = i;
  out.blocks.assign(blocks.size(), cost::Block{});
  std::vector<double> split(blocks.size(), 0.0);
  bool seen_block = false;
  for (const auto& [name, t] : m.named_parameters()) {
    const double n = static_cast<double>(t.numel());
    auto it = owner.find(t.unsafeGetTensorImpl());
    if (it == owner.end()) {
      (seen_block ? out.last : out.first).params += n;
      continue;
    }
    seen_block = true;
    out.blocks[it->second].params += n;
    if (m.splits_over_tp && m.splits_over_tp(name)) split[it->second] += n;
  }
  for (size_t i = 0; i < blocks.size(); ++i) out.blocks[i].split = out.blocks[i].params > 0 ? split[i] / out.blocks[i].params : 0.0;
}

Profile run_profile(const GraphSpec& user, const std::vector<std::string>& user_overrides, const Roles& r, int steps) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("flowrun-plan-" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(dir);
  struct Cleanup {  // the run's folder, and the log level, whatever happens
    std::string dir;
    spdlog::level::level_enum level = spdlog::get_level();
    ~Cleanup() {
      spdlog::set_level(level);
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } cleanup{dir};
  std::vector<std::string> o;
  for (const auto& x : user_overrides)
    if (x.rfind("run.parallel.", 0) != 0) o.push_back(x);  // one process profiles one replica
  for (const std::string& x :
       {"run.steps=" + std::to_string(steps), "run.out_dir=" + dir, "run.trace=" + dir + "/trace.json",
        std::string("run.resume=never"), std::string("run.progress=off"), std::string("run.log_every=1000000000"),
        std::string("run.profile=false"), r.fb + ".time_blocks=true", r.fb + ".accumulate=1"})
    o.push_back(x);
  const NodeSpec* model = node_named(user, r.model);
  if (model && model->params["checkpoint"]) o.push_back(r.model + ".checkpoint=none");
  if (!r.zero.empty()) o.push_back(r.zero + ".stage=none");
  for (const NodeSpec& n : user.nodes)  // evaluators, samplers, checkpoints: not part of a step's cost
    if (n.schedule.periodic() && n.schedule.every != 1) o.push_back(n.name + ".every=1000000000"), o.push_back(n.name + ".at=[]");
  GraphSpec g = load_graph(user.file, o, Registry::global());

  std::shared_ptr<ModelState> state;
  RunSession session(&g);
  session.on_setup = [&](Executor& ex) { state = ex.state(r.model, "params").as<std::shared_ptr<ModelState>>(); };
  spdlog::set_level(spdlog::level::warn);  // the run's own lines: not the plan's output
  int code = 0;
  if (auto end = session.start()) code = *end;
  else code = session.close(session.run());
  spdlog::set_level(cleanup.level);
  if (code != 0 || !state)
    throw std::runtime_error("plan: the profile run of " + user.file + " failed (exit " + std::to_string(code) +
                             "; its log above); run it alone with the same overrides to see why");

  Profile p;
  cost::Model& m = p.model;
  count_parameters(*state, m);
  if (m.blocks.empty())
    throw std::runtime_error("plan: model '" + r.model + "' (" + state->kind + ") has no blocks (ModuleLists) to place");
  const Timings t = read_timings(dir + "/trace.json", r.fb, m.blocks.size());
  const ModelState::Profiled& a = state->profiled;
  m.rows = static_cast<double>(a.rows > 0 ? a.rows : r.batch);
  const double nb = static_cast<double>(m.blocks.size());
  for (size_t i = 0; i < m.blocks.size(); ++i) {
    m.blocks[i].fwd_s = t.fwd_s[i], m.blocks[i].bwd_s = t.bwd_s[i];
    // The estimate's parts (models/activation_checkpoint.hpp): plain = the blocks' + the head's;
    // every block recomputed = the blocks' inputs + one block live + the head's.
    m.blocks[i].activation_bytes = a.recompute_live;
  }
  m.last.activation_bytes = std::max(0.0, a.plain - nb * a.recompute_live);
  for (auto& b : m.blocks) b.output_bytes = std::max(0.0, (a.checkpointed - a.recompute_live - m.last.activation_bytes) / nb);
  m.first.fwd_s = t.first_fwd_s, m.first.bwd_s = t.first_bwd_s;
  m.last.fwd_s = t.last_s / 3, m.last.bwd_s = 2 * t.last_s / 3;  // backward: two products for the forward's one
  m.tied = state->kind == "gpt";  // GPT's head is its token table (gpt_node.cpp: Stages::tied)
  // Bytes a parameter of what the optimizer and an EMA keep (their notes at setup), and their time.
  double params = m.params(), kept_opt = 0, kept_ema = 0, update = 0;
  for (const MemoryItem& k : state->kept) {
    const bool ema = k.what.find("EMA") != std::string::npos;
    (ema ? kept_ema : kept_opt) += k.bytes;
    auto it = t.node_s.find(k.node);
    if (it != t.node_s.end()) update += it->second;
  }
  m.optimizer_bytes = kept_opt / params, m.ema_bytes = kept_ema / params;
  m.update_s_per_param = update / params;
  double fb_s = t.node_s.count(r.fb) ? t.node_s.at(r.fb) : 0.0;
  m.other_s = std::max(0.0, t.period_s - fb_s - update);
  p.splits = static_cast<bool>(state->splits_over_tp);
  for (const auto& [name, tensor] : state->named_parameters()) p.frozen = p.frozen || !tensor.requires_grad();
  return p;
}

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

std::vector<std::string> overrides_of(const cost::Layout& l, const Roles& r, double global_rows) {
  std::vector<std::string> o{"run.parallel.tp=" + std::to_string(l.tp), "run.parallel.pp=" + std::to_string(l.pp)};
  if (l.pp > 1) {
    o.push_back("run.parallel.microbatches=" + std::to_string(l.microbatches));
    o.push_back(std::string("run.parallel.schedule=") + parallel::pipeline::name(l.schedule));
    if (l.virtual_stages > 1) o.push_back("run.parallel.virtual_stages=" + std::to_string(l.virtual_stages));
    o.push_back(r.fb + ".accumulate=1");
  } else {
    o.push_back(r.fb + ".accumulate=" + std::to_string(l.microbatches));
  }
  if (!r.zero.empty()) o.push_back(r.zero + ".stage=" + cost::name(l.zero));
  if (r.whole_tensors && (l.zero == cost::Zero::gradients || l.zero == cost::Zero::params)) o.push_back(r.zero + ".cut=tensors");
  o.push_back(r.model + ".checkpoint=" + std::string(l.checkpoint_every == 0 ? "none" : "blocks"));
  o.push_back(r.data + ".batch=" + std::to_string(static_cast<int64_t>(std::llround(global_rows / l.dp))));
  return o;
}

}  // namespace

int cmd_plan(const std::vector<std::string>& args) {
  if (wants_help(args)) return std::fputs(kPlanUsage, stdout), 0;
  std::map<std::string, std::string> opt;
  std::vector<std::string> rest;
  static const std::set<std::string> kValued{"--devices", "--gpus-per-node", "--device-memory", "--bandwidth", "--latency",
                                             "--global-batch", "--profile", "--save-profile", "--out", "--top"};
  for (size_t i = 0; i < args.size(); ++i) {
    if (kValued.count(args[i])) {
      if (i + 1 >= args.size()) return usage_error("plan", args[i] + " needs a value", kPlanUsage);
      opt[args[i]] = args[i + 1];
      ++i;
    } else {
      rest.push_back(args[i]);
    }
  }
  FileArgs f = split_args(rest);
  if (!f.error.empty()) return usage_error("plan", f.error, kPlanUsage);
  if (!f.flags.empty()) return usage_error("plan", "unknown option " + f.flags.front(), kPlanUsage);
  if (!opt.count("--devices")) return usage_error("plan", "--devices N is required (the devices to lay the run out on)", kPlanUsage);
  if (comm::size() > 1) return usage_error("plan", "runs as one process (it profiles one replica here); not under mpirun", kPlanUsage);
  cost::Cluster c;
  int top = 20;
  double global_rows = 0;
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
  } catch (const std::exception& e) {
    return usage_error("plan", e.what(), kPlanUsage);
  }
  GraphSpec g;
  if (!load(f.file, f.overrides, g)) return 2;
  try {
    const Roles r = roles_of(g);
    if (global_rows == 0) global_rows = static_cast<double>(r.batch) * c.devices;
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
      std::printf("profiling %s on this device (5 steps, one process)...\n", g.file.c_str());
      std::fflush(stdout);
      p = run_profile(g, f.overrides, r, 5);
      if (opt.count("--save-profile")) {
        std::ofstream out(opt.at("--save-profile"));
        out << profile_json(p).dump(2) << "\n";
        if (!out) throw std::runtime_error("--save-profile " + opt.at("--save-profile") + ": cannot write it");
      }
    }
    const cost::Model& m = p.model;
    double block_s = 0;
    for (const auto& b : m.blocks) block_s += b.fwd_s + b.bwd_s;
    std::printf("model '%s' (%s): %zu blocks, %.2fM parameters; at %.0f rows a step: blocks %.1f ms, embeddings %.1f ms, "
                "head and loss %.1f ms, update %.1f ms, the rest %.1f ms\n",
                r.model.c_str(), r.model_type.c_str(), m.blocks.size(), m.params() / 1e6, m.rows, block_s * 1e3,
                (m.first.fwd_s + m.first.bwd_s) * 1e3, (m.last.fwd_s + m.last.bwd_s) * 1e3,
                m.update_s_per_param * m.params() * 1e3, m.other_s * 1e3);

    // The layouts this graph can express.
    int max_tp = 1;
    if (p.splits)
      for (int t = 2; t <= c.devices; t *= 2) {
        bool ok = true;
        for (int64_t size : r.split_sizes) ok = ok && size % t == 0;
        if (!ok) break;
        max_tp = t;
      }
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
      return std::make_tuple(l.tp * l.pp, static_cast<int>(l.zero), l.checkpoint_every, l.microbatches, l.virtual_stages);
    };
    std::stable_sort(ranked.begin(), ranked.end(), [&](const auto& a, const auto& b) {
      if (a.second.fits != b.second.fits) return a.second.fits;
      const double ta = a.second.step_s, tb = b.second.step_s;
      if (std::abs(ta - tb) > 0.01 * std::min(ta, tb)) return ta < tb;
      return simpler(a.first) < simpler(b.first);
    });
    std::printf("%d devices (%d a node), %s each; links intra %.2f GB/s %.0f us, inter %.2f GB/s %.0f us; %.0f rows a step\n",
                c.devices, c.per_node, bytes_text(c.memory_bytes).c_str(), c.intra.bytes_per_s / 1e9, c.intra.latency_s * 1e6,
                c.inter.bytes_per_s / 1e9, c.inter.latency_s * 1e6, global_rows);
    std::printf("%4s  %-62s %9s %10s %10s  %-60s %7s %7s\n", "rank", "layout", "step s", "rows/s", "rows/s/dev",
                "memory a device = weights + grads + optimizer + ema + activations", "bubble", "comm");
    int shown = 0;
    for (const auto& [l, pr] : ranked) {
      if (shown++ >= top) break;
      const cost::Memory& mem = pr.memory;
      std::printf("%4d  %-62s %9.4f %10.1f %10.1f  %-60s %6.1f%% %6.1f%%%s\n", shown, l.str().c_str(), pr.step_s,
                  global_rows / pr.step_s, global_rows / pr.step_s / c.devices,
                  (bytes_text(mem.total()) + " = " + bytes_text(mem.weights) + " + " + bytes_text(mem.gradients) + " + " +
                   bytes_text(mem.optimizer) + " + " + bytes_text(mem.ema) + " + " + bytes_text(mem.activations))
                      .c_str(),
                  100 * pr.bubble, pr.step_s > 0 ? 100 * pr.comm_s / pr.step_s : 0.0, pr.fits ? "" : "  does not fit");
    }
    const auto best = std::find_if(ranked.begin(), ranked.end(), [](const auto& x) { return x.second.fits; });
    if (best == ranked.end()) {
      std::printf("no layout of %d devices fits %s a device; more devices, or a smaller model or batch\n", c.devices,
                  bytes_text(c.memory_bytes).c_str());
      return 1;
    }
    const std::vector<std::string> lines = overrides_of(best->first, r, global_rows);
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
