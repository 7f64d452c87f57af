// The cost model of a layout (cost_model.hpp): the collectives' formulas, then predict() in the
// order a step runs (the cut into chunks, each chunk's operations, the schedule, the gradients'
// collectives, the update), then the memory of each stage, then the layouts worth predicting.
#include "parallel/cost_model.hpp"

#include <algorithm>
#include <cmath>
#include <optional>
#include <sstream>
#include <stdexcept>

namespace flowrun::parallel::cost {

// ---- collectives ------------------------------------------------------------------------------

std::pair<Link, double> fit_link(const std::vector<std::pair<double, double>>& points) {
  if (points.empty()) throw std::invalid_argument("fit_link: no points");
  double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const auto& [x, y] : points) {
    const double w = 1.0 / (y * y);
    sw += w, sx += w * x, sy += w * y, sxx += w * x * x, sxy += w * x * y;
  }
  const double det = sw * sxx - sx * sx;
  double slope = det != 0 ? (sw * sxy - sx * sy) / det : 0.0;
  double alpha = det != 0 ? (sy - slope * sx) / sw : points.front().second;
  if (alpha < 0) {  // the best line with latency 0: through the origin
    alpha = 0;
    slope = sxy / sxx;
  }
  const Link l{alpha, slope > 0 ? 1.0 / slope : 1e30};  // no measurable bandwidth term: unbounded
  double worst = 0;
  for (const auto& [x, y] : points) worst = std::max(worst, std::abs(l.time(x) - y) / y);
  return {l, worst};
}

double all_reduce_bytes(double S, int g) { return g <= 1 ? 0.0 : 2.0 * (g - 1) / g * S; }
double all_gather_bytes(double S, int g) { return g <= 1 ? 0.0 : static_cast<double>(g - 1) / g * S; }
double all_reduce_time(double S, int g, const Link& l) {
  return g <= 1 ? 0.0 : 2.0 * (g - 1) * (l.latency_s + S / (g * l.bytes_per_s));
}
double all_gather_time(double S, int g, const Link& l) {
  return g <= 1 ? 0.0 : (g - 1) * (l.latency_s + S / (g * l.bytes_per_s));
}

double all_to_all_time(double S, int g, const Link& l) { return all_gather_time(S, g, l); }

const char* name(Zero z) {
  switch (z) {
    case Zero::none: return "none";
    case Zero::states: return "states";
    case Zero::gradients: return "gradients";
    case Zero::params: return "params";
  }
  return "?";
}

double data_parallel_bytes(double grad_bytes, int g, Zero z) {
  // Reduce-scatter + all-gather move what one all-reduce moves; ZeRO params gathers once more.
  return all_reduce_bytes(grad_bytes, g) + (z == Zero::params ? all_gather_bytes(grad_bytes, g) : 0.0);
}

double tensor_parallel_bytes(double output_bytes, int t) { return 4 * all_reduce_bytes(output_bytes, t); }

double Cluster::Curve::time(double S) const {
  if (points.size() < 2 || S <= points.front().first || S >= points.back().first) return fit.time(S);
  const auto hi = std::lower_bound(points.begin(), points.end(), S, [](const auto& p, double s) { return p.first < s; });
  const auto lo = hi - 1;
  return lo->second + (hi->second - lo->second) * (S - lo->first) / (hi->first - lo->first);
}

namespace {
double measured_or(const std::map<int, Cluster::Curve>& m, int g, double S, double ring) {
  const auto it = m.find(g);
  return it == m.end() ? ring : it->second.time(S);
}
}  // namespace

double Cluster::all_reduce(double S, int g, int span) const {
  if (g <= 1) return 0.0;
  const double ring = all_reduce_time(S, g, link(span));
  return span <= per_node ? measured_or(measured.all_reduce, g, S, ring) : ring;
}
double Cluster::all_gather(double S, int g, int span) const {
  if (g <= 1) return 0.0;
  const double ring = all_gather_time(S, g, link(span));
  return span <= per_node ? measured_or(measured.all_gather, g, S, ring) : ring;
}
double Cluster::all_to_all(double S, int g, int span) const { return g <= 1 ? 0.0 : all_to_all_time(S, g, link(span)); }
double Cluster::send(double S, int span) const {
  return span <= per_node ? measured_or(measured.send, 2, S, link(span).time(S)) : link(span).time(S);
}

double Model::params() const {
  double n = first.params + last.params;
  for (const Block& b : blocks) n += b.params;
  return n;
}
double Model::trained() const {
  double n = first.params - first.frozen + last.params - last.frozen;
  for (const Block& b : blocks) n += b.params - b.frozen;
  return n;
}

std::string Layout::str() const {
  std::ostringstream s;
  s << "dp " << dp << (ep > 1 ? " (ep " + std::to_string(ep) + ")" : std::string()) << " x tp " << tp << " x pp " << pp << ", zero " << name(zero) << ", checkpoint "
    << (checkpoint_every == 0 ? "none" : checkpoint_every == 1 ? "blocks" : "every_" + std::to_string(checkpoint_every))
    << ", " << microbatches << " micro-batch" << (microbatches == 1 ? "" : "es");
  if (pp > 1) s << " " << pipeline::name(schedule) << (virtual_stages > 1 ? " x" + std::to_string(virtual_stages) : "");
  return s.str();
}

// ---- the step ---------------------------------------------------------------------------------

double activation_units(int t) { return 10.0 + 24.0 / static_cast<double>(t); }
double activations_held(int t) { return activation_units(t) / 34.0; }

double zero3_gathered(double others, double kept, double largest, double all) {
  return std::min(all, others + kept + 2 * largest);
}

namespace {

// The share of a split layer's tensors one tp rank holds.
double held(double split, int t) { return 1.0 - split + split / t; }
// The share of a block's parameters a rank holds: tp's split / t, the experts / e, the rest whole.
double held(const Block& b, int t, int e) { return 1.0 - b.split - b.experts + b.split / t + b.experts / e; }

// A time measured at m.rows rows (t; t0 at none) or along m.sizes (curve), at `rows` (Block's rule).
double time_at(const Model& m, double rows, double t, double t0, const std::vector<double>& curve) {
  const std::vector<double>& x = m.sizes;
  if (curve.size() < 2 || curve.size() != x.size()) return t0 + (t - t0) * rows / m.rows;
  if (rows >= x.back()) return curve.back() * rows / x.back();
  size_t hi = 1;
  while (hi + 1 < x.size() && x[hi] < rows) ++hi;  // the two measured sizes nearest: x[hi - 1], x[hi]
  const double v = curve[hi - 1] + (curve[hi] - curve[hi - 1]) * (rows - x[hi - 1]) / (x[hi] - x[hi - 1]);
  return std::max(v, 0.0);
}

// One stage's chunks and what they cost (per micro-batch) and hold.
struct Stage {
  std::vector<int> chunks;
  double params = 0;   // parameters a device of the stage holds (its tp share)
  double trained = 0;  // of them, not frozen
  double largest_block = 0;
  double experts = 0;      // of `trained`: experts (split over ep)
  double kept_blocks = 0;  // the parameters of its blocks not recomputed (autograd keeps them: ZeRO-3 gathered)
};

}  // namespace

Prediction predict(const Model& m, const Layout& l, const Cluster& c, double global_rows) {
  Prediction out;
  const int d = l.dp, t = l.tp, p = l.pp, M = l.microbatches, V = l.pp > 1 ? l.virtual_stages : 1;
  if (d * t * p != c.devices) {
    out.fits = false;
    out.why = "dp x tp x pp is not the " + std::to_string(c.devices) + " devices";
    return out;
  }
  const int e = l.ep;
  if (e < 1 || d % e || (e > 1 && (m.experts == 0 || m.experts % e))) {
    out.fits = false;
    out.why = m.experts == 0 && e > 1 ? "no experts to split over ep"
                                      : "ep " + std::to_string(e) + " does not divide dp " + std::to_string(d) +
                                            " and the " + std::to_string(m.experts) + " experts";
    return out;
  }
  const double rows = global_rows / (static_cast<double>(d) * M);
  if (rows < 1 || std::abs(rows - std::round(rows)) > 1e-9) {
    out.fits = false;
    out.why = "the " + std::to_string(static_cast<int64_t>(global_rows)) + " rows do not split into " +
              std::to_string(d) + " replicas x " + std::to_string(M) + " micro-batches";
    return out;
  }
  const double scale = rows / m.rows;  // activation bytes grow with the rows
  // A block's forward and backward at this micro-batch's rows, on a device; under tensor parallel
  // a rank's share of it (`share` of its products): what the whole block costs at that share of
  // the rows (the same FLOPs, as many calls: a narrow product is no cheaper a call than a short one).
  auto fwd = [&](const Block& b, double share = 1) {
    return time_at(m, rows * share, b.fwd_s, b.fwd0_s, b.fwd_at);
  };
  auto bwd = [&](const Block& b, double share = 1) {
    return time_at(m, rows * share, b.bwd_s, b.bwd0_s, b.bwd_at);
  };
  auto recompute = [&](const Block& b, double share = 1) {
    return b.rec_s < 0 ? fwd(b, share) : time_at(m, rows * share, b.rec_s, b.rec0_s, b.rec_at);
  };
  const int C = p * V;
  const int nb = static_cast<int>(m.blocks.size());
  if (nb < C) {
    out.fits = false;
    out.why = std::to_string(nb) + " blocks do not cut into " + std::to_string(C) + " chunks";
    return out;
  }

  // The cut: balanced by each block's time, the first and last layers with the end chunks (the
  // model nodes cut by their analytic costs; measured times make the same cut where they agree).
  std::vector<double> block_cost;
  for (const Block& b : m.blocks) block_cost.push_back(fwd(b) + bwd(b));
  const auto cut = pipeline::balance(block_cost, C, fwd(m.first) + bwd(m.first),
                                     fwd(m.last) + bwd(m.last));
  if (p > 1)
    for (const auto& [first, end] : cut) out.stage_layers.push_back(end - first);

  // Each chunk's operations for one micro-batch: its blocks' share of the products under tp, the
  // recomputes, tp's all-reduces on the critical path, and (between stages) the activation's send.
  auto recomputed = [&](int i) { return l.checkpoint_every > 0 && i % l.checkpoint_every == 0; };
  std::vector<double> F(C, 0.0), B(C, 0.0), W(C, 0.0);
  for (int k = 0; k < C; ++k) {
    for (int i = cut[k].first; i < cut[k].second; ++i) {
      const Block& b = m.blocks[i];
      const double f = fwd(b, held(b.split, t));
      const double tp_ar = c.all_reduce(b.output_bytes * scale, t, t);
      // Expert parallel: dispatch and combine, forward and again backward (the ep ranks: dp
      // neighbours, t x p apart).
      const double a2a = e > 1 ? c.all_to_all(b.routed_bytes * scale, e, (e - 1) * t * p + 1) : 0.0;
      F[k] += f + 2 * tp_ar + 2 * a2a;
      // Backward is the input's gradient and the weights' (about half each: two products for one
      // forward product); a recomputed block runs its forward (and its all-reduces) first.
      const double bw = bwd(b, held(b.split, t));
      B[k] += bw / 2 + 2 * tp_ar + 2 * a2a + (recomputed(i) ? recompute(b, held(b.split, t)) + 2 * tp_ar + 2 * a2a : 0.0);
      W[k] += bw / 2;
    }
    if (k == 0) F[k] += fwd(m.first), B[k] += bwd(m.first);
    if (k == C - 1) F[k] += fwd(m.last), B[k] += bwd(m.last);
    if (p > 1) {
      const double send = c.send(m.blocks[cut[k].second - 1].output_bytes * scale, t * p);
      if (k < C - 1) F[k] += send;  // its output on to the next stage
      if (k > 0) B[k] += send;      // the gradient of its input back
    }
  }
  std::optional<pipeline::Schedule> sched;  // under pp: its programs also say what each stage holds
  if (p == 1) {
    for (int k = 0; k < C; ++k) out.compute_s += M * (F[k] + B[k] + W[k]);
  } else {
    pipeline::Config pc;
    pc.stages = p, pc.microbatches = M, pc.kind = l.schedule, pc.virtual_stages = V;
    pc.f = F;
    if (l.schedule == pipeline::Kind::zero_bubble) {
      pc.b = B, pc.w = W;
    } else {
      for (int k = 0; k < C; ++k) pc.b.push_back(B[k] + W[k]);
      pc.w.assign(C, 0.0);
    }
    try {
      pc.check();
    } catch (const std::exception& e) {
      out.fits = false;
      out.why = e.what();
      return out;
    }
    sched = pipeline::make(pc);
    out.compute_s = sched->makespan;
    out.bubble = sched->bubble(0);
  }

  // The stages: their parameters (a device's share) and largest block.
  std::vector<Stage> stages(p);
  for (int k = 0; k < C; ++k) {
    Stage& st = stages[k % p];
    st.chunks.push_back(k);
    for (int i = cut[k].first; i < cut[k].second; ++i) {
      const Block& b = m.blocks[i];
      const double share = held(b, t, e), n = b.params * share;
      st.params += n;
      st.trained += (b.params - b.frozen) * share;
      if (e > 1) st.experts += b.params * b.experts / e;  // trained (no LoRA on experts); at ep 1 reduced with the rest
      st.largest_block = std::max(st.largest_block, n);
      if (!recomputed(i)) st.kept_blocks += n;
    }
    auto whole = [](Stage& st, const Block& b) { st.params += b.params, st.trained += b.params - b.frozen; };
    if (k == 0) whole(stages[0], m.first);
    if (k == C - 1) {
      whole(stages[(C - 1) % p], m.last);
      if (m.tied && p > 1) whole(stages[(C - 1) % p], m.first);
    }
  }

  // The gradients' collectives over the dp group (its ranks t x p apart): the all-reduce, or
  // ZeRO's reduce-scatter, overlap the last micro-batch's backward without pipeline stages (a
  // stage's go after its last operation); ZeRO states and gradients all-gather the updated
  // parameters after the update; ZeRO params gathers each block for its forward and backward
  // (prefetched: hidden behind the compute they precede, as far as it lasts), once a step for a
  // pipeline stage (held for its micro-batches), once a micro-batch otherwise.
  double busiest = 0, experts = 0;  // the most trained parameters a stage's device holds; of them, experts
  for (const Stage& st : stages)
    if (st.trained > busiest) busiest = st.trained, experts = st.experts;
  const int dp_span = (d - 1) * t * p + 1;
  const double grads = busiest * m.grad_bytes, weights = busiest * m.weight_bytes;
  // Expert parallel: the experts' gradients over the d / e ranks holding the same ones (e t p apart).
  const double reduce = c.all_reduce(grads - experts * m.grad_bytes, d, dp_span) +
                        (e > 1 ? c.all_reduce(experts * m.grad_bytes, d / e, (d / e - 1) * e * t * p + 1) : 0.0);
  double backward_last = 0;
  for (int k = 0; k < C; ++k) backward_last += B[k] + W[k];
  double comm = std::max(0.0, reduce - (p == 1 ? backward_last : 0.0));
  if (l.zero == Zero::states || l.zero == Zero::gradients) comm += c.all_gather(weights, d, dp_span);
  if (l.zero == Zero::params) {
    const double gathers = 2 * c.all_gather(weights, d, dp_span) * (p == 1 ? M : 1);
    comm += std::max(0.0, gathers - out.compute_s);
  }
  out.comm_s = comm;
  out.update_s = busiest * m.update_s_per_param / (l.zero == Zero::none ? 1 : d);
  // The other nodes work on the replica's rows (data, frozen encoders: each replica its share).
  out.other_s = time_at(m, global_rows / d, m.other_s, 0.0, m.other_at);
  out.step_s = out.compute_s + out.comm_s + out.update_s + out.other_s;

  // Devices that share a node's cores (processes on a CPU, more of them than the cores hold): a
  // device that waits (a bubble, a collective) lends its core to another, so the step is at least
  // the node's devices' work over its cores, each device's work its own operations at the speed
  // the profile measured with the cores busy (its micro-batches' F, B and W, the update, the other
  // nodes), whatever the schedule leaves idle.
  if (c.cores > 0 && c.per_node * c.threads > c.cores) {
    double node_work = 0;
    const int devices = std::min(c.per_node, c.devices);
    for (int s = 0; s < p; ++s) {
      double busy = out.update_s + out.other_s;
      for (int k : stages[s].chunks) busy += M * (F[k] + B[k] + W[k]);
      node_work += busy * devices / p;  // the node's devices hold each stage alike
    }
    out.step_s = std::max(out.step_s, node_work * c.threads / c.cores);
  }

  // ---- memory: each stage's device, the fullest kept
  for (int s = 0; s < p; ++s) {
    const Stage& st = stages[s];
    Memory mem;
    const double zero_d = static_cast<double>(d);
    // Weights: ZeRO params keeps 1/d of every parameter (frozen ones too: a flat buffer of their
    // own, train/fully_sharded.hpp), and gathers a stage's whole for its step (pipeline: held for
    // its micro-batches), else what zero3_gathered says (one rule with forward_backward's).
    mem.weights = st.params * m.weight_bytes;
    if (l.zero == Zero::params && d > 1) {
      double blocks = 0;
      for (int k : st.chunks)
        for (int i = cut[k].first; i < cut[k].second; ++i) blocks += m.blocks[i].params * held(m.blocks[i], t, e);
      const double gathered =
          p > 1 ? st.params : zero3_gathered(st.params - blocks, st.kept_blocks, st.largest_block, st.params);
      mem.weights = st.params * m.weight_bytes / zero_d;
      mem.gathered = gathered * m.weight_bytes;
    }
    // Gradients: autograd's and, with several replicas and without ZeRO gradients, flowrun's two
    // buffers that the all-reduce reads (forward_backward's grad_layout); ZeRO gradients and params:
    // autograd's, each freed once reduce-scattered, and this rank's 1/d.
    const double g = st.trained * m.grad_bytes;
    mem.gradients = (l.zero == Zero::gradients || l.zero == Zero::params) ? g * (1 + 1 / zero_d) : g * (d > 1 ? 3 : 1);
    mem.optimizer = st.trained * m.optimizer_bytes / (l.zero == Zero::none ? 1 : zero_d);
    mem.ema = st.trained * m.ema_bytes / (l.zero == Zero::params ? zero_d : 1);
    // Activations: one micro-batch's of each block (a recomputed one: its output, and one block's
    // whole while it is recomputed), for the (block, micro-batch) pairs the schedule holds at once.
    double per_mb = 0, live = 0;
    int blocks = 0;
    for (int k : st.chunks)
      for (int i = cut[k].first; i < cut[k].second; ++i) {
        const Block& b = m.blocks[i];
        const double whole = b.activation_bytes * scale * activations_held(t);
        per_mb += recomputed(i) ? b.output_bytes * scale : whole;
        live = std::max(live, recomputed(i) ? whole : 0.0);
        ++blocks;
      }
    if (s == (C - 1) % p) per_mb += m.last.activation_bytes * scale;
    // Without stages one micro-batch at a time (accumulate); with them the (block, micro-batch)
    // pairs the stage's program holds at once, in micro-batches' worth of its blocks.
    const double in_flight = sched && blocks > 0 ? static_cast<double>(sched->peak_blocks_held(s, cut)) / blocks : 1.0;
    mem.activations = per_mb * in_flight + live;
    if (mem.total() > out.memory.total()) out.memory = mem;
  }
  if (c.memory_bytes > 0 && out.memory.total() > c.memory_bytes) {
    out.fits = false;
    out.why = "needs more memory than a device has";
  }
  return out;
}

// ---- the layouts ------------------------------------------------------------------------------

std::vector<Layout> layouts(const Model& m, const Cluster& c, double global_rows, int max_tp) {
  std::vector<Layout> out;
  const int n = c.devices, blocks = static_cast<int>(m.blocks.size());
  auto divides = [](double rows, int by) { return by > 0 && std::fmod(rows, by) == 0; };
  for (int t = 1; t <= std::min(max_tp, n); t *= 2) {
    if (n % t) continue;
    for (int p = 1; p <= n / t && p <= blocks; ++p) {
      if ((n / t) % p) continue;
      const int d = n / (t * p);
      if (!divides(global_rows, d)) continue;
      const double replica_rows = global_rows / d;
      std::vector<Zero> zeros{Zero::none};
      if (d > 1) zeros = {Zero::none, Zero::states, Zero::gradients, Zero::params};
      std::vector<std::pair<pipeline::Kind, int>> schedules{{pipeline::Kind::one_f_one_b, 1}};
      if (p > 1) {
        schedules = {{pipeline::Kind::gpipe, 1}, {pipeline::Kind::one_f_one_b, 1}, {pipeline::Kind::zero_bubble, 1}};
        if (blocks >= 2 * p) schedules.push_back({pipeline::Kind::interleaved, 2});
      }
      std::vector<int> eps{1};
      for (int ep = 2; ep <= d && m.experts > 0; ep *= 2)
        if (d % ep == 0 && m.experts % ep == 0) eps.push_back(ep);
      for (int ep : eps)
      for (Zero z : zeros)
        if (ep == 1 || z == Zero::none)
        for (int ckpt : {0, 1, 2})  // none, every block, every other block (checkpoint: every_2)
          if (ckpt < 2 || blocks / p >= 2)
          for (int M = p > 1 ? p : 1; M <= std::min(replica_rows, 64.0); M *= 2) {
            if (!divides(replica_rows, M)) continue;
            for (const auto& [kind, V] : schedules) {
              if (kind == pipeline::Kind::interleaved && M % p) continue;
              Layout l;
              l.dp = d, l.tp = t, l.pp = p, l.ep = ep, l.zero = z, l.checkpoint_every = ckpt, l.microbatches = M;
              l.schedule = kind, l.virtual_stages = V;
              out.push_back(l);
            }
          }
    }
  }
  return out;
}

}  // namespace flowrun::parallel::cost
