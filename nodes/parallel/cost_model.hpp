// What a layout of the mesh costs a training step (issue 50, `flowrun plan`; docs/parallel.md "The
// cost model"): the step time and the memory of the fullest device for dp x tp x pp, a ZeRO stage,
// activation checkpointing, the micro-batch count and the pipeline schedule, from what one device
// measured of the model (each block's forward and backward seconds, its parameters and activation
// bytes) and the links between devices. Each part is a published formula:
//
//   a link             Hockney's alpha-beta model: n bytes cost alpha + n / beta
//   ring collectives   over g ranks and a buffer of S bytes (Patarasuk & Yuan 2009; NCCL's and Open
//                      MPI's for large buffers): all-reduce 2 (g - 1) steps of S / g bytes, reduce-
//                      scatter and all-gather g - 1 steps of S / g
//   data parallel      the gradients all-reduced once a step, 2 (g - 1) / g Psi bytes a rank
//                      (Psi: the gradients' bytes), overlapped with the last micro-batch's backward
//                      (PyTorch DDP, Li et al. 2020)
//   ZeRO states and    gradients reduce-scattered and the updated parameters all-gathered: the
//   gradients          same 2 (g - 1) / g Psi; the moments (and at `gradients` the gradients) / g
//                      (Rajbhandari et al. 2020)
//   ZeRO params        + the parameters all-gathered for each forward and again for each backward:
//                      3 (g - 1) / g Psi a step, 1.5 x data parallel's; the parameters / g, a
//                      pipeline stage's whole while its step runs (they are held for every
//                      micro-batch), else the blocks in use
//   tensor parallel    Megatron-LM's split (Shoeybi et al. 2019): per block and micro-batch two
//                      all-reduces of the block's output forward and two backward, on the critical
//                      path; the split share of a block's parameters and (Korthikanti et al. 2022:
//                      24 of 34 units a token) activations / t; its compute, what the whole block
//                      costs at that share of the rows (as many calls, each narrower)
//   pipeline           the schedule itself (pipeline_schedule.hpp) simulated with each chunk's costs
//                      and each activation's send: 1F1B's bubble (p - 1) / (M + p - 1) at equal costs
//   checkpointing      a recomputed block keeps its input only and runs its forward again in
//                      backward (Korthikanti et al. 2022)
//   expert parallel    a mixture of experts' experts over e ranks cut out of dp (GShard, Lepikhin
//                      et al. 2020): a block's experts / e on each, per micro-batch four all-to-
//                      alls of its routed rows (top_k a token; dispatch and combine, forward and
//                      backward: (e - 1) / e of them each) on the critical path, the experts'
//                      gradients all-reduced over the d / e ranks holding the same ones
//
// Every rank of a layout runs the same code on its share, so the prediction is the slowest stage's
// step and the fullest stage's memory. Pure arithmetic: no torch, no MPI.
#pragma once
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "parallel/pipeline_schedule.hpp"

namespace flowrun::parallel::cost {

// Hockney's alpha-beta model of a link.
struct Link {
  double latency_s = 0;       // alpha
  double bytes_per_s = 1e10;  // beta
  double time(double bytes) const { return latency_s + bytes / bytes_per_s; }
};

// The link through measured (bytes, seconds) points: least squares in the relative error (each
// point weighted 1 / t^2, so the small buffers' latency counts as much as the large ones' bandwidth),
// latency at least 0; and the fit's worst relative error.
std::pair<Link, double> fit_link(const std::vector<std::pair<double, double>>& points);

// Ring collectives over g ranks of a buffer of S bytes: what each rank sends, and the time.
double all_reduce_bytes(double S, int g);                  // 2 (g - 1) / g S
double all_gather_bytes(double S, int g);                  // (g - 1) / g S; a reduce-scatter's alike
double all_reduce_time(double S, int g, const Link& l);    // 2 (g - 1) (alpha + S / (g beta))
double all_gather_time(double S, int g, const Link& l);    // (g - 1) (alpha + S / (g beta)); reduce-scatter alike
// An all-to-all of S bytes a rank (S / g to each), pairwise: (g - 1) (alpha + S / (g beta)).
double all_to_all_time(double S, int g, const Link& l);

enum class Zero { none, states, gradients, params };
const char* name(Zero z);  // the zero node's stage: "none", "states", "gradients", "params"

// The bytes each rank sends a step for its data-parallel group of g replicas, `grad_bytes` the
// gradients of what it holds: 2 (g - 1) / g of them without ZeRO and at states and gradients,
// 3 (g - 1) / g at params (one more all-gather of the parameters, as many bytes at equal dtypes).
double data_parallel_bytes(double grad_bytes, int g, Zero z);
// The bytes each rank sends for one block and one micro-batch under tensor parallel over t ranks:
// four all-reduces (two forward, two backward) of the block's output, `output_bytes`.
double tensor_parallel_bytes(double output_bytes, int t);

// Korthikanti et al. 2022: of a transformer block's 34 activation units a token (2-byte values),
// the 24 inside the layers tensor parallel splits go / t; the norms' and the residual's 10 stay
// whole. The one place of these constants: the activation estimate (models/activation_checkpoint),
// forward_backward's memory advice and this model use them.
double activation_units(int t);  // 10 + 24 / t
double activations_held(int t);  // activation_units(t) / 34: the share one of t ranks keeps

// ZeRO stage params (train/fully_sharded.hpp): what a rank holds gathered beside its slice at the
// turn from forward to backward, in bytes or parameters: the parameters outside the blocks
// (`others`, gathered for the whole use), every block that was not recomputed (`kept`: autograd
// saved it), and the blocks in flight (the one running, the one arriving: twice the `largest`);
// at most `all`, the whole model's (without checkpointing, every block is kept). The one rule of
// forward_backward's memory advice and this model.
double zero3_gathered(double others, double kept, double largest, double all);

// What one device measured of the model, at `rows` rows a micro-batch. A time at other rows r:
// where the model was also timed at smaller sizes (Model::sizes), the line through the two
// measured sizes nearest r (a small micro-batch computes less efficiently: per-call overhead,
// fewer threads busy), and above the largest in proportion to it; else t0 + (t - t0) r / rows
// (t0: what does not shrink with the rows, kernel launches; 0: proportional).
struct Block {
  double fwd_s = 0, bwd_s = 0;  // forward; backward (the input's and the weights' gradients)
  double fwd0_s = 0, bwd0_s = 0;
  std::vector<double> fwd_at, bwd_at;  // at Model::sizes (empty: the line above)
  // What checkpointing adds to its backward (the recompute, and what a recompute costs besides:
  // measured as the checkpointed backward less the plain one), the same way along the sizes;
  // rec_s < 0: not measured, the forward's time instead.
  double rec_s = -1, rec0_s = 0;
  std::vector<double> rec_at;
  double params = 0;
  double frozen = 0;            // of params: frozen (LoRA's base weights): held, never updated (no
                                // gradients, optimizer state, EMA or all-reduce)
  double split = 1;             // the share of its parameters and products tensor parallel splits
  double experts = 0;           // the share of its parameters that are experts (split over ep, whole over tp)
  double routed_bytes = 0;      // a mixture of experts: the rows it sends to its experts a micro-batch
                                // (top_k a token, each dim values), what each all-to-all moves
  double activation_bytes = 0;  // what backward keeps of it without checkpointing
  double output_bytes = 0;      // its output: what a recomputed block keeps (its next one's input), a
                                // pipeline stage sends on, and tensor parallel all-reduces
};
struct Model {
  std::vector<Block> blocks;
  double rows = 1;
  std::vector<double> sizes;  // the rows a micro-batch the times were measured at, ascending (the last: rows)
  // The layers before the blocks (embeddings: the first stage's) and after them (final norm,
  // head, loss: the last stage's), whole on every tp rank.
  Block first, last;
  bool tied = false;  // the head reuses the first layers' table (GPT): the last stage holds a copy
  // Bytes a parameter: weights; of a trained one, gradients, the optimizer's state (AdamW: 8), an
  // EMA's copy (0: none).
  double weight_bytes = 4, grad_bytes = 4, optimizer_bytes = 8, ema_bytes = 0;
  double update_s_per_param = 0;  // the optimizer's (and an EMA's) seconds a trained parameter a step
  // The step's other nodes on its critical path (data, frozen encoders, metrics) at `rows` rows a
  // replica (in proportion to them without `other_at`).
  double other_s = 0;
  std::vector<double> other_at;  // at `sizes` rows a replica
  double flops_per_row = 0;  // a training step's model FLOPs a row (MFU; 0: not known)
  int experts = 0;           // a mixture of experts: the experts a sparse layer has (what ep must divide; 0: none)
  double params() const;
  double trained() const;  // the parameters not frozen
};

struct Cluster {
  int devices = 1;
  int per_node = 1;
  Link intra, inter;        // within a node, between nodes
  double memory_bytes = 0;  // per device; 0: unbounded
  // Devices that are processes sharing a node's `cores` (a CPU), each with `threads` of them;
  // cores 0: each device its own (accelerators). More devices than the cores hold: predict()
  // bounds the step by the node's work over its cores.
  int cores = 0, threads = 1;
  // The collectives as measured on the machine (flowrun plan --measure-links), per group size: a
  // time for each buffer size S (what every rank holds after it) measured, between them the line
  // through the two nearest, beyond them the fitted link (caches and the MPI library's change of
  // algorithm bend the curve: one line alone misses a buffer by up to half). A group size not
  // measured, or a group spanning nodes, takes the ring formulas over intra or inter.
  struct Curve {
    Link fit;
    std::vector<std::pair<double, double>> points;  // (bytes, seconds), bytes ascending
    double time(double S) const;
  };
  struct Measured {
    std::map<int, Curve> all_reduce, all_gather;  // a reduce-scatter costs an all-gather's
    std::map<int, Curve> send;                    // key 2: one message between two ranks
  } measured;

  // The link of a group whose ranks span `span` consecutive ranks (the mesh numbers tp fastest,
  // then pp, then dp: parallel/mesh.hpp).
  const Link& link(int span) const { return span <= per_node ? intra : inter; }
  // A collective of g ranks spanning `span` consecutive ranks over a buffer of S bytes.
  double all_reduce(double S, int g, int span) const;
  double all_gather(double S, int g, int span) const;
  double all_to_all(double S, int g, int span) const;  // over the ring formulas' links (not measured)
  double send(double S, int span) const;
};

struct Layout {
  int dp = 1, tp = 1, pp = 1;
  int ep = 1;  // expert parallel, cut out of dp (divides it)
  Zero zero = Zero::none;
  int checkpoint_every = 0;  // 0: none; 1: every block (checkpoint: blocks); k: every k-th
  int microbatches = 1;      // pp > 1: run.parallel.microbatches; else forward_backward's accumulate
  pipeline::Kind schedule = pipeline::Kind::one_f_one_b;
  int virtual_stages = 1;
  std::string str() const;  // "dp 2 x tp 1 x pp 2, zero states, checkpoint blocks, 4 micro-batches 1f1b"
};

struct Memory {
  double weights = 0, gradients = 0, optimizer = 0, ema = 0, activations = 0;
  double gathered = 0;  // ZeRO params: the whole blocks gathered from the shards (weights: the shards)
  double total() const { return weights + gradients + optimizer + ema + activations + gathered; }
};

struct Prediction {
  double step_s = 0;     // compute + comm + update + the other nodes
  double compute_s = 0;  // the forward and backward of the step's micro-batches (the pipeline's makespan)
  double comm_s = 0;     // communication not hidden behind compute (tensor parallel's within compute_s)
  double update_s = 0;   // the optimizer (and EMA) on this rank's share
  double bubble = 0;     // the pipeline's idle share on its first stage
  double other_s = 0;    // the other nodes (data, frozen encoders) on a replica's rows
  Memory memory;         // the fullest device's
  bool fits = true;      // within the cluster's memory
  std::string why;       // a layout that cannot run: why (empty otherwise)
  // Under pp: the model's blocks per chunk (pp x virtual_stages entries) the prediction cut them
  // into: run.parallel.stage_layers, so that the run cuts them as predicted.
  std::vector<int> stage_layers;
};

// The step of `global_rows` rows (all replicas together) under `l`.
Prediction predict(const Model& m, const Layout& l, const Cluster& c, double global_rows);

// The layouts of the cluster's devices worth predicting: dp x tp x pp = devices with tp up to
// `max_tp` (a power of two), pp up to the blocks; with experts (Model::experts) each ep dividing
// dp and the experts (a power of two; ZeRO none: not built under ep); each ZeRO stage (none with one replica);
// checkpointing none, every block or every other one; micro-batch counts whose rows divide evenly; under pp each
// schedule (interleaved with 2 chunks a stage where the blocks allow).
std::vector<Layout> layouts(const Model& m, const Cluster& c, double global_rows, int max_tp);

}  // namespace flowrun::parallel::cost
