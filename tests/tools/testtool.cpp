// Helpers for the end-to-end shell tests (tests/mpi/mpi_test.sh):
//   (checkpoints are compared by tests/tools/tensordiff.cpp, which links no torch)
//   testtool trace-overlap TRACE.json PRODUCER CONSUMER
//       how many steps have a CONSUMER mark span ("CONSUMER: bucket ...") that starts before
//       the PRODUCER node's span of the same step ends; prints it, exit 1 if none
//   testtool pipeline-bubble NODE SCHEDULE M V TOL [--versus OTHER] TRACE_STAGE0.json TRACE_STAGE1.json ...
//       a pipeline's measured bubble against its schedule's prediction (parallel/pipeline_schedule.hpp):
//       from each stage's trace the NODE's operation marks ("NODE: F3.1"): every step, the stage's
//       program (its operations in order; exit 1 otherwise), and each stage's
//       idle share between its first operation's start and its last one's end (the median over
//       the steps after the first); the prediction times SCHEDULE's program with M micro-batches and
//       V virtual stages at each chunk's measured mean F, B and W times. Prints both per stage; exit
//       1 if any differs by more than TOL. With --versus, also OTHER's program at the same costs:
//       exit 1 unless SCHEDULE's first stage idles less (a comparison within one run: the stages'
//       speeds differ from run to run on a shared machine, and with them both schedules' bubbles)
//   mpirun -np N testtool mesh-groups TP PP
//       the mesh of N processes (nodes/parallel/mesh.hpp) as MPI channels, one per dimension
//       (comm::Channel::create_split): each channel's rank and size are the rank's coordinate and
//       the dimension's size, and an all-reduce, a reduce-scatter and an all-gather of uneven
//       blocks on it, and send/recv around its ring (two messages, in order), reach exactly the
//       group's members; prints one line per dimension on rank 0,
//       exit 1 on the first mismatch (naming rank, dimension and values)
//   mpirun -np N testtool tp-mlp TP
//       Megatron's column-then-row MLP over each tp group (parallel/tensor_parallel.hpp) against
//       the whole MLP computed on every rank: output, input gradient and each rank's weight
//       gradients (its blocks of the whole ones) within 1e-5 relative; exit 1 naming the first
//       that differs
//   mpirun -np N testtool gpt-tp TP
//       a tiny GPT (models/gpt/gpt.hpp) split over each tp group (Config::tp: heads, MLP units and the
//       vocabulary, scored by the vocabulary-parallel cross-entropy) against the whole model
//       computed on every rank, both from the same whole weights (the split one loads them as a
//       file's tensors, each rank taking its parts): the loss, and each rank's parameter
//       gradients (its parts of the whole model's; whole parameters whole) within 1e-5 of each
//       tensor's largest value, fp32 on the CPU; exit 1 naming the first that differs
//   mpirun -np N testtool dit-tp TP [lora]
//       the same for a tiny HunyuanDiT (models/dit/dit.hpp Config::tp: both attentions' heads and the
//       MLP's units) with both text streams (BERT-width states and T5 states with their pooler),
//       size and style conditioning, learned variance and long skips: the loss (mean square of
//       the output against a fixed target) and every parameter's gradient; with `lora`, LoRA
//       adapters (rank 4, B off zero) on split layers of both kinds and on a whole one
//       (lora.hpp: B by rows on column-split layers, A by columns on row-split ones), the
//       frozen base without gradients
//   mpirun -np N testtool cappa-tp TP
//       the same for a tiny CapPa (models/cappa/cappa.hpp Config::tp: the ViT's and the decoder's heads
//       and MLP units), half its rows decoded in parallel: the loss (cross-entropy of the logits)
//       and every parameter's gradient
//   mpirun -np N testtool CHECK + CHECK + ...
//       the checks above (mesh-groups, tp-mlp, gpt-tp, dit-tp, cappa-tp) one after the other in one
//       job, which starts MPI and libtorch once
//   testtool model-logits GRAPH TOKENS.safetensors OUT.safetensors [OVERRIDE ...]
//       the graph's nodes set up (no step run), then its `model` node's model in eval mode on
//       TOKENS's "tokens" (integer [B, T+1]) without gradients: its logits written to OUT as
//       "logits" (what tests/cli/hf_export_check.py compares with peft's)
//   testtool model-export GRAPH DIR [OVERRIDE ...]
//       the graph's nodes set up (no step run), then what its `model` node's model offers a
//       checkpoint's `exports` written to DIR (a gpt's HF folder: tests/cli/hf_export_check.py)
//   mpirun -np N testtool mesh-hang TP PP
//       rank 1 never joins its tp group's all-reduce (alive, silent); its partner's wait ends after
//       the collective timeout (2 s) and ends the whole job, every group's ranks included
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <tuple>

#include "comm.hpp"
#include "common/safetensors.hpp"
#include "executor.hpp"
#include "models/model_state.hpp"
#include "registry.hpp"
#include "spec.hpp"
#include "models/cappa/cappa.hpp"
#include "models/dit/dit.hpp"
#include "models/gpt/gpt.hpp"
#include "parallel/collectives.hpp"
#include "parallel/mesh.hpp"
#include "parallel/pipeline_schedule.hpp"
#include "parallel/tensor_parallel.hpp"

namespace {

int model_logits(const std::string& graph, const std::string& tokens, const std::string& out,
                 const std::vector<std::string>& overrides) {
  const flowrun::GraphSpec spec = flowrun::load_graph(graph, overrides, flowrun::Registry::global());
  flowrun::Executor ex(spec, flowrun::Registry::global(), flowrun::run_info(spec));  // every node's setup
  auto& model = *ex.state("model", "params").as<std::shared_ptr<flowrun::ModelState>>("model.params");
  model.module->eval();
  torch::NoGradGuard no_grad;
  const torch::Tensor ids = flowrun::safetensors::load(tokens).tensors.at("tokens").to(torch::kLong);
  flowrun::safetensors::save(out, {{"logits", model.forward({{"tokens", ids}}).contiguous()}});
  return 0;
}

int model_export(const std::string& graph, const std::string& dir, const std::vector<std::string>& overrides) {
  const flowrun::GraphSpec spec = flowrun::load_graph(graph, overrides, flowrun::Registry::global());
  flowrun::Executor ex(spec, flowrun::Registry::global(), flowrun::run_info(spec));  // every node's setup
  auto& model = *ex.state("model", "params").as<std::shared_ptr<flowrun::ModelState>>("model.params");
  if (!model.exporter) {
    std::fprintf(stderr, "model-export: the graph's model offers nothing to export\n");
    return 1;
  }
  model.exporter(model)(dir);
  return 0;
}

int trace_overlap(const std::string& file, const std::string& producer, const std::string& consumer) {
  std::ifstream in(file);
  nlohmann::json j = nlohmann::json::parse(in);
  std::map<int64_t, double> producer_end;
  std::map<int64_t, double> first_mark;
  for (const auto& e : j["traceEvents"]) {
    if (e.value("ph", "") != "X") continue;
    const std::string name = e.value("name", "");
    const int64_t step = e["args"].value("step", int64_t{-1});
    const double ts = e.value("ts", 0.0), dur = e.value("dur", 0.0);
    if (name == producer && e.value("cat", "") != "mark") producer_end[step] = ts + dur;
    if (name.rfind(consumer + ": bucket", 0) == 0) {
      auto it = first_mark.find(step);
      if (it == first_mark.end() || ts < it->second) first_mark[step] = ts;
    }
  }
  int overlapped = 0;
  for (const auto& [step, t] : first_mark) {
    auto it = producer_end.find(step);
    if (it != producer_end.end() && t < it->second) ++overlapped;
  }
  std::printf("%d of %zu steps: a '%s' bucket started before '%s' ended\n", overlapped, first_mark.size(),
              consumer.c_str(), producer.c_str());
  return overlapped > 0 ? 0 : 1;
}

int pipeline_bubble(const std::string& node, const std::string& kind, int mbs, int virtual_stages, double tol,
                    const std::string& versus, const std::vector<std::string>& traces) {
  namespace pl = flowrun::parallel::pipeline;
  pl::Config c = pl::Config::of(static_cast<int>(traces.size()), mbs, kind, virtual_stages);
  const int chunks = c.chunks();
  std::vector<double> sum[3], count[3];
  for (auto* v : {sum, count})
    for (int t = 0; t < 3; ++t) v[t].assign(static_cast<size_t>(chunks), 0.0);
  std::vector<double> measured;
  const std::regex op(node + R"(: ([FBW])(\d+)\.(\d+))");
  const pl::Schedule program = pl::make(c);  // what each stage runs, in order
  for (size_t r = 0; r < traces.size(); ++r) {
    const std::string& file = traces[r];
    std::ifstream in(file);
    const nlohmann::json j = nlohmann::json::parse(in);
    // step -> (start, end, name) of each op
    std::map<int64_t, std::vector<std::tuple<double, double, std::string>>> steps;
    for (const auto& e : j["traceEvents"]) {
      if (e.value("ph", "") != "X") continue;
      std::smatch m;
      const std::string name = e.value("name", "");
      if (!std::regex_match(name, m, op)) continue;
      const double ts = e.value("ts", 0.0), dur = e.value("dur", 0.0);
      const int64_t step = e["args"].value("step", int64_t{-1});
      steps[step].emplace_back(ts, ts + dur, name.substr(node.size() + 2));
      if (step == 1) continue;  // the first step's times include the warm-up
      const int t = m[1].str() == "F" ? 0 : m[1].str() == "B" ? 1 : 2;
      const auto k = static_cast<size_t>(std::stoi(m[3].str()));
      sum[t][k] += dur;
      count[t][k] += 1;
    }
    std::vector<double> idle;
    for (auto& [step, ops] : steps) {
      std::sort(ops.begin(), ops.end());
      // The stage ran its program: these operations in this order, every step.
      std::string ran, planned;
      for (const auto& o : ops) ran += " " + std::get<2>(o);
      for (const pl::Slot& slot : program.ranks.at(r)) planned += " " + pl::str(slot.op);
      if (ran != planned) {
        std::fprintf(stderr, "%s: step %lld ran%s\n  and the program is%s\n", file.c_str(), static_cast<long long>(step),
                     ran.c_str(), planned.c_str());
        return 1;
      }
      if (step == 1) continue;
      double busy = 0;
      for (const auto& o : ops) busy += std::get<1>(o) - std::get<0>(o);
      idle.push_back(1.0 - busy / (std::get<1>(ops.back()) - std::get<0>(ops.front())));
    }
    if (idle.empty()) {
      std::fprintf(stderr, "%s: no '%s: F...' marks after step 1\n", file.c_str(), node.c_str());
      return 1;
    }
    std::sort(idle.begin(), idle.end());
    measured.push_back(idle[idle.size() / 2]);
  }
  for (int t = 0; t < 3; ++t) {
    std::vector<double>& cost = t == 0 ? c.f : t == 1 ? c.b : c.w;
    for (int k = 0; k < chunks; ++k) {
      const auto i = static_cast<size_t>(k);
      cost.push_back(count[t][i] > 0 ? sum[t][i] / count[t][i] : 0.0);
    }
  }
  const pl::Schedule s = pl::make(c);
  int bad = 0;
  for (int r = 0; r < c.stages; ++r) {
    const double predicted = s.bubble(r), got = measured[static_cast<size_t>(r)];
    std::printf("%s M=%d stage %d: bubble measured %.1f %%, predicted %.1f %%\n", kind.c_str(), mbs, r, 100 * got,
                100 * predicted);
    if (std::abs(got - predicted) > tol) ++bad;
  }
  if (!versus.empty()) {
    // The other schedule's program at the same costs (its B the measured B + W).
    pl::Config o = c;
    o.kind = pl::parse_kind(versus);
    const double mine = s.bubble(0), theirs = pl::make(o).bubble(0);
    std::printf("at these costs %s's stage 0 would idle %.1f %%, %s's %.1f %%\n", versus.c_str(), 100 * theirs,
                kind.c_str(), 100 * mine);
    if (!(mine < theirs)) ++bad;
  }
  return bad ? 1 : 0;
}

// Rank r's value in element i of its block for q: distinct for every (r, q, i).
double value(int r, int q, size_t i) { return 1000.0 * r + 10.0 * q + static_cast<double>(i); }

int mesh_groups(int tp, int pp) {
  namespace comm = flowrun::comm;
  using flowrun::parallel::Dim;
  const flowrun::parallel::Mesh mesh(comm::size(), tp, pp);
  const int me = comm::rank();
  auto fail = [&](Dim d, const std::string& what) {
    std::fprintf(stderr, "rank %d, %s group: %s\n", me, flowrun::parallel::name(d), what.c_str());
    return 1;
  };
  for (Dim d : {Dim::tp, Dim::pp, Dim::dp}) {
    const std::vector<int> group = mesh.group(d, me);
    const int n = static_cast<int>(group.size());
    auto ch = comm::Channel::create_split(flowrun::parallel::name(d), mesh.color(d, me), mesh.at(mesh.coord(me), d),
                                           flowrun::parallel::name(d));
    if (ch->rank() != mesh.at(mesh.coord(me), d) || ch->size() != n)
      return fail(d, "channel rank " + std::to_string(ch->rank()) + " of " + std::to_string(ch->size()) +
                         ", expected " + std::to_string(mesh.at(mesh.coord(me), d)) + " of " + std::to_string(n));
    // All-reduce: the sum of the members' world ranks.
    double sum = me, want = 0;
    for (int r : group) want += r;
    ch->allreduce(&sum, 1, comm::DType::f64, comm::Op::sum, "sum of ranks").wait();
    if (sum != want) return fail(d, "all-reduce gave " + std::to_string(sum) + ", expected " + std::to_string(want));
    // Uneven blocks: member q's block holds q + 1 elements.
    std::vector<size_t> counts;
    size_t total = 0;
    for (int q = 0; q < n; ++q) counts.push_back(static_cast<size_t>(q + 1)), total += static_cast<size_t>(q + 1);
    std::vector<double> send(total), mine(counts[static_cast<size_t>(ch->rank())]);
    for (int q = 0, at = 0; q < n; ++q)
      for (size_t i = 0; i < counts[static_cast<size_t>(q)]; ++i) send[static_cast<size_t>(at++)] = value(me, q, i);
    ch->reduce_scatter(send.data(), mine.data(), counts, comm::DType::f64, comm::Op::sum, "reduce-scatter").wait();
    for (size_t i = 0; i < mine.size(); ++i) {
      double expect = 0;
      for (int r : group) expect += value(r, ch->rank(), i);
      if (mine[i] != expect)
        return fail(d, "reduce-scatter element " + std::to_string(i) + " is " + std::to_string(mine[i]) +
                           ", expected " + std::to_string(expect));
    }
    std::vector<double> all(total, -1.0);
    size_t at = 0;
    for (int q = 0; q < ch->rank(); ++q) at += counts[static_cast<size_t>(q)];
    for (size_t i = 0; i < counts[static_cast<size_t>(ch->rank())]; ++i) all[at + i] = value(me, ch->rank(), i);
    ch->allgather_blocks(all.data(), counts, sizeof(double), "all-gather").wait();
    at = 0;
    for (int q = 0; q < n; ++q)
      for (size_t i = 0; i < counts[static_cast<size_t>(q)]; ++i, ++at)
        if (all[at] != value(group[static_cast<size_t>(q)], q, i))
          return fail(d, "all-gather block " + std::to_string(q) + " element " + std::to_string(i) + " is " +
                             std::to_string(all[at]) + ", expected rank " + std::to_string(group[static_cast<size_t>(q)]) + "'s");
    // The same through the one collective interface (parallel/collectives.hpp), on tensors.
    auto tensors = flowrun::parallel::Group::along("tensors", mesh, d, me);
    torch::Tensor t = torch::full({3}, static_cast<double>(me), torch::kDouble);
    tensors->all_reduce(t, comm::Op::sum, "sum of ranks").wait();
    torch::Tensor b = torch::full({2}, -1.0, torch::kFloat);
    if (tensors->rank() == 0) b.fill_(static_cast<float>(me));
    tensors->broadcast(b, 0, "the first member's rank").wait();
    if (t[2].item<double>() != want || b[1].item<float>() != static_cast<float>(group.front()))
      return fail(d, "the group's all-reduce gave " + std::to_string(t[2].item<double>()) + " (expected " +
                         std::to_string(want) + "), its broadcast " + std::to_string(b[1].item<float>()));
    // Point to point around the group's ring: two messages to the next member, two from the one
    // before, each pair in the order it was sent.
    if (n > 1) {
      const int next = (tensors->rank() + 1) % n, before = (tensors->rank() + n - 1) % n;
      const torch::Tensor out1 = torch::full({3}, static_cast<float>(me)), out2 = torch::full({5}, 10.0 * me, torch::kDouble);
      torch::Tensor in1 = torch::full({3}, -1.0f), in2 = torch::full({5}, -1.0, torch::kDouble);
      std::vector<flowrun::parallel::Work> works;
      works.push_back(tensors->send(out1, next, "first message"));
      works.push_back(tensors->send(out2, next, "second message"));
      works.push_back(tensors->recv(in1, before, "first message"));
      works.push_back(tensors->recv(in2, before, "second message"));
      for (auto& w : works) w.wait();
      const int from = group[static_cast<size_t>(before)];
      if (in1[2].item<float>() != static_cast<float>(from) || in2[4].item<double>() != 10.0 * from)
        return fail(d, "from member " + std::to_string(before) + " (rank " + std::to_string(from) + ") came " +
                           std::to_string(in1[2].item<float>()) + " and " + std::to_string(in2[4].item<double>()));
    }
    if (me == 0)
      std::printf("%s: %d groups of %d, all-reduce, reduce-scatter, all-gather and send/recv within each\n",
                  flowrun::parallel::name(d), comm::size() / n, n);
  }
  return 0;
}

int tp_mlp(int tp) {
  namespace comm = flowrun::comm;
  namespace par = flowrun::parallel;
  const par::Mesh mesh(comm::size(), tp, 1);
  const int me = comm::rank();
  auto group = par::Group::along("tp mlp", mesh, par::Dim::tp, me);
  // The same whole weights and batch on every rank (seeded); the dp replicas differ in nothing here.
  torch::manual_seed(5);
  const int64_t n = 6, d = 8, h = 16;
  torch::Tensor w1 = torch::randn({h, d}, torch::kDouble), b1 = torch::randn({h}, torch::kDouble);
  torch::Tensor w2 = torch::randn({d, h}, torch::kDouble), b2 = torch::randn({d}, torch::kDouble);
  torch::Tensor x0 = torch::randn({n, d}, torch::kDouble), target = torch::randn({n, d}, torch::kDouble);
  auto loss_of = [&](const torch::Tensor& y) { return (y - target).pow(2).sum(); };
  // Whole.
  std::vector<torch::Tensor> whole = {x0.clone().requires_grad_(), w1.clone().requires_grad_(), b1.clone().requires_grad_(),
                                      w2.clone().requires_grad_()};
  torch::Tensor y_whole = torch::linear(torch::gelu(torch::linear(whole[0], whole[1], whole[2])), whole[3], b2);
  loss_of(y_whole).backward();
  // Split: W1 and b1 by rows (column-parallel), W2 by columns (row-parallel), b2 added once after the sum.
  std::vector<torch::Tensor> mine = {x0.clone().requires_grad_(), par::tp_block(w1, 0, *group, "w1").clone().requires_grad_(),
                                     par::tp_block(b1, 0, *group, "b1").clone().requires_grad_(),
                                     par::tp_block(w2, 1, *group, "w2").clone().requires_grad_()};
  torch::Tensor hidden = torch::gelu(torch::linear(par::copy_to_tp(mine[0], group), mine[1], mine[2]));
  torch::Tensor y = par::reduce_from_tp(torch::linear(hidden, mine[3]), group) + b2;
  loss_of(y).backward();
  auto close = [](const torch::Tensor& a, const torch::Tensor& b) {
    return (a - b).abs().max().item<double>() <= 1e-5 * std::max(1.0, b.abs().max().item<double>());
  };
  const std::vector<std::pair<std::string, bool>> checks = {
      {"output", close(y, y_whole)},
      {"input gradient", close(mine[0].grad(), whole[0].grad())},
      {"w1 gradient", close(mine[1].grad(), par::tp_block(whole[1].grad(), 0, *group, "w1"))},
      {"b1 gradient", close(mine[2].grad(), par::tp_block(whole[2].grad(), 0, *group, "b1"))},
      {"w2 gradient", close(mine[3].grad(), par::tp_block(whole[3].grad(), 1, *group, "w2"))}};
  for (const auto& [what, ok] : checks)
    if (!ok) {
      std::fprintf(stderr, "rank %d: tp %d: the split MLP's %s differs from the whole one's\n", me, tp, what.c_str());
      return 1;
    }
  if (me == 0) std::printf("tp %d: the split MLP equals the whole one (output and gradients)\n", tp);
  return 0;
}

// Every parameter of a model off its init (zero biases and projections, the norms' ones), so that a
// part added on every rank, or a zero gradient, shows.
void perturb(torch::nn::Module& m) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(11);
  for (auto& p : m.parameters()) p.add_(torch::randn_like(p) * 0.05);
}

// A model's tensors by name, as a file holds them (copies).
std::map<std::string, torch::Tensor> file_of(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> file;
  for (const auto& p : m.named_parameters()) file[p.key()] = p.value().detach().clone();
  return file;
}

// After backward on both: "" when the split model's loss and each of its parameters' gradients
// (its parts of the whole model's, by `split_of`; whole parameters whole) are within 1e-5 of each
// tensor's largest value; else what differs first.
std::string split_differs(torch::nn::Module& whole, torch::nn::Module& split, const torch::Tensor& l_whole,
                          const torch::Tensor& l_split, const std::function<flowrun::parallel::TpSplit(const std::string&)>& split_of,
                          const flowrun::parallel::Group& tp) {
  auto differs = [](const torch::Tensor& a, const torch::Tensor& b) {
    return !a.sizes().equals(b.sizes()) ||
           (a - b).abs().max().item<double>() > 1e-5 * std::max(1.0, b.abs().max().item<double>());
  };
  if (differs(l_split, l_whole)) return "the loss";
  const auto grads = whole.named_parameters();
  for (const auto& p : split.named_parameters()) {
    if (!p.value().requires_grad() && !grads[p.key()].requires_grad()) continue;  // frozen (a LoRA's base)
    const torch::Tensor want = flowrun::parallel::tp_part(grads[p.key()].grad(), split_of(p.key()), tp, p.key());
    if (!p.value().grad().defined() || differs(p.value().grad(), want)) return p.key() + "'s gradient";
  }
  return "";
}

// split_differs, told: 0 with "tp T: the split WHAT equals the whole one" on rank 0, else 1 with
// what differs on each rank.
int check_split(const std::string& what, torch::nn::Module& whole, torch::nn::Module& split, const torch::Tensor& l_whole,
                const torch::Tensor& l_split, const std::function<flowrun::parallel::TpSplit(const std::string&)>& split_of,
                const flowrun::parallel::Group& tp) {
  const std::string bad = split_differs(whole, split, l_whole, l_split, split_of, tp);
  const int me = flowrun::comm::rank();
  if (!bad.empty()) {
    std::fprintf(stderr, "rank %d: tp %d: the split %s: %s differs from the whole one's\n", me, tp.size(), what.c_str(),
                 bad.c_str());
    return 1;
  }
  if (me == 0)
    std::printf("tp %d: the split %s equals the whole one (loss %.6f, every parameter's gradient)\n", tp.size(),
                what.c_str(), l_whole.item<double>());
  return 0;
}

int gpt_tp(int tp) {
  namespace comm = flowrun::comm;
  namespace par = flowrun::parallel;
  namespace gpt = flowrun::gpt;
  const par::Mesh mesh(comm::size(), tp, 1);
  const int me = comm::rank();
  gpt::Config c;
  c.layers = 2, c.dim = 32, c.heads = 4, c.vocab = 64, c.context = 16;
  gpt::Gpt whole(c);
  gpt::init_weights(*whole, 7);
  perturb(*whole);  // every tensor off its init
  c.tp = par::Group::along("tp gpt", mesh, par::Dim::tp, me);
  gpt::Gpt split(c);
  gpt::load_hf_state_dict(*split, file_of(*whole), "the whole model's tensors");
  torch::manual_seed(3);  // the same batch on every rank (the tp ranks of a replica read the same)
  const torch::Tensor tokens = torch::randint(c.vocab, {4, c.context + 1}, torch::kLong);
  auto loss_of = [&](gpt::GptImpl& m) {  // the split model's logits: its vocabulary columns
    const torch::Tensor logits = m.forward(tokens.narrow(1, 0, c.context));
    return par::vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(2)}),
                                             tokens.narrow(1, 1, c.context).reshape({-1}), m.config().tp);
  };
  const torch::Tensor l_whole = loss_of(*whole), l_split = loss_of(*split);
  l_whole.backward();
  l_split.backward();
  return check_split("GPT", *whole, *split, l_whole, l_split, gpt::tp_split, *c.tp);
}

int dit_tp(int tp, bool with_lora) {
  namespace comm = flowrun::comm;
  namespace par = flowrun::parallel;
  namespace dit = flowrun::dit;
  const par::Mesh mesh(comm::size(), tp, 1);
  const int me = comm::rank();
  dit::Config c;
  c.patch = 2, c.in_channels = 4, c.hidden = 32, c.depth = 4, c.heads = 4, c.mlp_ratio = 4.0;
  c.text_dim = 16, c.t5_dim = 16, c.text_len = 5, c.text_len_t5 = 6, c.pooled_projection_dim = 8;
  c.use_style_cond_and_image_meta_size = true, c.learn_sigma = true, c.rope_base_grid = 0;
  dit::Dit whole(c);
  dit::init_weights(*whole, 7);
  flowrun::lora::Config lc;
  lc.rank = 4, lc.alpha = 8, lc.targets = {"to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2", "skip_linear"};
  if (with_lora) flowrun::lora::apply_lora(*whole, lc, 5);
  perturb(*whole);  // every tensor off its init
  c.tp = par::Group::along("tp dit", mesh, par::Dim::tp, me);
  dit::Dit split(c);
  if (with_lora) flowrun::lora::apply_lora(*split, lc, 5);
  dit::load_state_dict(*split, file_of(*whole), "the whole model's tensors");
  torch::manual_seed(3);  // the same batch on every rank
  const int64_t B = 2;
  dit::DitImpl::Inputs in;
  in.x = torch::randn({B, 4, 8, 8});
  in.t = torch::tensor({3.0, 700.0});
  in.text = torch::randn({B, c.text_len, c.text_dim});
  in.text_mask = torch::tensor({1, 1, 1, 0, 0, 1, 1, 1, 1, 1}).view({B, c.text_len});
  in.t5 = torch::randn({B, c.text_len_t5, c.t5_dim});
  in.t5_mask = torch::tensor({1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0}).view({B, c.text_len_t5});
  in.image_meta_size = torch::tensor({64.f, 64.f, 64.f, 64.f, 0.f, 0.f, 48.f, 64.f, 64.f, 64.f, 8.f, 0.f}).view({B, 6});
  in.style = torch::zeros({B}, torch::kLong);
  const torch::Tensor target = torch::randn({B, c.out_channels(), 8, 8});
  auto loss_of = [&](dit::DitImpl& m) { return (m.forward(in) - target).pow(2).mean(); };
  const torch::Tensor l_whole = loss_of(*whole), l_split = loss_of(*split);
  l_whole.backward();
  l_split.backward();
  return check_split(with_lora ? "DiT with LoRA adapters" : "DiT", *whole, *split, l_whole, l_split, dit::tp_split, *c.tp);
}

int cappa_tp(int tp) {
  namespace comm = flowrun::comm;
  namespace par = flowrun::parallel;
  namespace cappa = flowrun::cappa;
  const par::Mesh mesh(comm::size(), tp, 1);
  const int me = comm::rank();
  cappa::Config c;
  c.image_size = 16, c.patch = 4, c.width = 32, c.depth = 2, c.heads = 4, c.mlp_dim = 64;
  c.dec_width = 32, c.dec_depth = 2, c.dec_heads = 4, c.dec_mlp_dim = 64, c.decoder_bias = true, c.vocab = 20, c.max_len = 6;
  cappa::Cappa whole(c);
  cappa::init_weights(*whole, 7);
  perturb(*whole);  // every tensor off its init
  c.tp = par::Group::along("tp cappa", mesh, par::Dim::tp, me);
  cappa::Cappa split(c);
  cappa::load_state_dict(*split, file_of(*whole), "the whole model's tensors");
  torch::manual_seed(3);  // the same batch on every rank
  const flowrun::TensorMap batch = {{"image", torch::rand({4, 3, 16, 16}) * 2 - 1},
                                    {"decoder_input", torch::randint(c.vocab, {4, c.max_len}, torch::kLong)},
                                    {"decoder_masked", torch::rand({4, c.max_len}) < 0.3},
                                    {"parallel", torch::tensor({true, false, true, false})}};
  const torch::Tensor targets = torch::randint(c.vocab, {4 * c.max_len}, torch::kLong);
  auto loss_of = [&](cappa::CappaImpl& m) {
    return torch::nn::functional::cross_entropy(m.forward_batch(batch).reshape({-1, c.vocab}), targets);
  };
  const torch::Tensor l_whole = loss_of(*whole), l_split = loss_of(*split);
  l_whole.backward();
  l_split.backward();
  return check_split("CapPa", *whole, *split, l_whole, l_split, cappa::tp_split, *c.tp);
}

int mesh_hang(int tp, int pp) {
  namespace comm = flowrun::comm;
  using flowrun::parallel::Dim;
  const flowrun::parallel::Mesh mesh(comm::size(), tp, pp);
  const int me = comm::rank();
  comm::set_timeout(2.0);
  auto group = flowrun::parallel::Group::along("hang", mesh, Dim::tp, me);
  if (me == 1) std::this_thread::sleep_for(std::chrono::seconds(120));  // alive, silent
  torch::Tensor t = torch::ones({4});
  try {
    group->all_reduce(t, comm::Op::sum, "an all-reduce rank 1 never joins").wait();
  } catch (const std::exception& e) {
    comm::abort_job(comm::where() + ": " + e.what(), 3);
  }
  // The ranks of other groups finish theirs, then wait here for the job's end (the abort).
  std::this_thread::sleep_for(std::chrono::seconds(120));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string cmd = argc > 1 ? argv[1] : "";
    if (cmd == "trace-overlap" && argc == 5) return trace_overlap(argv[2], argv[3], argv[4]);
    if (cmd == "model-logits" && argc >= 5)
      return model_logits(argv[2], argv[3], argv[4], std::vector<std::string>(argv + 5, argv + argc));
    if (cmd == "model-export" && argc >= 4)
      return model_export(argv[2], argv[3], std::vector<std::string>(argv + 4, argv + argc));
    const bool versus = argc >= 8 && std::string(argv[7]) == "--versus";
    if (cmd == "pipeline-bubble" && argc >= (versus ? 10 : 8)) {
      return pipeline_bubble(argv[2], argv[3], std::stoi(argv[4]), std::stoi(argv[5]), std::stod(argv[6]),
                             versus ? argv[8] : "", std::vector<std::string>(argv + (versus ? 9 : 7), argv + argc));
    }
    if (cmd == "mesh-hang" && argc == 4) {
      flowrun::comm::init(&argc, &argv);
      return mesh_hang(std::stoi(argv[2]), std::stoi(argv[3]));
    }
    // The checks under mpirun, several in one job when joined by "+" (one start-up of MPI and
    // libtorch for all of them: "tp-mlp 2 + tp-mlp 4"), in turn; a failure on one rank ends the
    // job on all of them.
    std::vector<std::vector<std::string>> checks(1);
    for (int i = 1; i < argc; ++i) {
      if (std::string(argv[i]) == "+") checks.emplace_back();
      else checks.back().push_back(argv[i]);
    }
    auto check = [](const std::vector<std::string>& a) -> std::optional<std::function<int()>> {
      const std::string& c = a.front();
      auto n = [&](size_t i) { return std::stoi(a.at(i)); };
      if (c == "tp-mlp" && a.size() == 2) return [=] { return tp_mlp(n(1)); };
      if (c == "gpt-tp" && a.size() == 2) return [=] { return gpt_tp(n(1)); };
      if (c == "dit-tp" && (a.size() == 2 || (a.size() == 3 && a[2] == "lora"))) return [=] { return dit_tp(n(1), a.size() == 3); };
      if (c == "cappa-tp" && a.size() == 2) return [=] { return cappa_tp(n(1)); };
      if (c == "mesh-groups" && a.size() == 3) return [=] { return mesh_groups(n(1), n(2)); };
      return std::nullopt;
    };
    std::vector<std::function<int()>> run;
    for (const auto& a : checks)
      if (auto f = a.empty() ? std::nullopt : check(a)) run.push_back(*f);
    if (!run.empty() && run.size() == checks.size()) {
      flowrun::comm::init(&argc, &argv);
      for (size_t i = 0; i < run.size(); ++i)
        if (const int rc = run[i]()) {
          std::string what;
          for (const auto& w : checks[i]) what += " " + w;
          flowrun::comm::abort_job("testtool" + what + " failed", rc);
        }
      flowrun::comm::finalize();
      return 0;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "testtool: %s\n", e.what());
    return 2;
  }
  std::fprintf(stderr, "usage: testtool trace-overlap TRACE PRODUCER CONSUMER | model-logits GRAPH TOKENS OUT [OVERRIDE...] | pipeline-bubble NODE SCHEDULE M V TOL [--versus OTHER] TRACE... | mesh-hang TP PP | CHECK [+ CHECK ...], a CHECK one of mesh-groups TP PP, tp-mlp TP, gpt-tp TP, dit-tp TP [lora], cappa-tp TP\n");
  return 2;
}
