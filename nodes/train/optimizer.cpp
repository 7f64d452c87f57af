// optimizer: AdamW, SGD with momentum or Adafactor, decoupled weight decay, grad-norm clipping and
// a learning-rate schedule. Schema: schemas/optimizer.yaml. Test: tests/nodes/optimizer_test.cpp.
#include "train/optimizer.hpp"

#include <spdlog/spdlog.h>

#include <ATen/Parallel.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>

#include "comm.hpp"
#include "common/cpu_simd.hpp"
#include "common/device.hpp"
#include "common/state_io.hpp"
#include "registry.hpp"

namespace flowrun {

OptimKind optim_kind(const std::string& name) {
  if (name == "adamw") return OptimKind::adamw;
  if (name == "sgd") return OptimKind::sgd;
  if (name == "adafactor") return OptimKind::adafactor;
  throw std::invalid_argument("unknown optimizer kind '" + name + "' (adamw, sgd or adafactor)");
}

LrDecay lr_decay(const std::string& name) {
  if (name == "constant") return LrDecay::constant;
  if (name == "cosine") return LrDecay::cosine;
  if (name == "linear") return LrDecay::linear;
  throw std::invalid_argument("unknown lr schedule '" + name + "' (constant, cosine or linear)");
}

double LrSchedule::at(int64_t step, int64_t last_step) const {
  if (warmup > 0 && step <= warmup) return lr * static_cast<double>(step) / static_cast<double>(warmup);
  if (kind == LrDecay::constant || last_step <= warmup) return lr;
  double progress = static_cast<double>(step - warmup) / static_cast<double>(last_step - warmup);
  progress = std::min(1.0, std::max(0.0, progress));
  if (kind == LrDecay::cosine) return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * progress));
  return lr - (lr - min_lr) * progress;  // linear
}

std::pair<int64_t, int64_t> adafactor_factored_dims(c10::IntArrayRef shape, int64_t min_dim_size_to_factor) {
  if (shape.size() < 2) return {-1, -1};
  std::vector<int64_t> order(shape.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return shape[x] < shape[y]; });
  const int64_t a = order[order.size() - 1], b = order[order.size() - 2];
  if (shape[b] < min_dim_size_to_factor) return {-1, -1};
  return {a, b};
}

namespace {

// Whether a slot's parameter decays: its own flag (a sharded piece), else decays() of the tensor.
bool slot_decays(const OptimizerState::Slot& s, const torch::Tensor& p) { return s.decay >= 0 ? s.decay != 0 : decays(p); }

// Adafactor's direction for one parameter (optimizer.hpp, OptimConfig::adafactor), its slot's
// moments updated in place; s.step is this update's t (1-based).
torch::Tensor adafactor_direction(OptimizerState::Slot& s, const torch::Tensor& g0, const AdafactorConfig& c) {
  const torch::Tensor g = g0.to(torch::kFloat);
  const double beta2 = std::min(c.beta2_cap, 1.0 - std::pow(static_cast<double>(s.step), -c.decay_rate));
  const torch::Tensor r = g.square().add_(c.eps);
  torch::Tensor u;
  if (s.v_row.defined()) {
    const auto [a, b] = adafactor_factored_dims(g.sizes(), 0);  // the slot was made factored: same dims
    s.v_row.mul_(beta2).add_(r.mean(a), 1.0 - beta2);
    s.v_col.mul_(beta2).add_(r.mean(b), 1.0 - beta2);
    const int64_t b_in_row = b > a ? b - 1 : b;  // dim b of p within v_row (dim a removed)
    const torch::Tensor row = (s.v_row / s.v_row.mean(b_in_row, /*keepdim=*/true)).rsqrt();
    u = g * row.unsqueeze(a) * s.v_col.rsqrt().unsqueeze(b);
  } else {
    s.v.mul_(beta2).add_(r, 1.0 - beta2);
    u = g * s.v.rsqrt();
  }
  if (c.clipping_threshold > 0) {  // clip_by_block_rms
    const torch::Tensor rms = u.square().mean().sqrt();
    u = u / torch::clamp_min(rms / c.clipping_threshold, 1.0);
  }
  if (c.momentum > 0) {
    s.exp_avg.mul_(c.momentum).add_(u, 1.0 - c.momentum);
    u = s.exp_avg;
  }
  return u.to(g0.dtype());
}

}  // namespace

std::map<std::string, torch::Tensor> OptimizerState::tensors() const {
  if (shard.sharded() && !slots.empty()) {
    // This rank holds pieces; collect_sharded_state gathered the whole tensors.
    if (gathered.empty())
      throw std::logic_error("the optimizer's state is sharded over the ranks: gather it with collect_sharded_state() "
                             "(on every rank) before listing its tensors");
    std::map<std::string, torch::Tensor> out = gathered;
    out["updates"] = torch::tensor(updates, torch::kInt64);
    return out;
  }
  std::map<std::string, torch::Tensor> out;
  // The fused path's step lives on the device (a read here, where a checkpoint copies anyway).
  const int64_t fused = fused_step.defined() ? static_cast<int64_t>(fused_step.item<double>()) : -1;
  for (const Slot& s : slots) {
    if (s.exp_avg.defined()) out[s.name + ".exp_avg"] = s.exp_avg;
    if (s.exp_avg_sq.defined()) out[s.name + ".exp_avg_sq"] = s.exp_avg_sq;
    if (s.momentum.defined()) out[s.name + ".momentum_buffer"] = s.momentum;
    if (s.v_row.defined()) out[s.name + ".v_row"] = s.v_row;
    if (s.v_col.defined()) out[s.name + ".v_col"] = s.v_col;
    if (s.v.defined()) out[s.name + ".v"] = s.v;
    out[s.name + ".step"] = torch::tensor(fused >= 0 ? fused : s.step, torch::kInt64);
  }
  out["updates"] = torch::tensor(updates, torch::kInt64);
  return out;
}

namespace {

// AdamW on a GPU with libtorch >= 2: the update below, as torch's fused multi-tensor kernel
// (torch.optim.AdamW(fused=True)): one launch for all parameters of a group instead of ~8 per
// parameter. Same math (decoupled decay, bias corrections, eps outside the sqrt); the clip
// factor enters as the kernel's grad_scale (it divides: 1 / coef), a non-finite step's flag
// as its found_inf (the kernel then changes nothing, and the step tensor does not advance).
// Two groups: parameters that decay and those that do not (decays()).
//
// fused_adamw_applies says whether it applies: not for CPU tensors, an older libtorch, mixed
// devices or dtypes, a parameter without a gradient this step, or moments of different ages
// (a parameter that once had no gradient); the loop below then runs.
bool fused_adamw_applies(const OptimizerState& st, const ModelState::Named& params, const Grads& grads) {
#if TORCH_VERSION_MAJOR >= 2
  if (params.empty() || !params.front().second.is_cuda()) return false;
  const torch::Device device = params.front().second.device();
  const auto dtype = params.front().second.scalar_type();
  for (size_t i = 0; i < params.size(); ++i)
    if (!grads[i].defined() || params[i].second.device() != device || params[i].second.scalar_type() != dtype ||
        grads[i].scalar_type() != dtype)
      return false;
  // All parameters take this step together, so one step tensor serves every one of them.
  for (const auto& s : st.slots)
    if (s.step != st.slots.front().step) return false;
  return true;
#else
  (void)st, (void)params, (void)grads;
  return false;
#endif
}

void fused_adamw(OptimizerState& st, const ModelState::Named& params, const Grads& grads, const OptimConfig& cfg,
                 double lr, const torch::Tensor& coef, const torch::Tensor& found_inf) {
#if TORCH_VERSION_MAJOR >= 2
  const torch::Device device = params.front().second.device();
  if (!st.fused_step.defined())
    st.fused_step = torch::full({}, static_cast<double>(st.slots.front().step),
                                torch::TensorOptions().dtype(torch::kFloat).device(device));
  // step += 1 - found: a skipped update does not count (torch's fused AdamW does the same).
  if (found_inf.defined())
    st.fused_step.sub_(found_inf).add_(1);
  else
    st.fused_step.add_(1);
  std::vector<at::Tensor> p[2], g[2], m[2], v[2], steps[2];
  for (size_t i = 0; i < params.size(); ++i) {
    OptimizerState::Slot& s = st.slots[i];
    torch::Tensor w = params[i].second;
    if (!s.exp_avg.defined()) s.exp_avg = torch::zeros_like(w, at::MemoryFormat::Preserve);
    if (!s.exp_avg_sq.defined()) s.exp_avg_sq = torch::zeros_like(w, at::MemoryFormat::Preserve);
    s.step += 1;  // the host's count; fused_step is the truth (tensors() reports it)
    const int k = slot_decays(s, w) ? 0 : 1;
    p[k].push_back(w);
    g[k].push_back(grads[i]);
    m[k].push_back(s.exp_avg);
    v[k].push_back(s.exp_avg_sq);
  }
  c10::optional<at::Tensor> scale, found;
  if (coef.defined()) scale = coef.reciprocal().to(torch::kFloat);
  if (found_inf.defined()) found = found_inf;
  for (int k = 0; k < 2; ++k) {
    if (p[k].empty()) continue;
    steps[k].assign(p[k].size(), st.fused_step);
    at::_fused_adamw_(p[k], g[k], m[k], v[k], /*max_exp_avg_sqs=*/{}, steps[k], lr, cfg.beta1, cfg.beta2,
                      k == 0 ? cfg.weight_decay : 0.0, cfg.eps, /*amsgrad=*/false, /*maximize=*/false, scale, found);
  }
#else
  (void)st, (void)params, (void)grads, (void)cfg, (void)lr, (void)coef, (void)found_inf;
  throw std::logic_error("fused_adamw: this libtorch has no fused AdamW (check fused_adamw_applies first)");
#endif
}

// Leaving the fused path (or loading a state): each slot's host step from the device's.
void settle_fused_step(OptimizerState& st) {
  if (!st.fused_step.defined()) return;
  const auto step = static_cast<int64_t>(st.fused_step.item<double>());
  for (auto& s : st.slots) s.step = step;
  st.fused_step = torch::Tensor();
}

// AdamW and SGD on the CPU for fp32 parameters: every update is one pass over its tensors,
// 8 floats at a time, instead of the ~10 passes of tensor operations (each reading and writing
// whole tensors) that the generic update below takes. Same formulas, same order per element:
//   AdamW: g' = g * clip;  m = b1 m + (1 - b1) g';  v = b2 v + (1 - b2) g'^2
//          p  = p (1 - lr wd)  -  (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps)
//   SGD:   g' = g * clip;  m = mu m + g' (momentum; m starts at 0, so m = g' the first time)
//          p  = p (1 - lr wd)  -  lr m        (or - lr g' without momentum)
// (decay = 1 - lr wd only where decays(p), else 1; bc1, bc2 = 1 - b^t for the slot's step t).
struct AdamwStep {
  float clip, b1, b2, decay, step_size, sqrt_bc2, eps;
};
struct SgdStep {
  float clip, decay, lr, momentum;
};

#if FLOWRUN_HAVE_AVX2_CODE
// An element's result must not depend on where a range starts or ends (a rank's slice of a
// buffer, shard: states, is updated as the whole buffer is, bit for bit): every element goes
// through the same 8-lane code, the last few of a range too (padded with zeros in a local
// block), and no multiply-add is contracted into an FMA, which the compiler may do in one
// inlined copy and not another (seen: one lane of a tail differed).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
template <class Body>
FLOWRUN_AVX2 inline void by_8_lanes(float* p, const float* g, float* m, float* v, int64_t b, int64_t e, const Body& body) {
  int64_t i = b;
  for (; i + 8 <= e; i += 8) body(p + i, g + i, m ? m + i : nullptr, v ? v + i : nullptr);
  if (i == e) return;
  const int64_t n = e - i;
  alignas(32) float tp[8] = {}, tg[8] = {}, tm[8] = {}, tv[8] = {};
  std::copy(p + i, p + e, tp), std::copy(g + i, g + e, tg);
  if (m) std::copy(m + i, m + e, tm);
  if (v) std::copy(v + i, v + e, tv);
  body(tp, tg, m ? tm : nullptr, v ? tv : nullptr);
  std::copy(tp, tp + n, p + i);
  if (m) std::copy(tm, tm + n, m + i);
  if (v) std::copy(tv, tv + n, v + i);
}

FLOWRUN_AVX2 void adamw_cpu_kernel(float* p, const float* g, float* m, float* v, int64_t b, int64_t e,
                                   const AdamwStep& k) {
  const __m256 clip = _mm256_set1_ps(k.clip), b1 = _mm256_set1_ps(k.b1), c1 = _mm256_set1_ps(1.0f - k.b1);
  const __m256 b2 = _mm256_set1_ps(k.b2), c2 = _mm256_set1_ps(1.0f - k.b2), decay = _mm256_set1_ps(k.decay);
  const __m256 step = _mm256_set1_ps(k.step_size), sbc2 = _mm256_set1_ps(k.sqrt_bc2), eps = _mm256_set1_ps(k.eps);
  by_8_lanes(p, g, m, v, b, e, [&](float* pp, const float* gg, float* mm, float* vv) FLOWRUN_AVX2 {
    const __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(gg), clip);
    const __m256 mi = _mm256_add_ps(_mm256_mul_ps(b1, _mm256_loadu_ps(mm)), _mm256_mul_ps(c1, gi));
    const __m256 vi = _mm256_add_ps(_mm256_mul_ps(b2, _mm256_loadu_ps(vv)), _mm256_mul_ps(_mm256_mul_ps(c2, gi), gi));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), sbc2), eps);
    const __m256 pi = _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(pp), decay),
                                    _mm256_div_ps(_mm256_mul_ps(step, mi), denom));
    _mm256_storeu_ps(mm, mi);
    _mm256_storeu_ps(vv, vi);
    _mm256_storeu_ps(pp, pi);
  });
}

// m == nullptr: no momentum.
FLOWRUN_AVX2 void sgd_cpu_kernel(float* p, const float* g, float* m, int64_t b, int64_t e, const SgdStep& k) {
  const __m256 clip = _mm256_set1_ps(k.clip), decay = _mm256_set1_ps(k.decay), lr = _mm256_set1_ps(k.lr);
  const __m256 mu = _mm256_set1_ps(k.momentum);
  by_8_lanes(p, g, m, nullptr, b, e, [&](float* pp, const float* gg, float* mm, float*) FLOWRUN_AVX2 {
    __m256 d = _mm256_mul_ps(_mm256_loadu_ps(gg), clip);
    if (mm) {
      d = _mm256_add_ps(_mm256_mul_ps(mu, _mm256_loadu_ps(mm)), d);
      _mm256_storeu_ps(mm, d);
    }
    _mm256_storeu_ps(pp, _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(pp), decay), _mm256_mul_ps(lr, d)));
  });
}
#if !defined(__clang__) && defined(__GNUC__)
#pragma GCC pop_options
#endif
#else
void adamw_cpu_kernel(float*, const float*, float*, float*, int64_t, int64_t, const AdamwStep&) {}
void sgd_cpu_kernel(float*, const float*, float*, int64_t, int64_t, const SgdStep&) {}
#endif

// One tensor's share of a CPU update: its pointers and the constants of its step.
struct CpuPiece {
  float* p;
  const float* g;
  float* m;  // adamw: first moment; sgd: momentum (or nullptr)
  float* v;  // adamw: second moment
  int64_t n;
  AdamwStep adamw;
  SgdStep sgd;
};

// Runs fn(piece, begin, end) over the elements of all pieces as one index range, cut into
// chunks of kChunk elements that the OpenMP threads share: one parallel region per update, not
// one per tensor, and small tensors share a chunk (multi-tensor apply, as torch's _foreach
// kernels on a GPU). The chunks do not depend on the number of threads.
constexpr int64_t kChunk = 32768;

template <class Fn>
void for_each_chunk(const std::vector<CpuPiece>& pieces, const Fn& fn) {
  std::vector<int64_t> start(pieces.size() + 1, 0);
  for (size_t j = 0; j < pieces.size(); ++j) start[j + 1] = start[j] + pieces[j].n;
  const int64_t total = start.back();
  at::parallel_for(0, (total + kChunk - 1) / kChunk, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const int64_t b = c * kChunk, e = std::min(total, b + kChunk);
      auto j = static_cast<size_t>(std::upper_bound(start.begin(), start.end(), b) - start.begin() - 1);
      for (; j < pieces.size() && start[j] < e; ++j)
        fn(pieces[j], std::max(b, start[j]) - start[j], std::min(e, start[j + 1]) - start[j]);
    }
  });
}

// The CPU pass above for every parameter it applies to (fp32, contiguous, on the CPU, with a
// gradient; its moments made); marks them in `done`. Nothing on CPUs without AVX2.
void cpu_update(OptimizerState& st, const ModelState::Named& params, const Grads& grads, const OptimConfig& cfg,
                double lr, float clip, std::vector<char>& done) {
  if (!cpu_has_avx2() || cfg.kind == OptimKind::adafactor) return;
  auto ok = [](const torch::Tensor& t) {
    return t.defined() && t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.is_contiguous();
  };
  const bool adamw = cfg.kind == OptimKind::adamw;
  const bool momentum = !adamw && cfg.momentum > 0;
  std::vector<CpuPiece> pieces;
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& p = params[i].second;
    const torch::Tensor& g = grads[i];
    OptimizerState::Slot& s = st.slots[i];
    if (!ok(p) || !ok(g)) continue;
    if (adamw ? !(ok(s.exp_avg) && ok(s.exp_avg_sq)) : momentum && !ok(s.momentum)) continue;
    s.step += 1;
    const float decay = cfg.weight_decay > 0 && slot_decays(s, p) ? static_cast<float>(1.0 - lr * cfg.weight_decay) : 1.0f;
    CpuPiece c{p.data_ptr<float>(), g.data_ptr<float>(), nullptr, nullptr, p.numel(), {}, {}};
    if (adamw) {
      const double t = static_cast<double>(s.step);
      const double bc1 = 1.0 - std::pow(cfg.beta1, t), bc2 = 1.0 - std::pow(cfg.beta2, t);
      c.m = s.exp_avg.data_ptr<float>();
      c.v = s.exp_avg_sq.data_ptr<float>();
      c.adamw = {clip, static_cast<float>(cfg.beta1), static_cast<float>(cfg.beta2), decay,
                 static_cast<float>(lr / bc1), static_cast<float>(std::sqrt(bc2)), static_cast<float>(cfg.eps)};
    } else {
      if (momentum) c.m = s.momentum.data_ptr<float>();
      c.sgd = {clip, decay, static_cast<float>(lr), static_cast<float>(cfg.momentum)};
    }
    pieces.push_back(c);
    done[i] = 1;
    // Written through pointers: tell autograd the tensors changed, as in-place ops would.
    for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&p, &s.exp_avg, &s.exp_avg_sq, &s.momentum})
      if (t->defined()) torch::autograd::impl::bump_version(*t);
  }
  if (adamw)
    for_each_chunk(pieces, [](const CpuPiece& c, int64_t b, int64_t e) { adamw_cpu_kernel(c.p, c.g, c.m, c.v, b, e, c.adamw); });
  else
    for_each_chunk(pieces, [](const CpuPiece& c, int64_t b, int64_t e) { sgd_cpu_kernel(c.p, c.g, c.m, b, e, c.sgd); });
}

// Adafactor's second-moment tensors of a parameter of `shape`: factored, a row and a column
// statistic (v_row: the shape without dim a, v_col: without dim b); else one of the shape (v).
std::vector<std::pair<std::string, std::vector<int64_t>>> adafactor_stats(const std::vector<int64_t>& shape,
                                                                          int64_t min_dim_to_factor) {
  const auto [a, b] = adafactor_factored_dims(shape, min_dim_to_factor);
  if (a < 0) return {{".v", shape}};
  std::vector<int64_t> row = shape, col = shape;
  row.erase(row.begin() + a);
  col.erase(col.begin() + b);
  return {{".v_row", row}, {".v_col", col}};
}

// A slot's Adafactor statistics for parameter p, zeroed: tensors of their own (they are shaped
// otherwise than p, so they live outside the flat buffers).
void make_adafactor_stats(OptimizerState::Slot& s, const torch::Tensor& p, int64_t min_dim_to_factor) {
  for (const auto& [suffix, shape] : adafactor_stats(p.sizes().vec(), min_dim_to_factor)) {
    torch::Tensor& v = suffix == ".v" ? s.v : suffix == ".v_row" ? s.v_row : s.v_col;
    v = torch::zeros(shape, p.options());
  }
}

// The slots for these parameters, their moments zeroed in flat buffers (see OptimizerState),
// and what load() kept for them.
void make_slots(OptimizerState& st, const ModelState::Named& params, const OptimConfig& cfg) {
  st.slots.resize(params.size());
  std::vector<torch::Tensor> ps;
  for (size_t i = 0; i < params.size(); ++i) {
    st.slots[i].name = params[i].first;
    ps.push_back(params[i].second);
  }
  st.layout = FlatLayout::of(ps);
  auto make = [&](std::vector<torch::Tensor>& flat, torch::Tensor OptimizerState::Slot::*moment) {
    flat = st.layout.zeros();
    for (size_t i = 0; i < ps.size(); ++i) st.slots[i].*moment = st.layout.view(flat, i, ps[i].sizes());
  };
  if (cfg.kind == OptimKind::adamw) {
    make(st.flat_exp_avg, &OptimizerState::Slot::exp_avg);
    make(st.flat_exp_avg_sq, &OptimizerState::Slot::exp_avg_sq);
  } else if (cfg.kind == OptimKind::sgd && cfg.momentum > 0) {
    make(st.flat_momentum, &OptimizerState::Slot::momentum);
  } else if (cfg.kind == OptimKind::adafactor) {
    if (cfg.adafactor.momentum > 0) make(st.flat_exp_avg, &OptimizerState::Slot::exp_avg);
    for (size_t i = 0; i < ps.size(); ++i) make_adafactor_stats(st.slots[i], ps[i], cfg.adafactor.min_dim_size_to_factor);
  }
}

// The saved moments of a slot: copied into its moments where they exist (views into the flat
// buffers, on the parameter's device), else copies on `device` (the given tensors may be
// aliases their owner goes on changing; a checkpoint is read onto the CPU).
void load_slot(OptimizerState::Slot& s, const std::map<std::string, torch::Tensor>& t, const c10::Device& device) {
  torch::NoGradGuard no_grad;
  auto get = [&](const std::string& suffix, torch::Tensor& dst) {
    auto it = t.find(s.name + suffix);
    if (it == t.end()) return;
    if (!dst.defined()) {
      dst = it->second.detach().to(device, /*non_blocking=*/false, /*copy=*/true);
      return;
    }
    if (!dst.sizes().equals(it->second.sizes()))
      throw std::runtime_error("optimizer state: '" + s.name + suffix + "' has shape " + shape_str(it->second) +
                               ", the parameter is " + shape_str(dst) +
                               "; the state was saved for another model");
    dst.copy_(it->second);
  };
  get(".exp_avg", s.exp_avg);
  get(".exp_avg_sq", s.exp_avg_sq);
  get(".momentum_buffer", s.momentum);
  get(".v_row", s.v_row);
  get(".v_col", s.v_col);
  get(".v", s.v);
  auto it = t.find(s.name + ".step");
  if (it != t.end()) s.step = it->second.item<int64_t>();
}

}  // namespace

void OptimizerState::load(const std::map<std::string, torch::Tensor>& t) {
  fused_step = torch::Tensor();  // the loaded steps rule
  if (shard.sharded() && !slots.empty()) {
    // Whole tensors for a sharded state: kept, and sliced again at the next update.
    slots.clear();
    flat_exp_avg.clear(), flat_exp_avg_sq.clear(), flat_momentum.clear();
    shard = ShardPlan{};
    factor_min_dim = -1;
  }
  auto it = t.find("updates");
  if (it != t.end()) updates = it->second.item<int64_t>();
  if (slots.empty()) {
    // Copies now: the given tensors may be aliases that their owner goes on changing.
    pending.clear();
    for (const auto& [k, v] : t) pending[k] = v.detach().clone();
    return;
  }
  // Slots exist once an update ran, with moments where their parameters live.
  for (Slot& s : slots) {
    const torch::Tensor& m = s.exp_avg.defined() ? s.exp_avg : s.momentum;
    load_slot(s, t, m.defined() ? m.device() : c10::Device(c10::kCPU));
  }
}

torch::Tensor global_norm(const Grads& grads) {
  std::vector<torch::Tensor> given;
  given.reserve(grads.size());
  for (const auto& g : grads)
    if (g.defined()) given.push_back(g);
  if (given.empty()) return torch::zeros({}, torch::kFloat);
  bool foreach = !given.front().is_cpu();
  for (const auto& g : given)
    foreach = foreach && g.scalar_type() == torch::kFloat && g.device() == given.front().device();
  std::vector<torch::Tensor> norms;
  if (foreach) {
    norms = at::_foreach_norm(given, 2);
  } else {
    norms.reserve(given.size());
    for (const auto& g : given) norms.push_back(at::linalg_vector_norm(g, 2, c10::nullopt, false, torch::kFloat));
  }
  return at::linalg_vector_norm(torch::stack(norms), 2);
}

int64_t nonfinite_count(const OptimizerState& st) {
  return st.nonfinite.defined() ? static_cast<int64_t>(st.nonfinite.item<double>()) : 0;
}

torch::Tensor optimizer_update(OptimizerState& st, const ModelState::Named& params, const Grads& grads,
                               const OptimConfig& cfg, double lr, const torch::Tensor& norm_of_all) {
  torch::NoGradGuard no_grad;
  st.gathered.clear();  // a checkpoint's copy of the whole moments: stale from here on
  if (grads.size() != params.size())
    throw std::runtime_error("got " + std::to_string(grads.size()) + " grads for " + std::to_string(params.size()) +
                             " trainable parameters");
  const bool adamw = cfg.kind == OptimKind::adamw;
  for (size_t i = 0; i < params.size(); ++i)
    if (grads[i].defined() && !grads[i].sizes().equals(params[i].second.sizes()))
      throw std::runtime_error("grad " + std::to_string(i) + " (" + params[i].first + ") has shape " +
                               shape_str(grads[i]) + ", the parameter " + shape_str(params[i].second));
  if (st.slots.empty()) {
    make_slots(st, params, cfg);
    if (!st.pending.empty()) {
      for (size_t i = 0; i < params.size(); ++i) load_slot(st.slots[i], st.pending, params[i].second.device());
      st.pending.clear();
    }
  } else if (st.slots.size() != params.size()) {
    throw std::runtime_error("the model has " + std::to_string(params.size()) + " trainable parameters, the optimizer " +
                             "state was made for " + std::to_string(st.slots.size()));
  }

  torch::Tensor norm = norm_of_all.defined() ? norm_of_all : global_norm(grads);
  torch::Tensor coef;  // clip factor, kept on the device (no host sync)
  if (cfg.clip > 0) coef = torch::clamp_max(cfg.clip / (norm + 1e-6), 1.0);

  // Where the device can skip a non-finite step itself, the flag goes into the kernel and no
  // host reads it (defer_nonfinite); the count stays on the device too.
  if (adamw && cfg.defer_nonfinite && fused_adamw_applies(st, params, grads)) {
    const torch::Tensor found = norm.isfinite().logical_not().to(torch::kFloat);
    st.nonfinite = st.nonfinite.defined() ? st.nonfinite.add_(found) : found.clone();
    fused_adamw(st, params, grads, cfg, lr, coef, found);
    st.updates += 1;
    return norm;
  }
  if (!std::isfinite(norm.item<double>())) {
    if (cfg.skip_nonfinite || cfg.defer_nonfinite) {  // the caller counts and reports skipped steps
      torch::Tensor one = torch::ones({}, norm.options().dtype(torch::kFloat));
      st.nonfinite = st.nonfinite.defined() ? st.nonfinite.add_(one) : one;
      return norm;
    }
    throw NonFiniteGrads("the gradients are not finite (global norm " + std::to_string(norm.item<double>()) +
                         "): the loss diverged or overflowed; lower the lr, add clip, or set skip_nonfinite: true");
  }
  if (adamw && fused_adamw_applies(st, params, grads)) {
    fused_adamw(st, params, grads, cfg, lr, coef, torch::Tensor());
    st.updates += 1;
    return norm;
  }
  settle_fused_step(st);  // the paths below count steps on the host
  // The clip factor as a number, for the CPU kernels (a CPU tensor: reading it costs no sync).
  const float clip_cpu = coef.defined() && coef.device().is_cpu() ? coef.item<float>() : 1.0f;
  std::vector<char> done(params.size(), 0);
  cpu_update(st, params, grads, cfg, lr, clip_cpu, done);
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& g0 = grads[i];
    if (done[i] || !g0.defined()) continue;
    torch::Tensor p = params[i].second;
    OptimizerState::Slot& s = st.slots[i];
    torch::Tensor g = coef.defined() ? g0 * coef.to(g0.dtype()) : g0;
    s.step += 1;
    if (cfg.weight_decay > 0 && slot_decays(s, p)) p.mul_(1.0 - lr * cfg.weight_decay);
    if (cfg.kind == OptimKind::adafactor) {
      p.add_(adafactor_direction(s, g, cfg.adafactor), -lr);
    } else if (adamw) {
      if (!s.exp_avg.defined()) s.exp_avg = torch::zeros_like(p, at::MemoryFormat::Preserve);
      if (!s.exp_avg_sq.defined()) s.exp_avg_sq = torch::zeros_like(p, at::MemoryFormat::Preserve);
      s.exp_avg.mul_(cfg.beta1).add_(g, 1.0 - cfg.beta1);
      s.exp_avg_sq.mul_(cfg.beta2).addcmul_(g, g, 1.0 - cfg.beta2);
      const double t = static_cast<double>(s.step);
      const double bc1 = 1.0 - std::pow(cfg.beta1, t), bc2 = 1.0 - std::pow(cfg.beta2, t);
      torch::Tensor denom = (s.exp_avg_sq.sqrt() / std::sqrt(bc2)).add_(cfg.eps);
      p.addcdiv_(s.exp_avg, denom, -lr / bc1);
    } else if (cfg.momentum > 0) {
      if (!s.momentum.defined())
        s.momentum = g.detach().clone();
      else
        s.momentum.mul_(cfg.momentum).add_(g);
      p.add_(s.momentum, -lr);
    } else {
      p.add_(g, -lr);
    }
  }
  st.updates += 1;
  return norm;
}

void make_shard_slots(OptimizerState& st, const ShardPlan& plan, const ModelState::Named& params, const OptimConfig& cfg) {
  torch::NoGradGuard no_grad;
  const bool adafactor = cfg.kind == OptimKind::adafactor;
  if (adafactor && !plan.whole_tensors)
    throw std::logic_error("make_shard_slots: Adafactor's factored moments need a plan of whole tensors");
  if (params.size() != plan.layout.slots.size())
    throw std::runtime_error("the model has " + std::to_string(params.size()) + " trainable parameters, the shard plan "
                             "was made for " + std::to_string(plan.layout.slots.size()));
  st.shard = plan;
  st.layout = plan.layout;
  st.factor_min_dim = adafactor ? cfg.adafactor.min_dim_size_to_factor : -1;
  st.slots.assign(plan.pieces.size(), OptimizerState::Slot{});
  auto whole = [&](const ShardPlan::Piece& piece) {
    return piece.offset == 0 && piece.numel == plan.layout.slots[static_cast<size_t>(piece.param)].numel;
  };
  for (size_t k = 0; k < plan.pieces.size(); ++k) {
    const ShardPlan::Piece& piece = plan.pieces[k];
    st.slots[k].name = params[static_cast<size_t>(piece.param)].first;
    st.slots[k].decay = decays(params[static_cast<size_t>(piece.param)].second) ? 1 : 0;
  }
  // Moments for this rank's slice of each buffer only; a piece's are a view of them (shaped as
  // its parameter when the piece is a whole one, as shard_pieces gives it).
  auto make = [&](std::vector<torch::Tensor>& flat, torch::Tensor OptimizerState::Slot::*moment) {
    flat.clear();
    for (size_t g = 0; g < plan.groups.size(); ++g) {
      const FlatLayout::Group& lg = plan.layout.groups[g];
      flat.push_back(torch::zeros({plan.groups[g].end - plan.groups[g].begin},
                                  torch::TensorOptions().dtype(lg.dtype).device(lg.device)));
    }
    for (size_t k = 0; k < plan.pieces.size(); ++k) {
      const ShardPlan::Piece& piece = plan.pieces[k];
      torch::Tensor m = flat[static_cast<size_t>(piece.group)].narrow(0, piece.at, piece.numel);
      st.slots[k].*moment = whole(piece) ? m.view(plan.shapes[static_cast<size_t>(piece.param)]) : m;
    }
  };
  if (cfg.kind == OptimKind::adamw) {
    make(st.flat_exp_avg, &OptimizerState::Slot::exp_avg);
    make(st.flat_exp_avg_sq, &OptimizerState::Slot::exp_avg_sq);
  } else if (cfg.kind == OptimKind::sgd && cfg.momentum > 0) {
    make(st.flat_momentum, &OptimizerState::Slot::momentum);
  } else if (adafactor) {
    if (cfg.adafactor.momentum > 0) make(st.flat_exp_avg, &OptimizerState::Slot::exp_avg);
    for (size_t k = 0; k < plan.pieces.size(); ++k)  // whole parameters
      make_adafactor_stats(st.slots[k], params[static_cast<size_t>(plan.pieces[k].param)].second, st.factor_min_dim);
  }
  // A resume: this rank's piece of each whole saved moment.
  if (st.pending.empty()) return;
  for (size_t k = 0; k < plan.pieces.size(); ++k) {
    const ShardPlan::Piece& piece = plan.pieces[k];
    OptimizerState::Slot& s = st.slots[k];
    if (whole(piece)) {  // every tensor of its slot, shapes checked
      load_slot(s, st.pending, params[static_cast<size_t>(piece.param)].second.device());
      continue;
    }
    for (auto [suffix, moment] : {std::pair{".exp_avg", &s.exp_avg}, std::pair{".exp_avg_sq", &s.exp_avg_sq},
                                  std::pair{".momentum_buffer", &s.momentum}}) {
      auto it = st.pending.find(s.name + suffix);
      if (it == st.pending.end() || !moment->defined()) continue;
      if (it->second.numel() != plan.layout.slots[static_cast<size_t>(piece.param)].numel)
        throw std::runtime_error("optimizer state: '" + s.name + suffix + "' has shape " + shape_str(it->second) +
                                 ", the parameter has " +
                                 std::to_string(plan.layout.slots[static_cast<size_t>(piece.param)].numel) +
                                 " elements; the state was saved for another model");
      moment->copy_(it->second.reshape({-1}).narrow(0, piece.offset, piece.numel));
    }
    auto step = st.pending.find(s.name + ".step");
    if (step != st.pending.end()) s.step = step->second.item<int64_t>();
  }
  st.pending.clear();
}

void collect_sharded_state(OptimizerState& st, comm::Channel& ch) {
  const ShardPlan& plan = st.shard;
  if (!plan.sharded() || st.slots.empty()) return;
  torch::NoGradGuard no_grad;
  const size_t n = plan.layout.slots.size();
  // Each parameter's step: the pieces of a parameter share it; a rank without a piece says 0.
  std::vector<double> steps(n, 0.0);
  for (size_t k = 0; k < plan.pieces.size(); ++k)
    steps[static_cast<size_t>(plan.pieces[k].param)] = static_cast<double>(st.slots[k].step);
  comm::allreduce(ch, steps.data(), steps.size(), comm::Op::max, "optimizer steps for a checkpoint");
  std::map<std::string, torch::Tensor> out;
  auto gather = [&](const std::vector<torch::Tensor>& slices, const char* suffix) {
    if (slices.empty()) return;
    // Whole buffers, this rank's slice in place, the others' all-gathered into them.
    std::vector<torch::Tensor> whole;
    for (size_t g = 0; g < plan.groups.size(); ++g) {
      torch::Tensor b = torch::zeros({plan.groups[g].numel}, slices[g].options());
      b.narrow(0, plan.groups[g].begin, plan.groups[g].end - plan.groups[g].begin).copy_(slices[g]);
      whole.push_back(b);
    }
    allgather_slices(plan, whole, ch, std::string("optimizer moments ") + suffix + " for a checkpoint");
    for (size_t i = 0; i < n; ++i) out[plan.names[i] + suffix] = plan.layout.view(whole, i, plan.shapes[i]);
  };
  gather(st.flat_exp_avg, ".exp_avg");
  gather(st.flat_exp_avg_sq, ".exp_avg_sq");
  gather(st.flat_momentum, ".momentum_buffer");
  if (st.factor_min_dim >= 0) {
    // Adafactor's statistics, each held whole by its parameter's rank: one vector of all of
    // them, zeros where this rank holds none, summed over the ranks (x + 0 is exact).
    std::vector<std::pair<std::string, std::vector<int64_t>>> all;
    for (size_t i = 0; i < n; ++i)
      for (auto& [suffix, shape] : adafactor_stats(plan.shapes[i], st.factor_min_dim))
        all.emplace_back(plan.names[i] + suffix, shape);
    std::map<std::string, torch::Tensor> mine;
    for (const auto& s : st.slots)
      for (auto [suffix, t] : {std::pair{".v", &s.v}, std::pair{".v_row", &s.v_row}, std::pair{".v_col", &s.v_col}})
        if (t->defined()) mine[s.name + suffix] = *t;
    std::vector<int64_t> sizes;
    std::vector<torch::Tensor> parts;
    for (const auto& [name, shape] : all) {
      auto it = mine.find(name);
      parts.push_back(it != mine.end() ? it->second.reshape({-1}).to(torch::kDouble)
                                       : torch::zeros({c10::multiply_integers(shape)}, torch::kDouble));
      sizes.push_back(parts.back().numel());
    }
    torch::Tensor flat = torch::cat(parts).contiguous();
    comm::allreduce(ch, flat.data_ptr<double>(), static_cast<size_t>(flat.numel()), comm::Op::sum,
                    "Adafactor statistics for a checkpoint");
    int64_t at = 0;
    for (size_t j = 0; j < all.size(); ++j) {
      out[all[j].first] = flat.narrow(0, at, sizes[j]).to(torch::kFloat).view(all[j].second);
      at += sizes[j];
    }
  }
  for (size_t i = 0; i < n; ++i) out[plan.names[i] + ".step"] = torch::tensor(static_cast<int64_t>(steps[i]), torch::kInt64);
  st.gathered = std::move(out);
}

namespace {

class OptimizerNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const Params& p = ctx.params();
    cfg_.kind = optim_kind(p.get<std::string>("kind"));
    cfg_.momentum = p.get<double>("momentum");
    cfg_.beta1 = p.get<double>("beta1");
    cfg_.beta2 = p.get<double>("beta2");
    cfg_.eps = p.get<double>("eps");
    cfg_.weight_decay = p.get<double>("weight_decay");
    cfg_.clip = p.get<double>("clip");
    sched_.lr = p.get<double>("lr");
    sched_.warmup = p.get<int64_t>("warmup");
    sched_.kind = lr_decay(p.get<std::string>("schedule"));
    sched_.min_lr = p.get<double>("min_lr");
    cfg_.skip_nonfinite = p.get<bool>("skip_nonfinite");
    // ZeRO-1 (optimizer_shard.hpp): with several processes, this rank's slice of the moments
    // only (Adafactor: of whole parameters), and its channel to all-gather the updated
    // parameters (a collective node: a lane).
    // ZeRO-2 (shard: gradients): the gradients arrive as this rank's pieces already, which
    // forward_backward and the allreduce are told through the model's state.
    const std::string shard = p.get<std::string>("shard");
    shard_ = shard != "none" && ctx.run().world > 1;
    shard_grads_ = shard == "gradients" && ctx.run().world > 1;
    if (shard_) {
      if (!run_device(ctx.run()).is_cpu())
        throw std::runtime_error(ctx.who() + ": shard: " + shard + " all-gathers the parameters over MPI, on the CPU; on " +
                                 run_device(ctx.run()).str() + " (NCCL) it is not built yet: set shard: none");
      ch_ = comm::Channel::create(ctx.name());
    }
    if (shard_grads_) {
      // Only an allreduce turns the gradients forward_backward lets go of into this rank's slice.
      const std::vector<std::string> from = ctx.refs("grads");
      const std::string node = from.empty() ? "" : from.front().substr(0, from.front().find('.'));
      const int at = ctx.run().graph ? ctx.run().graph->index_of(node) : -1;
      if (at < 0 || ctx.run().graph->nodes[static_cast<size_t>(at)].type != "allreduce")
        throw std::runtime_error(ctx.who() + ": shard: gradients reduce-scatters the gradients in an allreduce node, but "
                                 "'grads' comes from '" + (from.empty() ? std::string("nowhere") : from.front()) +
                                 "': wire grads: SYNC.grads from an allreduce fed by forward_backward's ready, or set "
                                 "shard: states");
      ctx.state_as<ModelState>("model").shard_gradients = {true, cfg_.kind == OptimKind::adafactor};
    }
    // On a GPU no step reads the grad norm on the host: non-finite steps are skipped on the
    // device and counted, and the count is read on logged steps (check_nonfinite). On the CPU
    // reading it costs nothing, so the step that diverged stops the run itself.
    cfg_.defer_nonfinite = !run_device(ctx.run()).is_cpu();
    if (cfg_.kind == OptimKind::adafactor) {
      const Params a = p.sub("adafactor");
      a.read<double>({{"decay_rate", &cfg_.adafactor.decay_rate}, {"beta2_cap", &cfg_.adafactor.beta2_cap},
                      {"eps", &cfg_.adafactor.eps}, {"momentum", &cfg_.adafactor.momentum}});
      cfg_.adafactor.min_dim_size_to_factor = a.get<int64_t>("min_dim_size_to_factor");
      cfg_.adafactor.clipping_threshold = a.get<double>("clipping_threshold", 0.0);  // null: off
    }
    note_memory(ctx);
    ctx.own_state("state", std::make_shared<OptimizerState>());
  }

  // For forward_backward's memory estimate (common/memory.hpp): the bytes of this rank's state,
  // made at the first update; sharded: about 1/world of them.
  void note_memory(SetupContext& ctx) {
    ModelState& model = ctx.state_as<ModelState>("model");
    double bytes = 0;
    for (const auto& t : model.trainable_parameters()) {
      const double n = static_cast<double>(t.nbytes());
      if (cfg_.kind == OptimKind::adamw) {
        bytes += 2 * n;
      } else if (cfg_.kind == OptimKind::sgd) {
        bytes += cfg_.momentum > 0 ? n : 0;
      } else {  // adafactor: the second-moment statistics (factored: a row and a column), the momentum
        for (const auto& [suffix, shape] : adafactor_stats(t.sizes().vec(), cfg_.adafactor.min_dim_size_to_factor))
          bytes += static_cast<double>(c10::multiply_integers(shape)) * static_cast<double>(t.element_size());
        bytes += cfg_.adafactor.momentum > 0 ? n : 0;
      }
    }
    const int world = ctx.run().world;
    MemoryItem item{"optimizer state (" + ctx.params().get<std::string>("kind") + ")", ctx.name(), bytes, false, "", 0};
    if (shard_) {
      item.what += ", sharded";
      item.bytes = bytes / world;
    } else if (world > 1) {
      item.fix = ctx.name() + ".shard=gradients";
      item.fixed = bytes / world;
      item.fix_shards_gradients = true;  // forward_backward adds the gradients it saves
    }
    model.kept.push_back(item);
  }

  void run(StepContext& ctx) override {
    const Grads& grads = ctx.in<Grads>("grads");
    ModelState& model = ctx.state_as<ModelState>("model");
    OptimizerState& st = ctx.state_as<OptimizerState>("state");
    const double lr = sched_.at(ctx.step(), ctx.run().last_step);
    // The writer of the parameters keeps them in flat buffers (models/model_state.hpp); once
    // they are, this only checks that they still are.
    model.flat.ensure(model.trainable_parameters());
    torch::Tensor norm = shard_ ? sharded_update(ctx, model, st, grads, lr)
                                : optimizer_update(st, model.named_parameters(/*trainable_only=*/true), grads, cfg_, lr);
    if (!logged_memory_) log_memory(ctx, model, st, grads);
    const int64_t step = ctx.step();
    if (!cfg_.defer_nonfinite) {
      if (cfg_.skip_nonfinite && !std::isfinite(norm.item<double>()))
        spdlog::warn("{}: step {}: gradients not finite, update skipped ({} skipped so far)", ctx.who(), step,
                     nonfinite_count(st));
    } else if (step % ctx.run().log_every == 0 || step == ctx.run().last_step) {
      check_nonfinite(ctx, st, step);
    }
    ctx.out("lr", lr);
    ctx.out("grad_norm", norm);
  }

 private:
  // defer_nonfinite: what the device counted since the last check, told (skip_nonfinite) or
  // stopping the run (the updates were skipped on the device, so the parameters are those of
  // the last finite step).
  void check_nonfinite(StepContext& ctx, const OptimizerState& st, int64_t step) {
    const int64_t count = nonfinite_count(st);
    const int64_t since = checked_ >= 0 ? checked_ + 1 : ctx.run().first_step;
    checked_ = step;
    if (count == reported_) return;
    const std::string when = since == step ? "at step " + std::to_string(step)
                                           : "between step " + std::to_string(since) + " and step " + std::to_string(step);
    const int64_t fresh = count - reported_;
    reported_ = count;
    if (!cfg_.skip_nonfinite)
      throw NonFiniteGrads("the gradients were not finite in " + std::to_string(fresh) + " step(s) " + when +
                           " (those updates were skipped on the device): the loss diverged or overflowed; lower the "
                           "lr, add clip, or set skip_nonfinite: true");
    spdlog::warn("{}: {} step(s) with non-finite gradients {}, their updates skipped ({} skipped so far)", ctx.who(),
                 fresh, when, count);
  }

  // ZeRO-1 and 2: this rank's pieces updated with the norm of all the grads (the same on every
  // rank), then every rank's updated slice all-gathered into every rank's parameters.
  torch::Tensor sharded_update(StepContext& ctx, ModelState& model, OptimizerState& st, const Grads& grads, double lr) {
    const ModelState::Named named = model.named_parameters(/*trainable_only=*/true);
    const std::vector<torch::Tensor>* buffers = model.flat.buffers_of(model.trainable_parameters());
    if (!buffers) throw std::logic_error(ctx.who() + ": the parameters are not in flat buffers");
    if (st.slots.empty() || !(st.shard.layout == model.flat.layout()))
      make_shard_slots(st,
                       ShardPlan::make(model.flat.layout(), named, ctx.run().rank, ctx.run().world,
                                       /*whole_tensors=*/cfg_.kind == OptimKind::adafactor),
                       named, cfg_);
    const ShardPieces pieces = shard_pieces(st.shard, named, grads);
    torch::Tensor norm;
    if (shard_grads_) {
      // Each rank holds its pieces only: the global norm from the sum of the ranks' squares.
      double sq = std::pow(global_norm(pieces.grads).item<double>(), 2);
      comm::allreduce(*ch_, &sq, 1, comm::Op::sum, "gradient norm of step " + std::to_string(ctx.step()));
      norm = torch::tensor(static_cast<float>(std::sqrt(sq)));
    } else {
      norm = global_norm(grads);
    }
    norm = optimizer_update(st, pieces.params, pieces.grads, cfg_, lr, norm);
    allgather_slices(st.shard, *buffers, *ch_, "parameters of step " + std::to_string(ctx.step()));
    return norm;
  }

  // Once, after the first update: what this rank holds (what a memory budget needs).
  void log_memory(StepContext& ctx, ModelState& model, const OptimizerState& st, const Grads& grads) {
    logged_memory_ = true;
    if (ctx.run().rank != 0) return;
    auto bytes = [](const std::vector<torch::Tensor>& ts) {
      double b = 0;
      for (const auto& t : ts)
        if (t.defined()) b += static_cast<double>(t.numel()) * static_cast<double>(t.element_size());
      return b;
    };
    double moments = bytes(st.flat_exp_avg) + bytes(st.flat_exp_avg_sq) + bytes(st.flat_momentum);
    for (const auto& s : st.slots) moments += bytes({s.v_row, s.v_col, s.v});
    const double params = bytes(model.trainable_parameters());
    spdlog::info("{}: per rank: parameters {:.2f} MB, gradients {:.2f} MB, optimizer state {:.2f} MB{}", ctx.who(),
                 params / 1e6, bytes(grads) / 1e6, moments / 1e6,
                 shard_ ? fmt::format(" (shard: {}, this rank's 1/{} slice)", shard_grads_ ? "gradients" : "states",
                                      ctx.run().world)
                        : std::string());
  }

  OptimConfig cfg_;
  LrSchedule sched_;
  bool shard_ = false;        // shard: states or gradients, with several processes
  bool shard_grads_ = false;  // shard: gradients
  std::shared_ptr<comm::Channel> ch_;
  bool logged_memory_ = false;
  int64_t reported_ = 0;  // defer_nonfinite: skipped updates told so far
  int64_t checked_ = -1;  // the step of the last check (-1: none yet)
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(optimizer, flowrun::OptimizerNode)
// Saved and restored by checkpoint/resume; a sharded state is gathered first (collect).
static const bool kOptimizerStateIO = [] {
  using flowrun::OptimizerState;
  flowrun::register_state_io(
      std::type_index(typeid(std::shared_ptr<OptimizerState>)),
      flowrun::StateIO{[](const flowrun::Value& v) { return flowrun::NamedTensors(v.as<std::shared_ptr<OptimizerState>>()->tensors()); },
                       [](flowrun::Value& v, const flowrun::NamedTensors& t) { v.as_mut<std::shared_ptr<OptimizerState>>()->load(t); },
                       [](flowrun::Value& v, flowrun::comm::Channel& ch) {
                         flowrun::collect_sharded_state(*v.as_mut<std::shared_ptr<OptimizerState>>(), ch);
                       }});
  return true;
}();
