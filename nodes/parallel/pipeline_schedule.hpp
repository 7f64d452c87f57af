// Pipeline schedules (docs/parallel.md "Pipeline parallel"): what each stage of a pipeline runs,
// in which order, for one step of M micro-batches. One rule makes every schedule, and the same
// rule's timeline is what `flowrun explain` prints and what forward_backward executes.
//
// The model's blocks are cut into C = pp x V contiguous chunks (V virtual stages per rank:
// `interleaved`; else V = 1); chunk k runs on pp rank k % pp. Per chunk and micro-batch there are
// three operations:
//   F(k, m)  forward of chunk k on micro-batch m: after F(k-1, m) (its outputs are k's inputs)
//   B(k, m)  backward to k's inputs: after F(k, m) and B(k+1, m) (the gradient of k's outputs)
//   W(k, m)  the weight gradients of k (zero_bubble only; else part of B): after B(k, m)
//
// The rule is a list scheduler over that dependency graph: ranks run one operation at a time,
// and a rank that is free runs, among the operations whose inputs are there, the first by the
// schedule's priority, while the micro-batches it holds activations for (F done, B not yet) stay
// within the schedule's limit:
//
//   schedule      B and W   priority                                 micro-batches in flight on rank s
//   gpipe         one op    F before B (every forward, then backwards)  M (all)
//   1f1b          one op    B before F                               pp - s           (Narayanan et al. 2019)
//   interleaved   one op    Megatron-LM's program: its warm-up's       Megatron's warm-up + 1:
//                           F's, then one F and one B in turn, then    2 (pp - s - 1) + (V - 1) pp + 1
//                           the last B's; F's by (m / pp, chunk,
//                           m % pp), B's by (m / pp, last chunk first,
//                           m % pp), neither skipping ahead
//   zero_bubble   split     B before F before W (a W when nothing      pp - s, and at most pp B's
//                           else can run: it fills the bubbles;       waiting for their W (ZB-H1,
//                           first once pp W's wait)                   Qi et al. 2023: about 1F1B's
//                                                                     memory, a third of its bubble)
//
// Simulated at unit costs (F 1, B 1, W 1; without the split B costs B + W), the rule gives each
// rank's program: the order it runs its operations in, what the executor runs whatever the real
// costs are. Given costs, that program is timed at them (each rank runs its next operation once it
// is free and the operation's inputs are there; the rule is not run again at those costs, since it
// could order them otherwise). The timeline gives the bubble: a rank's idle share of the time
// between its first operation's start and its last one's end.
// For 1F1B and GPipe on rank 0 that is the textbook (pp - 1) / (M + pp - 1); interleaved's is
// (pp - 1) / (V M + pp - 1) (Narayanan et al. 2021).
//
// Pure arithmetic: no torch, no MPI.
#pragma once
#include <string>
#include <vector>

namespace flowrun::parallel::pipeline {

enum class Kind { gpipe, one_f_one_b, interleaved, zero_bubble };
// "gpipe", "1f1b", "interleaved", "zero_bubble" (run.parallel.schedule's values).
Kind parse_kind(const std::string& name);
const char* name(Kind k);

struct Op {
  enum Type { F, B, W } type = F;
  int chunk = 0;  // the model chunk (virtual stage), 0 .. chunks - 1
  int mb = 0;     // the micro-batch
  bool operator==(const Op& o) const { return type == o.type && chunk == o.chunk && mb == o.mb; }
};
std::string str(const Op& op);  // "F3.1": forward of micro-batch 3 on chunk 1

struct Config {
  int stages = 1;          // pp
  int microbatches = 1;    // M
  Kind kind = Kind::one_f_one_b;
  int virtual_stages = 1;  // V (interleaved; 1 otherwise)
  // What each operation costs, per chunk (empty: 1 each): the program is made at unit costs and
  // timed at these. With `kind` other than zero_bubble, B's cost is B + W.
  std::vector<double> f, b, w;
  // run.parallel's settings (a schedule's name as parse_kind reads it), unit costs.
  static Config of(int pp, int microbatches, const std::string& schedule, int virtual_stages);
  int chunks() const { return stages * virtual_stages; }
  // Throws naming the setting when the config cannot make a schedule (sizes < 1; V > 1 without
  // interleaved; interleaved with M not a multiple of pp, as Megatron-LM).
  void check() const;
};

struct Slot {
  Op op;
  double start = 0, end = 0;
};

struct Schedule {
  Config config;
  // Per pp rank: its operations in the order it runs them, with the simulated times.
  std::vector<std::vector<Slot>> ranks;
  double makespan = 0;
  int rank_of(int chunk) const { return chunk % config.stages; }
  // Rank r's idle share of [its first start, its last end].
  double bubble(int rank) const;
  // The largest micro-batch count whose activations rank r holds at once.
  int peak_in_flight(int rank) const;
  // The same in (block, micro-batch) pairs, `cut` the blocks of each chunk ([first, last), as
  // balance() returns them): each F holds its chunk's blocks for one micro-batch until its B.
  int peak_blocks_held(int rank, const std::vector<std::pair<int, int>>& cut) const;
  // The timeline as text, one line per rank (explain): "rank 0 |F0 F1 F2 B0 ...|  bubble 27 %".
  std::vector<std::string> render() const;
};

// The one rule (above).
Schedule make(const Config& c);

// Cuts `costs.size()` blocks into `chunks` contiguous runs, each non-empty, minimising the largest
// run's cost (its blocks' costs, plus `first` on the first run and `last` on the last: the embedding
// and the head); returns each run's first block and one past the last. Throws when there are fewer
// blocks than chunks.
std::vector<std::pair<int, int>> balance(const std::vector<double>& costs, int chunks, double first = 0, double last = 0);
// The same, given: run.parallel.stage_layers (blocks per chunk, summing to the block count); throws
// naming the setting otherwise.
std::vector<std::pair<int, int>> given(const std::vector<int>& layers, int blocks, int chunks);

}  // namespace flowrun::parallel::pipeline
