// flowrun plan, 1. the profile (plan.hpp): the graph runs a few steps here, one process, as one
// replica would (tp = pp = 1, no ZeRO, accumulate 1; its periodic nodes off), forward_backward
// timing each block (time_blocks) into a trace. What it measures, and how it stays within a
// minute and within memory for any model size (Galvatron profiles per layer type likewise):
//   - a few of the model's blocks (--profile-blocks, default 1: a family whose blocks are all
//     alike, Roles::blocks_param (gpt), is built with that many and no weights), the others taking the
//     times, parameters and activations of the last one measured (repeat_blocks);
//   - at 1, 2, 4, ... rows up to a replica's (the micro-batches the search makes: a small one
//     computes less efficiently), in rounds (medians), as many as the time budget allows
//     (--profile-seconds): each size predicted from the one before it, and not started past the
//     budget; above the largest size timed, the times grow with the rows (cost::Block's rule);
//   - checkpointed (a model with a `checkpoint` parameter) at the largest size, when the budget
//     leaves room: what a recompute adds to each block's backward; otherwise the forward's time.
// Each size prints a progress line with its estimate of the whole model's step. From the trace:
// each block's forward and backward seconds, the layers before the first block and after the last,
// the optimizer's and EMA's seconds a parameter, the rest of the step (data, frozen encoders);
// from the model (read after setup): each block's parameters (frozen or not) and the share tensor
// parallel splits, forward_backward's activation estimates and the tokens each block sees (FLOPs).
// On a CPU the devices of a node are processes sharing its cores: the profile runs with a rank's
// threads beside threads computing as the node's other devices (Neighbours). The first stop
// signal ends it (RunSession::exit_on_signal); a folder a killed plan left is removed by the next.
#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include <signal.h>
#include <unistd.h>

#include "plan.hpp"
#include "common/memory.hpp"
#include "executor.hpp"
#include "models/activation_checkpoint.hpp"
#include "models/model_state.hpp"
#include "registry.hpp"
#include "run_session.hpp"
#include "train/forward_backward.hpp"

namespace flowrun::cli::plan {

namespace cost = parallel::cost;
using nlohmann::json;

namespace {

// The profile runs' folder for process `pid`, and the removal of those whose process is gone.
std::string profile_dir(int pid) {
  return (std::filesystem::temp_directory_path() / ("flowrun-plan-" + std::to_string(pid))).string();
}
void remove_stale_profile_dirs() {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(std::filesystem::temp_directory_path(), ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("flowrun-plan-", 0) != 0) continue;
    const std::string digits = n.substr(13);
    if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 9) continue;
    const int pid = std::stoi(digits);
    if (pid != ::getpid() && ::kill(pid, 0) != 0 && errno == ESRCH) std::filesystem::remove_all(e.path(), ec);
  }
}

json block_json(const cost::Block& b) {
  return {{"fwd_s", b.fwd_s}, {"bwd_s", b.bwd_s}, {"fwd0_s", b.fwd0_s}, {"bwd0_s", b.bwd0_s}, {"fwd_at", b.fwd_at},
          {"bwd_at", b.bwd_at}, {"rec_s", b.rec_s}, {"rec0_s", b.rec0_s}, {"rec_at", b.rec_at}, {"params", b.params}, {"frozen", b.frozen}, {"split", b.split}, {"activation_bytes", b.activation_bytes}, {"output_bytes", b.output_bytes},
          {"experts", b.experts}, {"routed_bytes", b.routed_bytes}};
}
cost::Block block_of(const json& j) {
  cost::Block b;
  b.fwd_s = j.at("fwd_s"), b.bwd_s = j.at("bwd_s"), b.params = j.at("params"), b.split = j.at("split");
  b.fwd0_s = j.value("fwd0_s", 0.0), b.bwd0_s = j.value("bwd0_s", 0.0), b.frozen = j.value("frozen", 0.0);
  b.fwd_at = j.value("fwd_at", std::vector<double>{}), b.bwd_at = j.value("bwd_at", std::vector<double>{});
  b.rec_s = j.value("rec_s", -1.0), b.rec0_s = j.value("rec0_s", 0.0), b.rec_at = j.value("rec_at", std::vector<double>{});
  b.activation_bytes = j.at("activation_bytes"), b.output_bytes = j.at("output_bytes");
  b.experts = j.value("experts", 0.0), b.routed_bytes = j.value("routed_bytes", 0.0);
  return b;
}

}  // namespace

json profile_json(const Profile& p) {
  const cost::Model& m = p.model;
  json blocks = json::array();
  for (const auto& b : m.blocks) blocks.push_back(block_json(b));
  return {{"rows", m.rows}, {"blocks", blocks}, {"first", block_json(m.first)}, {"last", block_json(m.last)},
          {"tied", m.tied}, {"weight_bytes", m.weight_bytes}, {"grad_bytes", m.grad_bytes},
          {"optimizer_bytes", m.optimizer_bytes}, {"ema_bytes", m.ema_bytes},
          {"update_s_per_param", m.update_s_per_param}, {"other_s", m.other_s},
          {"sizes", m.sizes}, {"other_at", m.other_at},
          {"flops_per_row", m.flops_per_row}, {"tokens_per_row", p.tokens_per_row}, {"threads", p.threads}, {"experts", m.experts},
          {"nodes", p.nodes}, {"splits", p.splits}, {"frozen", p.frozen}, {"profiled_blocks", p.profiled_blocks}};
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
  m.experts = j.value("experts", 0);
  p.tokens_per_row = j.value("tokens_per_row", 0.0), p.threads = j.value("threads", 0);
  p.nodes = j.value("nodes", std::map<std::string, double>{});
  p.splits = j.at("splits"), p.frozen = j.at("frozen");
  p.profiled_blocks = j.value("profiled_blocks", 0);
  return p;
}

namespace {

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
  std::vector<double> split(blocks.size(), 0.0), experts(blocks.size(), 0.0);
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
    if (m.is_expert && m.is_expert(name)) experts[it->second] += n;
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    const double all = out.blocks[i].params;
    out.blocks[i].split = all > 0 ? split[i] / all : 0.0;
    out.blocks[i].experts = all > 0 ? experts[i] / all : 0.0;
  }
  out.experts = static_cast<int>(m.experts);
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
// `blocks` > 0: the model built with that many of its blocks (Roles::blocks_param) and no
// weights loaded (the times do not depend on the values).
Profile run_profile(const GraphSpec& user, const std::vector<std::string>& user_overrides, const Roles& r, int steps,
                    int warm, int64_t rows, int threads, int64_t blocks, bool checkpointed = false) {
  const std::string dir = profile_dir(::getpid());
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
  for (const std::string& b : r.batch_overrides(static_cast<double>(rows))) o.push_back(b);
  if (threads > 0) o.push_back("run.threads=" + std::to_string(threads));
  const NodeSpec* model = node_named(user, r.model);
  if (blocks > 0) {
    o.push_back(r.model + "." + r.blocks_param + "=" + std::to_string(blocks));
    for (const char* from : {"weights", "pretrained"})
      if (model && model->params[from] && !model->params[from].IsNull()) o.push_back(r.model + "." + from + "=null");
  }
  if (model && model->params["checkpoint"]) o.push_back(r.model + ".checkpoint=" + (checkpointed ? "blocks" : "none"));
  if (!r.zero.empty()) o.push_back(r.zero + ".stage=none");
  for (const NodeSpec& n : user.nodes)  // evaluators, samplers, checkpoints: not part of a step's cost
    if (n.schedule.periodic() && n.schedule.every != 1) o.push_back(n.name + ".every=1000000000"), o.push_back(n.name + ".at=[]");
  GraphSpec g = load_graph(user.file, o, Registry::global());

  std::shared_ptr<ModelState> state;
  RunSession session(&g);
  std::shared_ptr<StepProfile> step;  // forward_backward's `profile` state: what its first step estimated
  session.on_setup = [&](Executor& ex) {
    state = ex.state(r.model, "params").as<std::shared_ptr<ModelState>>();
    step = ex.state(r.fb, "profile").as<std::shared_ptr<StepProfile>>();
  };
  session.exit_on_signal = true;  // a profile stopped halfway is worth nothing: the first signal ends the plan
  // The run's own lines are not the plan's output (nor its warnings of a cut model without weights).
  spdlog::set_level(blocks > 0 ? spdlog::level::err : spdlog::level::warn);
  int code = 0;
  if (auto end = session.start()) code = *end;
  else code = session.close(session.run());
  spdlog::set_level(cleanup.level);
  if (code != 0 || !state || !step)
    throw std::runtime_error("plan: the profile run of " + user.file + " failed (exit " + std::to_string(code) +
                             "; its log above); run it alone with the same overrides to see why");

  Profile p;
  cost::Model& m = p.model;
  count_parameters(*state, m);
  if (m.blocks.empty())
    throw std::runtime_error("plan: model '" + r.model + "' (" + state->kind + ") has no blocks (ModuleLists) to place");
  const Timings t = read_timings(dir + "/trace.json", r.fb, m.blocks.size(), warm);
  const StepProfile& a = *step;
  m.rows = static_cast<double>(a.rows > 0 ? a.rows : r.batch);
  const double nb = static_cast<double>(m.blocks.size());
  for (size_t i = 0; i < m.blocks.size(); ++i) {
    m.blocks[i].fwd_s = t.fwd_s[i], m.blocks[i].bwd_s = t.bwd_s[i];
    // The estimate's parts (models/activation_checkpoint.hpp): plain = the blocks' + the head's;
    // every block recomputed = the blocks' inputs + one block live + the head's.
    m.blocks[i].activation_bytes = a.blocks.recompute_live;
  }
  m.last.activation_bytes = std::max(0.0, a.plain.plain - nb * a.blocks.recompute_live);
  for (auto& b : m.blocks) {
    b.output_bytes = std::max(0.0, (a.blocks.checkpointed - a.blocks.recompute_live - m.last.activation_bytes) / nb);
    // A sparse layer sends each token's row to its top_k experts (expert parallel's all-to-alls).
    if (b.experts > 0) b.routed_bytes = b.output_bytes * static_cast<double>(state->top_k);
  }
  m.first.fwd_s = t.first_fwd_s, m.first.bwd_s = t.first_bwd_s;
  m.last.fwd_s = t.last_s / 3, m.last.bwd_s = 2 * t.last_s / 3;  // backward: two products for the forward's one
  m.tied = !state->tied.empty();  // the head is the token table (the family's declaration: GPT's, a tied Llama's)
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
    double flops = a.plain.attention_flops;  // all in the blocks: a cut model's repeat with them (repeat_blocks)
    for (size_t i = 0; i < m.blocks.size(); ++i) flops += 6 * m.blocks[i].params * tokens[i];
    p.block_flops_per_row = (a.plain.attention_flops / nb + 6 * m.blocks.back().params * tokens.back()) / static_cast<double>(a.rows);
    flops += 6 * (m.tied ? m.first.params : m.last.params) * tokens.back();
    m.flops_per_row = flops / static_cast<double>(a.rows);
    p.tokens_per_row = tokens.front() / static_cast<double>(a.rows);
  }
  p.threads = threads;
  p.splits = static_cast<bool>(state->splits_over_tp);
  p.frozen = m.trained() < m.params();
  return p;
}

// The cut model's profile as the whole model's: blocks [K, L) repeat the last one measured (its
// times along the sizes, parameters, activations), and the FLOPs a row grow with them.
void repeat_blocks(Profile& p, int64_t whole) {
  cost::Model& m = p.model;
  const int64_t k = static_cast<int64_t>(m.blocks.size());
  if (k == 0 || whole <= k) return;
  m.flops_per_row += static_cast<double>(whole - k) * p.block_flops_per_row;
  m.blocks.resize(static_cast<size_t>(whole), m.blocks.back());
  p.profiled_blocks = static_cast<int>(k);
}

// One replica's step on one device, as the profile predicts it at `rows` rows (the progress
// lines: what the sizes measured so far say of the whole model).
double step_estimate(const cost::Model& m, double rows) {
  double s = 0;
  for (const auto& b : m.blocks) s += b.fwd_s + b.bwd_s;
  s += m.first.fwd_s + m.first.bwd_s + m.last.fwd_s + m.last.bwd_s + m.other_s;
  return s * rows / m.rows + m.update_s_per_param * m.trained();
}

}  // namespace

Profile profile_here(const GraphSpec& g, const std::vector<std::string>& overrides, const Roles& r,
                     const ProfileRequest& q) {
  using Clock = std::chrono::steady_clock;
  const auto since = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  constexpr int kSteps = 3, kWarm = 1;  // 2 timed steps (medians); the first: allocations, first-use caches, GEMM verdicts
  remove_stale_profile_dirs();
  const bool cut = q.blocks > 0 && !r.blocks_param.empty() && r.blocks > q.blocks;
  const int64_t blocks = cut ? q.blocks : 0;
  const NodeSpec* model = node_named(g, r.model);
  const bool checkpoints = model && model->params["checkpoint"];
  std::printf("profiling %s here, one process: %s, up to %d round%s of %d steps at 1, 2, 4, ... rows up to %lld, as %.0f s "
              "allow%s...\n",
              g.file.c_str(),
              cut ? fmt::format("{} of model '{}''s {} blocks (the others alike: their times repeated)", blocks, r.model,
                                r.blocks).c_str()
                  : fmt::format("model '{}' whole", r.model).c_str(),
              q.rounds, q.rounds == 1 ? "" : "s", kSteps, static_cast<long long>(q.rows), q.seconds,
              q.cores > 0 ? (", " + std::to_string(q.threads) + " thread" + (q.threads == 1 ? "" : "s") + " (a rank's share of " +
                             std::to_string(q.cores) + " cores" +
                             (q.neighbours > 0 ? ") beside " + std::to_string(q.neighbours) + " more computing as the node's other devices"
                                               : std::string(")"))).c_str()
                           : "");
  std::fflush(stdout);
  std::optional<Neighbours> node;
  if (q.neighbours > 0) node.emplace(q.neighbours, q.threads);
  const auto t0 = Clock::now();
  std::vector<std::vector<Profile>> runs;  // by size, ascending
  double last_run_s = 0;  // the wall time of the last run (setup included)
  int64_t last_size = 0;  // the rows of the last run: after the loop, the largest size timed
  for (int64_t s = 1;; s = std::min(q.rows, s * 2)) {
    std::vector<Profile> rounds;
    for (int round = 0; round < q.rounds; ++round) {
      // This run's time, predicted from the last one's (in proportion to the rows: setup too).
      const double predicted = last_size > 0 ? last_run_s * static_cast<double>(s) / static_cast<double>(last_size) : 0;
      if (last_size > 0 && since(t0) + predicted > q.seconds) break;
      const auto r0 = Clock::now();
      rounds.push_back(run_profile(g, overrides, r, kSteps, kWarm, s, q.threads, blocks));
      last_run_s = since(r0), last_size = s;
    }
    if (rounds.empty()) break;
    runs.push_back(std::move(rounds));
    Profile now = median_of(runs.back());
    repeat_blocks(now, r.blocks);
    std::printf("  %lld row%s: %zu round%s, %.3g s a step of the %s model; the whole model's step on one device about "
                "%.3g s here, %.3g s at a replica's %lld rows (%.1f s so far)\n",
                static_cast<long long>(s), s == 1 ? "" : "s", runs.back().size(), runs.back().size() == 1 ? "" : "s",
                step_estimate(runs.back().front().model, static_cast<double>(s)), cut ? "cut" : "whole",
                step_estimate(now.model, static_cast<double>(s)), step_estimate(now.model, static_cast<double>(q.rows)),
                static_cast<long long>(q.rows), since(t0));
    std::fflush(stdout);
    if (s == q.rows || runs.back().size() < static_cast<size_t>(q.rounds)) break;
  }
  Profile p = median_of(runs.back());
  std::vector<Profile> smaller;
  for (size_t i = 0; i + 1 < runs.size(); ++i) smaller.push_back(median_of(runs[i]));
  add_sizes(p, smaller);
  for (auto& b : p.model.blocks) b.rec_s = -1, b.rec_at.clear();  // not measured: the forward's time
  // Checkpointed once, at the largest size, if the budget has room: what a recompute adds.
  if (checkpoints && since(t0) + last_run_s <= q.seconds) {
    const Profile ck = run_profile(g, overrides, r, kSteps, kWarm, last_size, q.threads, blocks, true);
    for (size_t b = 0; b < p.model.blocks.size(); ++b)
      p.model.blocks[b].rec_s = std::max(0.0, ck.model.blocks.at(b).bwd_s - p.model.blocks[b].bwd_s);
    std::printf("  checkpointed at %lld rows: recomputing adds %.3g s to a step of the %s model\n",
                static_cast<long long>(last_size),
                [&] { double s = 0; for (const auto& b : p.model.blocks) s += b.rec_s; return s; }(), cut ? "cut" : "whole");
  } else if (checkpoints) {
    std::printf("  checkpointing not timed (the budget is spent): a recompute is taken as the forward's time\n");
  }
  repeat_blocks(p, r.blocks);
  std::printf("profiled in %.1f s\n", since(t0));
  std::fflush(stdout);
  return p;
}

}  // namespace flowrun::cli::plan
