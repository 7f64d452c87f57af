// The one rule that makes every pipeline schedule (pipeline_schedule.hpp): a list scheduler over
// the F / B / W dependency graph, the schedule's name choosing the priority and the limit.
#include "parallel/pipeline_schedule.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>
#include <tuple>

namespace flowrun::parallel::pipeline {

Kind parse_kind(const std::string& n) {
  if (n == "gpipe") return Kind::gpipe;
  if (n == "1f1b") return Kind::one_f_one_b;
  if (n == "interleaved") return Kind::interleaved;
  if (n == "zero_bubble") return Kind::zero_bubble;
  throw std::invalid_argument("run.parallel.schedule: '" + n + "' is not a schedule (gpipe, 1f1b, interleaved, zero_bubble)");
}

const char* name(Kind k) {
  switch (k) {
    case Kind::gpipe: return "gpipe";
    case Kind::one_f_one_b: return "1f1b";
    case Kind::interleaved: return "interleaved";
    case Kind::zero_bubble: return "zero_bubble";
  }
  return "?";
}

std::string str(const Op& op) {
  return std::string(op.type == Op::F ? "F" : op.type == Op::B ? "B" : "W") + std::to_string(op.mb) + "." +
         std::to_string(op.chunk);
}

Config Config::of(int pp, int microbatches, const std::string& schedule, int virtual_stages) {
  Config c;
  c.stages = pp;
  c.microbatches = microbatches;
  c.kind = parse_kind(schedule);
  c.virtual_stages = virtual_stages;
  return c;
}

void Config::check() const {
  if (stages < 1 || microbatches < 1 || virtual_stages < 1)
    throw std::invalid_argument("run.parallel: pp, microbatches and virtual_stages must be at least 1");
  if (virtual_stages > 1 && kind != Kind::interleaved)
    throw std::invalid_argument("run.parallel.virtual_stages is " + std::to_string(virtual_stages) + " with schedule " +
                                name(kind) + ": virtual stages are the interleaved schedule's; set schedule: "
                                "interleaved, or virtual_stages: 1");
  if (kind == Kind::interleaved && microbatches % stages != 0)
    throw std::invalid_argument("run.parallel.schedule interleaved runs micro-batches in groups of pp (" +
                                std::to_string(stages) + "): set run.parallel.microbatches to a multiple of it (it is " +
                                std::to_string(microbatches) + ")");
  for (const auto* v : {&f, &b, &w})
    if (!v->empty() && static_cast<int>(v->size()) != chunks())
      throw std::invalid_argument("pipeline schedule: a cost per chunk (" + std::to_string(chunks()) + ") or none");
}

namespace {

// The simulation's bookkeeping: each operation's end time (NaN: not run), per (type, chunk, mb).
struct Times {
  int chunks, mbs;
  std::vector<double> t;
  Times(int c, int m) : chunks(c), mbs(m), t(static_cast<size_t>(3 * c * m), std::numeric_limits<double>::quiet_NaN()) {}
  double& at(Op::Type ty, int k, int m) { return t[static_cast<size_t>((ty * chunks + k) * mbs + m)]; }
  bool done(Op::Type ty, int k, int m, double now) {
    const double e = at(ty, k, m);
    return !std::isnan(e) && e <= now;
  }
};

// What an operation of chunk k costs under c (Config::f, b, w; without the split, B is B + W).
double op_cost(const Config& c, Op::Type ty, int k) {
  auto of = [&](const std::vector<double>& v) { return v.empty() ? 1.0 : v[static_cast<size_t>(k)]; };
  if (ty == Op::F) return of(c.f);
  if (ty == Op::W) return of(c.w);
  return c.kind == Kind::zero_bubble ? of(c.b) : of(c.b) + of(c.w);
}

// The rule (pipeline_schedule.hpp) simulated at c's costs.
Schedule list_schedule(const Config& c) {
  const int p = c.stages, C = c.chunks(), M = c.microbatches, V = c.virtual_stages;
  const bool split = c.kind == Kind::zero_bubble;
  auto cost = [&](Op::Type ty, int k) { return op_cost(c, ty, k); };
  auto limit = [&](int s) {
    switch (c.kind) {
      case Kind::gpipe: return M * V;
      case Kind::interleaved: return 2 * (p - s - 1) + (V - 1) * p + 1;
      default: return p - s;
    }
  };
  // Priority among a rank's ready operations: a smaller tuple first.
  auto key = [&](const Op& o) {
    int cls = 0;  // which type goes first
    if (c.kind == Kind::gpipe) cls = o.type == Op::F ? 0 : 1;
    else cls = o.type == Op::B ? 0 : o.type == Op::F ? 1 : 2;
    if (c.kind == Kind::interleaved)
      return std::make_tuple(cls, o.mb / p, o.type == Op::F ? o.chunk : C - 1 - o.chunk, o.mb % p);
    return std::make_tuple(cls, o.mb, o.type == Op::F ? o.chunk : C - 1 - o.chunk, 0);
  };

  Schedule s;
  s.config = c;
  s.ranks.resize(static_cast<size_t>(p));
  Times times(C, M);
  std::vector<std::vector<Op>> todo(static_cast<size_t>(p));  // each rank's operations not started
  for (int k = 0; k < C; ++k)
    for (int m = 0; m < M; ++m)
      for (Op::Type ty : {Op::F, Op::B, Op::W})
        if (ty != Op::W || split) todo[static_cast<size_t>(k % p)].push_back({ty, k, m});
  std::vector<double> free_at(static_cast<size_t>(p), 0.0);
  std::vector<int> held(static_cast<size_t>(p), 0);  // micro-batches a rank holds activations of (F run, B not yet)
  // zero_bubble: B's whose W has not run; at pp of them (what a W keeps: its layers' inputs and
  // output gradients, bounded as 1F1B's first stage's activations, ZB-H1's memory) the W goes first.
  std::vector<int> waiting_w(static_cast<size_t>(p), 0);
  // Releases at a time: (time, rank) once an op that frees activations ends.
  std::multimap<double, int> releases;
  double now = 0;
  size_t left = 0;
  for (const auto& t : todo) left += t.size();
  while (left > 0) {
    for (auto it = releases.begin(); it != releases.end() && it->first <= now;) {
      --held[static_cast<size_t>(it->second)];
      it = releases.erase(it);
    }
    for (int r = 0; r < p; ++r) {
      if (free_at[static_cast<size_t>(r)] > now) continue;
      auto& ops = todo[static_cast<size_t>(r)];
      // Interleaved: Megatron-LM's fixed program. Each type's operations in their priority order,
      // none skipping ahead, and the types in turn: the warm-up's forwards, then one forward and
      // one backward alternately, then the remaining backwards. (Letting the first ready
      // operation go instead drains backwards in a row, or fills the limit with a later
      // micro-batch's forwards whose backwards cannot start: pp 4 x 2 chunks of 16 micro-batches
      // had no operation left to run.)
      std::optional<decltype(key(Op{}))> first_f, first_b;
      std::optional<Op::Type> turn;
      if (c.kind == Kind::interleaved) {
        for (const Op& o : ops) {
          auto& first = o.type == Op::F ? first_f : first_b;
          if (!first || key(o) < *first) first = key(o);
        }
        const int done = static_cast<int>(s.ranks[static_cast<size_t>(r)].size()), total = M * V;
        const int warm = std::min(limit(r) - 1, total);
        turn = done < warm ? Op::F : done < warm + 2 * (total - warm) ? ((done - warm) % 2 == 0 ? Op::F : Op::B) : Op::B;
      }
      int best = -1;
      for (int i = 0; i < static_cast<int>(ops.size()); ++i) {
        const Op& o = ops[static_cast<size_t>(i)];
        if (turn && (o.type != *turn || key(o) != *(o.type == Op::F ? first_f : first_b))) continue;
        bool ready = false;
        if (o.type == Op::F)
          ready = (o.chunk == 0 || times.done(Op::F, o.chunk - 1, o.mb, now)) && held[static_cast<size_t>(r)] < limit(r);
        else if (o.type == Op::B)
          ready = times.done(Op::F, o.chunk, o.mb, now) && (o.chunk == C - 1 || times.done(Op::B, o.chunk + 1, o.mb, now));
        else
          ready = times.done(Op::B, o.chunk, o.mb, now);
        if (!ready) continue;
        auto rank_key = [&](const Op& x) {
          const bool due = x.type == Op::W && waiting_w[static_cast<size_t>(r)] >= p;
          return std::make_pair(due ? 0 : 1, key(x));
        };
        if (best < 0 || rank_key(o) < rank_key(ops[static_cast<size_t>(best)])) best = i;
      }
      if (best < 0) continue;
      const Op o = ops[static_cast<size_t>(best)];
      ops.erase(ops.begin() + best);
      --left;
      const double end = now + cost(o.type, o.chunk);
      times.at(o.type, o.chunk, o.mb) = end;
      free_at[static_cast<size_t>(r)] = end;
      s.ranks[static_cast<size_t>(r)].push_back({o, now, end});
      if (o.type == Op::F) ++held[static_cast<size_t>(r)];
      if (o.type == Op::B) releases.emplace(end, r);
      if (o.type == Op::B && split) ++waiting_w[static_cast<size_t>(r)];
      if (o.type == Op::W) --waiting_w[static_cast<size_t>(r)];
    }
    // The next moment something changes: an operation ends (a rank is free, its outputs are there,
    // and what it released is released then too).
    double next = std::numeric_limits<double>::infinity();
    for (double f : free_at)
      if (f > now) next = std::min(next, f);
    if (std::isinf(next) && left > 0)
      throw std::logic_error(std::string("pipeline schedule ") + name(c.kind) + ": no operation can run (" +
                             std::to_string(left) + " left)");
    now = next;
  }
  for (const auto& r : s.ranks)
    if (!r.empty()) s.makespan = std::max(s.makespan, r.back().end);
  return s;
}

// `program` (each rank's operations in order) timed at c's costs: each rank runs its next
// operation as soon as it is free and the operation's inputs are there.
Schedule timed(const Schedule& program, const Config& c) {
  const int C = c.chunks(), M = c.microbatches;
  Schedule s;
  s.config = c;
  s.ranks.resize(program.ranks.size());
  Times times(C, M);
  auto ended = [&](Op::Type ty, int k, int m) { return times.at(ty, k, m); };  // NaN: not yet
  std::vector<size_t> next(program.ranks.size(), 0);
  std::vector<double> free_at(program.ranks.size(), 0.0);
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t r = 0; r < program.ranks.size(); ++r)
      while (next[r] < program.ranks[r].size()) {
        const Op o = program.ranks[r][next[r]].op;
        std::vector<double> inputs;
        if (o.type == Op::F && o.chunk > 0) inputs.push_back(ended(Op::F, o.chunk - 1, o.mb));
        if (o.type == Op::B) {
          inputs.push_back(ended(Op::F, o.chunk, o.mb));
          if (o.chunk < C - 1) inputs.push_back(ended(Op::B, o.chunk + 1, o.mb));
        }
        if (o.type == Op::W) inputs.push_back(ended(Op::B, o.chunk, o.mb));
        double start = free_at[r];
        bool ready = true;
        for (double t : inputs) {
          if (std::isnan(t)) ready = false;
          else start = std::max(start, t);
        }
        if (!ready) break;
        const double cost = op_cost(c, o.type, o.chunk);
        times.at(o.type, o.chunk, o.mb) = free_at[r] = start + cost;
        s.ranks[r].push_back({o, start, start + cost});
        ++next[r];
        progress = true;
      }
  }
  for (size_t r = 0; r < program.ranks.size(); ++r)
    if (next[r] < program.ranks[r].size())
      throw std::logic_error(std::string("pipeline schedule ") + name(c.kind) + ": rank " + std::to_string(r) +
                             " waits on an operation that never runs (" + str(program.ranks[r][next[r]].op) + ")");
  for (const auto& r : s.ranks)
    if (!r.empty()) s.makespan = std::max(s.makespan, r.back().end);
  return s;
}

}  // namespace

Schedule make(const Config& c) {
  c.check();
  // The program is the rule's at unit costs, what forward_backward runs whatever the real costs
  // are; the costs given only time it.
  Config unit = c;
  unit.f.clear(), unit.b.clear(), unit.w.clear();
  const Schedule program = list_schedule(unit);
  if (c.f.empty() && c.b.empty() && c.w.empty()) return program;
  return timed(program, c);
}

double Schedule::bubble(int rank) const {
  const auto& slots = ranks.at(static_cast<size_t>(rank));
  if (slots.empty()) return 0;
  double busy = 0;
  for (const Slot& s : slots) busy += s.end - s.start;
  const double span = slots.back().end - slots.front().start;
  return span > 0 ? 1.0 - busy / span : 0.0;
}

int Schedule::peak_in_flight(int rank) const {
  int held = 0, peak = 0;
  for (const Slot& s : ranks.at(static_cast<size_t>(rank))) {
    if (s.op.type == Op::F) peak = std::max(peak, ++held);
    else if (s.op.type == Op::B) --held;
  }
  return peak;
}

int Schedule::peak_blocks_held(int rank, const std::vector<std::pair<int, int>>& cut) const {
  int held = 0, peak = 0;
  for (const Slot& s : ranks.at(static_cast<size_t>(rank))) {
    const auto& [first, last] = cut.at(static_cast<size_t>(s.op.chunk));
    if (s.op.type == Op::F) peak = std::max(peak, held += last - first);
    else if (s.op.type == Op::B) held -= last - first;
  }
  return peak;
}

std::vector<std::string> Schedule::render() const {
  std::vector<std::string> lines;
  for (size_t r = 0; r < ranks.size(); ++r) {
    std::string line = "stage " + std::to_string(r) + ":";
    double at = ranks[r].empty() ? 0 : ranks[r].front().start;
    for (size_t i = 0; i < ranks[r].size(); ++i) {
      const Slot& s = ranks[r][i];
      if (s.start > at + 1e-9) line += " ..";  // waiting for another stage
      Op op = s.op;
      // Without virtual stages the chunk is the stage: "F3" for F3.0.
      line += " " + (config.virtual_stages == 1 ? str(op).substr(0, str(op).find('.')) : str(op));
      at = s.end;
    }
    char tail[64];
    const int held = peak_in_flight(static_cast<int>(r));
    std::snprintf(tail, sizeof tail, "   (bubble %.0f %%, holds at most %d micro-batch%s)", 100.0 * bubble(static_cast<int>(r)),
                  held, held == 1 ? "" : "es");
    lines.push_back(line + tail);
  }
  return lines;
}

std::vector<std::pair<int, int>> balance(const std::vector<double>& costs, int chunks, double first, double last) {
  const int n = static_cast<int>(costs.size());
  if (chunks < 1 || n < chunks)
    throw std::invalid_argument("the model has " + std::to_string(n) + " blocks, fewer than the " + std::to_string(chunks) +
                                " pipeline chunks (run.parallel.pp x virtual_stages) that each need one");
  std::vector<double> prefix(static_cast<size_t>(n + 1), 0.0);
  for (int i = 0; i < n; ++i) prefix[static_cast<size_t>(i + 1)] = prefix[static_cast<size_t>(i)] + costs[static_cast<size_t>(i)];
  auto run_cost = [&](int a, int b, int chunk) {
    return prefix[static_cast<size_t>(b)] - prefix[static_cast<size_t>(a)] + (chunk == 0 ? first : 0.0) +
           (chunk == chunks - 1 ? last : 0.0);
  };
  // best[c][i]: the smallest largest cost cutting blocks [0, i) into c + 1 runs; cut[c][i] its last run's start.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(static_cast<size_t>(chunks), std::vector<double>(static_cast<size_t>(n + 1), inf));
  std::vector<std::vector<int>> cut(static_cast<size_t>(chunks), std::vector<int>(static_cast<size_t>(n + 1), 0));
  for (int i = 1; i <= n; ++i) best[0][static_cast<size_t>(i)] = run_cost(0, i, 0);
  for (int c = 1; c < chunks; ++c)
    for (int i = c + 1; i <= n; ++i)
      for (int j = c; j < i; ++j) {
        const double v = std::max(best[static_cast<size_t>(c - 1)][static_cast<size_t>(j)], run_cost(j, i, c));
        // Ties go to the later cut: the earlier chunks take the extra blocks (the last one has the head).
        if (v <= best[static_cast<size_t>(c)][static_cast<size_t>(i)]) {
          best[static_cast<size_t>(c)][static_cast<size_t>(i)] = v;
          cut[static_cast<size_t>(c)][static_cast<size_t>(i)] = j;
        }
      }
  std::vector<std::pair<int, int>> runs(static_cast<size_t>(chunks));
  int end = n;
  for (int c = chunks - 1; c >= 0; --c) {
    const int start = c == 0 ? 0 : cut[static_cast<size_t>(c)][static_cast<size_t>(end)];
    runs[static_cast<size_t>(c)] = {start, end};
    end = start;
  }
  return runs;
}

std::vector<std::pair<int, int>> given(const std::vector<int>& layers, int blocks, int chunks) {
  auto listed = [&] {
    std::string s;
    for (size_t i = 0; i < layers.size(); ++i) s += (i ? ", " : "") + std::to_string(layers[i]);
    return "[" + s + "]";
  };
  if (static_cast<int>(layers.size()) != chunks)
    throw std::invalid_argument("run.parallel.stage_layers " + listed() + " has " + std::to_string(layers.size()) +
                                " entries; give one per pipeline chunk (pp x virtual_stages = " + std::to_string(chunks) +
                                "), or leave it empty to balance by cost");
  std::vector<std::pair<int, int>> runs;
  int at = 0;
  for (int n : layers) {
    if (n < 1)
      throw std::invalid_argument("run.parallel.stage_layers " + listed() + ": every chunk needs at least one block");
    runs.emplace_back(at, at + n);
    at += n;
  }
  if (at != blocks)
    throw std::invalid_argument("run.parallel.stage_layers " + listed() + " sums to " + std::to_string(at) +
                                " blocks, and the model has " + std::to_string(blocks));
  return runs;
}

}  // namespace flowrun::parallel::pipeline
