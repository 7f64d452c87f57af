// flowrun plan (issue 50; docs/parallel.md "Planning a layout"): the layouts of N devices for a
// graph, each predicted by the cost model (nodes/parallel/cost_model.hpp) from a profile of the
// graph's own model on this device, ranked; the best written as overrides. In order:
//
//   0. The links (`--measure-links`, under mpirun, no graph): each collective the steps use, timed
//      over groups of 2, 4, ... ranks and buffers of 4 KiB to 16 MiB, fitted to a line (latency
//      and bandwidth) per collective and group size, written as a file `--links` reads.
//   1. The profile: the graph runs a few steps here, one process, as one replica would (tp = pp =
//      1, no checkpointing, no ZeRO, accumulate 1; its periodic nodes off), forward_backward
//      timing each block (time_blocks) into a trace: at the replica's rows and at half, a quarter,
//      ... of them (the micro-batches the search makes: a small one computes less efficiently),
//      in rounds (medians), and again checkpointed (a model with a `checkpoint` parameter: what
//      a recompute adds to each block's backward). From the trace: each block's forward and
//      backward seconds, the layers
//      before the first block and after the last, the optimizer's and EMA's seconds a parameter,
//      the rest of the step (data, frozen encoders); from the model (read after setup): each
//      block's parameters (frozen or not) and the share tensor parallel splits, forward_backward's
//      activation estimates and the tokens each block sees (FLOPs). On a CPU the devices of a
//      node are processes sharing its cores: the profile runs with a rank's threads beside
//      threads computing as the node's other devices (Neighbours), and the cost model bounds a
//      node whose devices outnumber its cores by their work over the cores. `--save-profile FILE`
//      keeps it, `--profile FILE` reads one instead (bench/plan_at_scale.py writes them for H100s).
//   2. The search: every layout of the devices the graph can express (cost::layouts; tp dividing
//      the model's heads; ZeRO stages only with a zero node; pipeline stages only for the
//      families that cut, without LoRA), each predicted under the device memory.
//   3. The table, fastest first (the ones that do not fit after, saying why), and `--out FILE`:
//      the fastest that fits as KEY=VALUE lines (`mpirun -np N flowrun GRAPH $(cat FILE)`).
#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include <unistd.h>

#include "args.hpp"
#include "comm.hpp"
#include "commands.hpp"
#include "common/device.hpp"
#include "common/memory.hpp"
#include "executor.hpp"
#include "models/activation_checkpoint.hpp"
#include "models/model_state.hpp"
#include "parallel/collectives.hpp"
#include "parallel/cost_model.hpp"
#include "parallel/layout.hpp"
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
    "                    [--links FILE | --bandwidth intra=GB/s,inter=GB/s --latency intra=us,inter=us]\n"
    "                    [--global-batch ROWS] [--peak-tflops X] [--profile FILE | --save-profile FILE]\n"
    "                    [--profile-rounds R]\n"
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
    "  --profile-rounds each profile size run R times, the medians kept (default 3 on a CPU, 1 on a GPU)\n";

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
  r.split_sizes = parallel::tp_split_sizes(*model);
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

// ---- 0. the links

// Under mpirun: every collective the steps use (all-reduce: data and tensor parallel; all-gather,
// whose reduce-scatter twin moves as much: ZeRO; a send between two ranks: pipeline stages),
// timed over the world cut into groups of g consecutive ranks (each group at once, as a mesh's
// tp groups run), for g = 2, 4, ... dividing the world, and the world. Each size: one warm-up,
// then repetitions back to back; a rank's mean, the slowest rank's kept.
int measure_links(const std::string& out_file) {
  const int world = comm::size(), rank = comm::rank();
  if (world < 2) {
    std::fprintf(stderr, "flowrun plan --measure-links: runs under mpirun with 2 or more ranks (mpirun -np 2 flowrun plan "
                         "--measure-links --out links.json); this is a single process\n");
    return 2;
  }
  std::vector<int> sizes;
  for (int g = 2; g <= world; g *= 2)
    if (world % g == 0) sizes.push_back(g);
  if (sizes.empty() || sizes.back() != world) sizes.push_back(world);
  const std::vector<double> buffers{4096, 16384, 65536, 262144, 1048576, 4194304, 16777216};
  const auto all = parallel::Group::world("plan --measure-links");
  auto slowest = [&](double s) {
    auto t = torch::tensor({s}, torch::kFloat64);
    all->all_reduce(t, comm::Op::max, "the slowest rank's time").wait();
    return t.item<double>();
  };
  json out = {{"ranks", world}, {"all_reduce", json::object()}, {"all_gather", json::object()}, {"send", json::object()}};
  if (rank == 0) {
    std::printf("measuring the collectives of %d ranks: groups of", world);
    for (int g : sizes) std::printf(" %d", g);
    std::printf(" ranks, buffers of 4 KiB to 16 MiB\n%-11s %6s %12s %12s %10s\n", "collective", "ranks", "latency us",
                "GB/s", "worst fit");
    std::fflush(stdout);
  }
  auto report = [&](const char* kind, int g, const std::vector<std::pair<double, double>>& pts) {
    const auto [line, worst] = cost::fit_link(pts);
    json samples = json::array();
    for (const auto& [b, t] : pts) samples.push_back({b, t});
    out[kind][std::to_string(g)] = {{"latency_s", line.latency_s}, {"bytes_per_s", line.bytes_per_s}, {"samples", samples}};
    if (rank == 0) std::printf("%-11s %6d %12.1f %12.3f %9.0f%%\n", kind, g, line.latency_s * 1e6, line.bytes_per_s / 1e9, 100 * worst);
    std::fflush(stdout);
  };
  for (int g : sizes) {
    const parallel::Mesh mesh(world, g, 1);
    auto group = parallel::Group::along("plan --measure-links", mesh, parallel::Dim::tp, rank);
    std::vector<std::pair<double, double>> reduce, gather, sends;
    for (double bytes : buffers) {
      const int64_t n = static_cast<int64_t>(bytes / 4);
      const int reps = bytes <= 1048576 ? 20 : 5;
      auto t = torch::ones({n}, torch::kFloat32);
      std::vector<size_t> counts(static_cast<size_t>(g), static_cast<size_t>(n / g));
      counts.back() += static_cast<size_t>(n % g);
      auto time = [&](auto&& op) {
        op();  // warm-up
        slowest(0);  // every rank starts together
        const auto t0 = comm::Clock::now();
        for (int i = 0; i < reps; ++i) op();
        return slowest(std::chrono::duration<double>(comm::Clock::now() - t0).count() / reps);
      };
      reduce.emplace_back(bytes, time([&] { group->all_reduce(t, comm::Op::sum, "measure all-reduce").wait(); }));
      gather.emplace_back(bytes, time([&] { group->all_gather(t, counts, "measure all-gather").wait(); }));
      if (g == 2)  // one way: half a round trip
        sends.emplace_back(bytes, time([&] {
                             if (group->rank() == 0) {
                               group->send(t, 1, "measure send").wait();
                               group->recv(t, 1, "measure send").wait();
                             } else {
                               group->recv(t, 0, "measure send").wait();
                               group->send(t, 0, "measure send").wait();
                             }
                           }) / 2);
    }
    report("all_reduce", g, reduce);
    report("all_gather", g, gather);
    if (g == 2) report("send", g, sends);
  }
  if (rank == 0) {
    std::ofstream f(out_file);
    f << out.dump(2) << "\n";
    if (!f) {
      std::fprintf(stderr, "flowrun plan --measure-links: cannot write %s\n", out_file.c_str());
      return 2;
    }
    std::printf("written to %s: flowrun plan GRAPH --devices N --links %s\n", out_file.c_str(), out_file.c_str());
  }
  return 0;
}

void read_links(const std::string& file, cost::Cluster& c) {
  std::ifstream in(file);
  if (!in) throw std::runtime_error("--links " + file + ": cannot read it");
  try {
    const json j = json::parse(in);
    auto take = [&](const char* kind, std::map<int, cost::Cluster::Curve>& into) {
      for (const auto& [g, l] : j.at(kind).items()) {
        cost::Cluster::Curve& c = into[std::stoi(g)];
        c.fit = {l.at("latency_s"), l.at("bytes_per_s")};
        for (const auto& p : l.at("samples")) c.points.emplace_back(p.at(0), p.at(1));
        std::sort(c.points.begin(), c.points.end());
      }
    };
    take("all_reduce", c.measured.all_reduce);
    take("all_gather", c.measured.all_gather);
    take("send", c.measured.send);
  } catch (const std::exception& e) {
    throw std::runtime_error("--links " + file + ": not a file flowrun plan --measure-links wrote (" + e.what() + ")");
  }
}

// ---- 1. the profile

struct Profile {
  cost::Model model;
  bool splits = false;  // the family splits over tp and cuts into pipeline stages (gpt, dit, cappa)
  bool frozen = false;  // some parameters are frozen (LoRA): no pipeline stages
  double tokens_per_row = 0;  // what the first block sees of a row (0: not known)
  int threads = 0;            // the intra-op threads it ran with (0: not recorded)
  std::map<std::string, double> nodes;  // the other nodes' seconds a step (data, frozen encoders, metrics)
};

json block_json(const cost::Block& b) {
  return {{"fwd_s", b.fwd_s}, {"bwd_s", b.bwd_s}, {"fwd0_s", b.fwd0_s}, {"bwd0_s", b.bwd0_s}, {"fwd_at", b.fwd_at},
          {"bwd_at", b.bwd_at}, {"rec_s", b.rec_s}, {"rec0_s", b.rec0_s}, {"rec_at", b.rec_at}, {"params", b.params}, {"frozen", b.frozen}, {"split", b.split}, {"activation_bytes", b.activation_bytes}, {"output_bytes", b.output_bytes}};
}
cost::Block block_of(const json& j) {
  cost::Block b;
  b.fwd_s = j.at("fwd_s"), b.bwd_s = j.at("bwd_s"), b.params = j.at("params"), b.split = j.at("split");
  b.fwd0_s = j.value("fwd0_s", 0.0), b.bwd0_s = j.value("bwd0_s", 0.0), b.frozen = j.value("frozen", 0.0);
  b.fwd_at = j.value("fwd_at", std::vector<double>{}), b.bwd_at = j.value("bwd_at", std::vector<double>{});
  b.rec_s = j.value("rec_s", -1.0), b.rec0_s = j.value("rec0_s", 0.0), b.rec_at = j.value("rec_at", std::vector<double>{});
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
          {"update_s_per_param", m.update_s_per_param}, {"other_s", m.other_s},
          {"sizes", m.sizes}, {"other_at", m.other_at},
          {"flops_per_row", m.flops_per_row}, {"tokens_per_row", p.tokens_per_row}, {"threads", p.threads},
          {"nodes", p.nodes}, {"splits", p.splits}, {"frozen", p.frozen}};
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
  m.sizes = j.value("sizes", std::vector<double>{}), m.other_at = j.value("other_at", std::vector<double>{});
  m.flops_per_row = j.value("flops_per_row", 0.0);
  p.tokens_per_row = j.value("tokens_per_row", 0.0), p.threads = j.value("threads", 0);
  p.nodes = j.value("nodes", std::map<std::string, double>{});
  p.splits = j.at("splits"), p.frozen = j.at("frozen");
  return p;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Each time a profile's model holds: the blocks' forward, backward and recompute, the first and last
// layers', the rest of the step (with where its values along the sizes go), the update's.
struct TimeField {
  std::function<double&(cost::Model&)> at;
  std::function<std::vector<double>&(cost::Model&)> along;  // null: not measured along the sizes
};
std::vector<TimeField> time_fields(size_t blocks) {
  std::vector<TimeField> f;
  auto block = [&](std::function<cost::Block&(cost::Model&)> b) {
    f.push_back({[b](cost::Model& m) -> double& { return b(m).fwd_s; }, [b](cost::Model& m) -> auto& { return b(m).fwd_at; }});
    f.push_back({[b](cost::Model& m) -> double& { return b(m).bwd_s; }, [b](cost::Model& m) -> auto& { return b(m).bwd_at; }});
  };
  for (size_t i = 0; i < blocks; ++i) {
    block([i](cost::Model& m) -> cost::Block& { return m.blocks.at(i); });
    f.push_back({[i](cost::Model& m) -> double& { return m.blocks.at(i).rec_s; },
                 [i](cost::Model& m) -> auto& { return m.blocks.at(i).rec_at; }});
  }
  block([](cost::Model& m) -> cost::Block& { return m.first; });
  block([](cost::Model& m) -> cost::Block& { return m.last; });
  f.push_back({[](cost::Model& m) -> double& { return m.other_s; }, [](cost::Model& m) -> auto& { return m.other_at; }});
  f.push_back({[](cost::Model& m) -> double& { return m.update_s_per_param; }, nullptr});
  return f;
}

// Profiles of one size from several rounds: the first's, each time the median of the rounds'.
Profile median_of(std::vector<Profile> rounds) {
  Profile p = rounds.front();
  for (const TimeField& f : time_fields(p.model.blocks.size())) {
    std::vector<double> v;
    for (Profile& q : rounds) v.push_back(f.at(q.model));
    f.at(p.model) = median(v);
  }
  return p;
}

// The profile at the replica's rows `p` and at smaller micro-batches (ascending): each time
// along the sizes (cost::Block's rule: the line through the two measured sizes nearest).
void add_sizes(Profile& p, std::vector<Profile> smaller) {
  cost::Model& m = p.model;
  m.sizes.clear();
  for (const Profile& q : smaller) m.sizes.push_back(q.model.rows);
  m.sizes.push_back(m.rows);
  for (const TimeField& f : time_fields(m.blocks.size())) {
    if (!f.along) continue;
    std::vector<double>& v = f.along(m);
    v.clear();
    for (Profile& q : smaller) v.push_back(f.at(q.model));
    v.push_back(f.at(m));
  }
}

// Medians of the profile run's trace over its steps after the first `warm` (the warm-up:
// allocations, first-use caches); medians, so that one step slowed by the machine does not count.
struct Timings {
  std::map<std::string, double> node_s;  // node name -> seconds a step
  std::vector<double> fwd_s, bwd_s;       // per block
  double first_fwd_s = 0, first_bwd_s = 0, last_s = 0;  // around the blocks, inside forward_backward
  double period_s = 0;  // from one forward_backward's start to the next one's: the step on its critical path
};

Timings read_timings(const std::string& trace, const std::string& fb, size_t blocks, int64_t warm) {
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
    if (step <= warm) continue;
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
  if (steps.size() < 2)
    throw std::runtime_error("plan: the profile run's trace holds fewer than 2 steps after the first " + std::to_string(warm));
  std::vector<std::vector<double>> fwd(blocks), bwd(blocks);
  std::vector<double> first_fwd, first_bwd, last, period;
  std::map<std::string, std::vector<double>> node;
  double previous_start = -1;
  for (auto& [step, s] : steps) {
    if (s.fwd.size() != blocks || s.bwd.size() != blocks)
      throw std::runtime_error("plan: step " + std::to_string(step) + " of the profile timed " + std::to_string(s.fwd.size()) +
                               " block forwards and " + std::to_string(s.bwd.size()) + " backwards of the model's " +
                               std::to_string(blocks) + " blocks");
    for (size_t i = 0; i < blocks; ++i) {
      fwd[i].push_back((s.fwd[i].second - s.fwd[i].first) * 1e-6);
      bwd[i].push_back((s.bwd[i].second - s.bwd[i].first) * 1e-6);
    }
    // Before the first block: the embeddings (and the objective's own work on the batch); after
    // the last block's forward until its backward starts: the head, the loss and their backward;
    // after the first block's backward: the embeddings' backward.
    first_fwd.push_back(std::max(0.0, s.fwd[0].first - s.fb_start) * 1e-6);
    last.push_back(std::max(0.0, s.bwd[blocks - 1].first - s.fwd[blocks - 1].second) * 1e-6);
    first_bwd.push_back(std::max(0.0, s.fb_end - s.bwd[0].second) * 1e-6);
    for (const auto& [name, sec] : s.node_s) node[name].push_back(sec);
    if (previous_start >= 0) period.push_back((s.fb_start - previous_start) * 1e-6);
    previous_start = s.fb_start;
  }
  Timings t;
  for (size_t i = 0; i < blocks; ++i) t.fwd_s.push_back(median(fwd[i])), t.bwd_s.push_back(median(bwd[i]));
  t.first_fwd_s = median(first_fwd), t.first_bwd_s = median(first_bwd), t.last_s = median(last);
  t.period_s = median(period);
  for (const auto& [name, v] : node) t.node_s[name] = median(v);
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
    const double n = static_cast<double>(t.numel()), frozen = t.requires_grad() ? 0.0 : n;
    auto it = owner.find(t.unsafeGetTensorImpl());
    if (it == owner.end()) {
      cost::Block& b = seen_block ? out.last : out.first;
      b.params += n, b.frozen += frozen;
      continue;
    }
    seen_block = true;
    out.blocks[it->second].params += n;
    out.blocks[it->second].frozen += frozen;
    if (m.splits_over_tp && m.splits_over_tp(name)) split[it->second] += n;
  }
  for (size_t i = 0; i < blocks.size(); ++i) out.blocks[i].split = out.blocks[i].params > 0 ? split[i] / out.blocks[i].params : 0.0;
}

// On a CPU a node's other devices are processes computing on its other cores (or on the same ones,
// oversubscribed). Alone, the profile's process would have the caches, the memory bandwidth and
// the cores to itself, and on this machine measures a rank of `mpirun -np 2` 1.3-1.4x too fast;
// so it runs beside the cores' other devices, each a thread with a rank's intra-op threads
// multiplying matrices until the profile ends (as many as keep the cores busy; more devices than
// that take turns, which the cost model bounds: Cluster::cores).
class Neighbours {
 public:
  Neighbours(int count, int threads) {
    for (int i = 0; i < count; ++i)
      workers_.emplace_back([this, threads] {
        at::set_num_threads(threads);
        const torch::Tensor a = torch::randn({512, 512});
        while (!stop_.load(std::memory_order_relaxed)) (void)at::mm(a, a);
      });
  }
  ~Neighbours() {
    stop_ = true;
    for (auto& t : workers_) t.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::vector<std::thread> workers_;
};

// One profile run at `rows` rows with `threads` intra-op threads (0: the run's default).
Profile run_profile(const GraphSpec& user, const std::vector<std::string>& user_overrides, const Roles& r, int steps,
                    int warm, int64_t rows, int threads, bool checkpointed = false) {
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
        std::string("run.profile=false"), r.fb + ".time_blocks=true", r.fb + ".accumulate=1",
        r.data + ".batch=" + std::to_string(rows)})
    o.push_back(x);
  if (threads > 0) o.push_back("run.threads=" + std::to_string(threads));
  const NodeSpec* model = node_named(user, r.model);
  if (model && model->params["checkpoint"]) o.push_back(r.model + ".checkpoint=" + (checkpointed ? "blocks" : "none"));
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
  const Timings t = read_timings(dir + "/trace.json", r.fb, m.blocks.size(), warm);
  const ModelState::Profiled& a = state->profiled;
  m.rows = static_cast<double>(a.rows > 0 ? a.rows : r.batch);
  const double nb = static_cast<double>(m.blocks.size());
  for (size_t i = 0; i < m.blocks.size(); ++i) {
    m.blocks[i].fwd_s = t.fwd_s[i], m.blocks[i].bwd_s = t.bwd_s[i];
    // The estimate's parts (models/activation_checkpoint.hpp): plain = the blocks' + the head's;
    // every block recomputed = the blocks' inputs + one block live + the head's.
    m.blocks[i].activation_bytes = a.blocks.recompute_live;
  }
  m.last.activation_bytes = std::max(0.0, a.plain.plain - nb * a.blocks.recompute_live);
  for (auto& b : m.blocks)
    b.output_bytes = std::max(0.0, (a.blocks.checkpointed - a.blocks.recompute_live - m.last.activation_bytes) / nb);
  m.first.fwd_s = t.first_fwd_s, m.first.bwd_s = t.first_bwd_s;
  m.last.fwd_s = t.last_s / 3, m.last.bwd_s = 2 * t.last_s / 3;  // backward: two products for the forward's one
  m.tied = state->kind == "gpt";  // GPT's head is its token table (gpt_node.cpp: Stages::tied)
  // Bytes a trained parameter of what the optimizer and an EMA keep (their notes at setup), and their time.
  double params = std::max(1.0, m.trained()), kept_opt = 0, kept_ema = 0, update = 0;
  std::set<std::string> updaters;
  for (const MemoryItem& k : state->kept) {
    const bool ema = k.what.find("EMA") != std::string::npos;
    (ema ? kept_ema : kept_opt) += k.bytes;
    if (!updaters.insert(k.node).second) continue;
    auto it = t.node_s.find(k.node);
    if (it != t.node_s.end()) update += it->second;
  }
  for (const auto& [name, sec] : t.node_s)  // the graph's nodes (not their stream items), a tenth of a ms or more
    if (name != r.fb && !updaters.count(name) && g.index_of(name) >= 0 && sec >= 1e-4) p.nodes[name] = sec;
  m.optimizer_bytes = kept_opt / params, m.ema_bytes = kept_ema / params;
  m.update_s_per_param = update / params;
  double fb_s = t.node_s.count(r.fb) ? t.node_s.at(r.fb) : 0.0;
  m.other_s = std::max(0.0, t.period_s - fb_s - update);
  // Model FLOPs a row: 6 x parameters x tokens for each block's products and the head's (GPT's
  // head is its token table), and the attention's (models/activation_checkpoint.hpp).
  const std::vector<double>& tokens = a.plain.block_tokens;
  if (tokens.size() == m.blocks.size() && a.rows > 0) {
    double flops = a.plain.attention_flops;
    for (size_t i = 0; i < m.blocks.size(); ++i) flops += 6 * m.blocks[i].params * tokens[i];
    flops += 6 * (m.tied ? m.first.params : m.last.params) * tokens.back();
    m.flops_per_row = flops / static_cast<double>(a.rows);
    p.tokens_per_row = tokens.front() / static_cast<double>(a.rows);
  }
  p.threads = threads;
  p.splits = static_cast<bool>(state->splits_over_tp);
  p.frozen = m.trained() < m.params();
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
  o.push_back(r.model + ".checkpoint=" + CheckpointPolicy{l.checkpoint_every}.str());
  o.push_back(r.data + ".batch=" + std::to_string(static_cast<int64_t>(std::llround(global_rows / l.dp))));
  return o;
}

}  // namespace

int cmd_plan(const std::vector<std::string>& args) {
  if (wants_help(args)) return std::fputs(kPlanUsage, stdout), 0;
  std::map<std::string, std::string> opt;
  std::vector<std::string> rest;
  static const std::set<std::string> kValued{"--devices", "--gpus-per-node", "--device-memory", "--bandwidth",
                                             "--latency", "--links", "--global-batch", "--peak-tflops", "--profile",
                                             "--save-profile", "--profile-rounds", "--out", "--table", "--top"};
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
  for (const char* profiling : {"--save-profile", "--profile-rounds"})
    if (opt.count("--profile") && opt.count(profiling))
      return usage_error("plan", std::string(profiling) + " belongs to a profile run here; --profile FILE reads one instead",
                         kPlanUsage);
  cost::Cluster c;
  int top = 20;
  double global_rows = 0, peak_flops = 0;
  int rounds = 0;  // profile rounds; 0: the device's default
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
      // One replica's rows, and the smaller micro-batches the search splits them into (halving,
      // down to one row, at most kSizes sizes; below the smallest, the line through the two smallest).
      constexpr int kSizes = 5, kSteps = 7, kWarm = 2;
      const int64_t rows = std::max<int64_t>(1, std::llround(global_rows / c.devices));
      std::vector<int64_t> sizes{rows};
      while (sizes.size() < kSizes && sizes.back() >= 2) sizes.push_back(sizes.back() / 2);
      std::string at;
      for (int64_t x : sizes) at += (at.empty() ? "" : ", ") + std::to_string(x);
      // The model's checkpointing (a `checkpoint` parameter): profiled with it too.
      const NodeSpec* model = node_named(g, r.model);
      const bool checkpoints = model && model->params["checkpoint"];
      std::printf("profiling %s on this device: %d steps at each of %s rows%s, %d round%s, one process%s...\n", g.file.c_str(),
                  kSteps, at.c_str(), checkpoints ? " (checkpointed and not)" : "", rounds, rounds == 1 ? "" : "s",
                  cpu ? (", " + std::to_string(threads) + " thread" + (threads == 1 ? "" : "s") + " (a rank's share of " +
                         std::to_string(cores) + " cores" +
                         (neighbours > 0 ? ") beside " + std::to_string(neighbours) + " more computing as the node's other devices"
                                         : std::string(")"))).c_str() : "");
      std::fflush(stdout);
      // Each round every size once, largest first; each size's times the median of its rounds.
      std::optional<Neighbours> node;
      if (neighbours > 0) node.emplace(neighbours, threads);
      std::vector<std::vector<Profile>> runs(sizes.size());
      for (int round = 0; round < rounds; ++round)
        for (size_t i = 0; i < sizes.size(); ++i) {
          Profile plain = run_profile(g, f.overrides, r, kSteps, kWarm, sizes[i], threads);
          if (checkpoints) {  // and checkpointed: what a recompute adds to each block's backward
            const Profile ck = run_profile(g, f.overrides, r, kSteps, kWarm, sizes[i], threads, true);
            for (size_t b = 0; b < plain.model.blocks.size(); ++b)
              plain.model.blocks[b].rec_s = std::max(0.0, ck.model.blocks.at(b).bwd_s - plain.model.blocks[b].bwd_s);
          }
          runs[i].push_back(std::move(plain));
        }
      p = median_of(runs.front());
      std::vector<Profile> smaller;
      for (size_t i = sizes.size(); i-- > 1;) smaller.push_back(median_of(runs[i]));
      add_sizes(p, smaller);
      node.reset();
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
    std::printf("model '%s' (%s): %zu blocks, %.2fM parameters; at %.0f rows a step: blocks %.1f ms, embeddings %.1f ms, "
                "head and loss %.1f ms, update %.1f ms, the rest %.1f ms\n",
                r.model.c_str(), r.model_type.c_str(), m.blocks.size(), m.params() / 1e6, m.rows, block_s * 1e3,
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
      return std::make_tuple(l.tp * l.pp, static_cast<int>(l.zero), l.checkpoint_every, l.microbatches, l.virtual_stages);
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
        rows.push_back({{"layout", l.str()}, {"dp", l.dp}, {"tp", l.tp}, {"pp", l.pp}, {"zero", cost::name(l.zero)},
                        {"checkpoint_every", l.checkpoint_every}, {"microbatches", l.microbatches},
                        {"schedule", parallel::pipeline::name(l.schedule)}, {"virtual_stages", l.virtual_stages},
                        {"overrides", overrides_of(l, r, global_rows)}, {"step_s", pr.step_s}, {"compute_s", pr.compute_s},
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
