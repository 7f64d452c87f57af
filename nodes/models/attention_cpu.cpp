// The CPU kernel of self_attention (attention.hpp): softmax(q kᵀ · scale) v from one fused
// projection, float32, forward and backward as one autograd function.
//
// Written out with torch ops, a [16, 4, 128, 64] causal attention (GPT bench's) on two cores
// spends 3 of its 7.7 ms forward + backward outside its six batched matrix products: q, k and v
// copied out of the projection into heads, the [T, T] mask added, and backward's three gradients
// stacked and copied back into the projection's layout. This kernel takes 5.0 ms. Here every product reads its operands where they are (a head of q is
// T rows of D floats, 3·H·D apart in the projection; BLAS takes the row stride as it is) and
// writes where its result belongs: the output into its head's columns of [B·T, H·D], the
// gradients into their columns of [B·T, 3·H·D]. Under the causal mask the rows go in blocks of
// kBlock, and a block multiplies only the keys up to its last row (¾ of the products at 2 blocks,
// ⅝ at 4): the query blocks in the products along keys, the key blocks in those along queries.
//
// Per (batch, head), query block i = rows [r0, r1), keys [0, n) (n = r1 causal, else L); key
// block j = keys [c0, c1), the rows that see it [c0, L) (causal, else [0, L)):
//   forward   S = scale · Q Kᵀ  (query blocks);  P = softmax(S) row by row (row r: keys ≤ r
//             under the mask, 0 after them up to n);  O = P V  (query blocks).  P is saved for
//             backward ([B·H, L, L], as torch's softmax saves its output).
//   backward  dP = dO Vᵀ  (query blocks);  dS = P ⊙ (dP − rowsum(P ⊙ dP));  dQ = scale · dS K
//             (query blocks);  dK = scale · dSᵀ Q and dV = Pᵀ dO  (key blocks: each block's rows
//             of dK and dV written once, by one product).
// Each step is one call of MKL's batched GEMM over every (batch, head, block) (libtorch_cpu's
// MKL, which torch's own bmm calls), threaded by MKL over the batch; the row passes run in
// at::parallel_for. Test: tests/nodes/attention_test.cpp (against the written-out attention,
// values and gradients, causal or not, one block, several, a partial last one).
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/cpu_simd.hpp"
#include "models/attention.hpp"

// MKL's batched GEMM (CBLAS; LP64 ints), which libtorch_cpu exports. Weak: where a libtorch has
// none (not built with MKL), self_attention takes the written-out path.
extern "C" void cblas_sgemm_batch(int layout, const int* transa, const int* transb, const int* m, const int* n,
                                  const int* k, const float* alpha, const float** a, const int* lda, const float** b,
                                  const int* ldb, const float* beta, float** c, const int* ldc, int group_count,
                                  const int* group_size) __attribute__((weak));

namespace flowrun {

namespace {

// Rows per block under the causal mask. Smaller blocks skip more (4 blocks of 32 leave ⅝ of the
// products, 2 of 64 ¾) but make smaller products: on 2 cores, [16, 4, 128, 64] forward +
// backward took 5.0 ms at 32, 5.5 at 16 and 64, 6.7 at 128 (no skipping); at 1024 tokens
// ([1, 12, 1024, 64]) 32 to 128 took the same (88-90 ms; in another run 103 ms against the
// written-out attention's 135).
constexpr int64_t kBlock = 32;

// ---- the batched products: one group per shape, one call per step

// C = alpha · op(A) · op(B) + beta · C for many (A, B, C) of a few shapes, row-major, ld* =
// floats from one row to the next. add() starts a group (one shape); at() adds a product to it.
class Gemms {
 public:
  void add(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, int64_t lda, int64_t ldb, int64_t ldc) {
    ta_.push_back(ta ? kTrans : kNoTrans);
    tb_.push_back(tb ? kTrans : kNoTrans);
    m_.push_back(static_cast<int>(m));
    n_.push_back(static_cast<int>(n));
    k_.push_back(static_cast<int>(k));
    lda_.push_back(static_cast<int>(lda));
    ldb_.push_back(static_cast<int>(ldb));
    ldc_.push_back(static_cast<int>(ldc));
    alpha_.push_back(alpha);
    beta_.push_back(0.0f);
    size_.push_back(0);
  }
  void at(const float* a, const float* b, float* c) {
    a_.push_back(a);
    b_.push_back(b);
    c_.push_back(c);
    ++size_.back();
  }
  void run() {
    cblas_sgemm_batch(kRowMajor, ta_.data(), tb_.data(), m_.data(), n_.data(), k_.data(), alpha_.data(), a_.data(),
                      lda_.data(), b_.data(), ldb_.data(), beta_.data(), c_.data(), ldc_.data(),
                      static_cast<int>(size_.size()), size_.data());
  }

 private:
  static constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // CBLAS's enums
  std::vector<int> ta_, tb_, m_, n_, k_, lda_, ldb_, ldc_, size_;
  std::vector<float> alpha_, beta_;
  std::vector<const float*> a_, b_;
  std::vector<float*> c_;
};

// ---- the row passes, on n valid floats of a row (AVX2 + FMA where the CPU has them)

#if FLOWRUN_HAVE_AVX2_CODE
FLOWRUN_AVX2 float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

FLOWRUN_AVX2 float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// The first `left` lanes (1..8 and more: all) of a vector, as a float mask.
FLOWRUN_AVX2 __m256 lanes(int64_t left) {
  alignas(32) static const int32_t kOn[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_castsi256_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kOn + 8 - std::min<int64_t>(left, 8))));
}

// Rows under the causal mask end anywhere: the vectors run to the block's keys (`cap`, whose
// floats are the product's), lanes past n masked (and stored as the 0 they must be), so that no
// scalar tail costs more than the vectors. Returns where the vectors stopped.
FLOWRUN_AVX2 int64_t softmax_avx2(float* x, int64_t n, int64_t cap) {
  const int64_t end = std::min(cap, (n + 7) / 8 * 8) / 8 * 8;  // whole vectors within cap
  __m256 vm = _mm256_set1_ps(-INFINITY);
  for (int64_t i = 0; i < end; i += 8) vm = _mm256_max_ps(vm, _mm256_blendv_ps(vm, _mm256_loadu_ps(x + i), lanes(n - i)));
  float m = hmax8(vm);
  for (int64_t i = end; i < n; ++i) m = std::max(m, x[i]);
  const __m256 vmax = _mm256_set1_ps(m);
  __m256 vs = _mm256_setzero_ps();
  for (int64_t i = 0; i < end; i += 8) {
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax)), lanes(n - i));
    _mm256_storeu_ps(x + i, e);
    vs = _mm256_add_ps(vs, e);
  }
  float sum = hsum8(vs);
  for (int64_t i = end; i < n; ++i) sum += (x[i] = std::exp(x[i] - m));
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < end; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(inv)));
  for (int64_t i = end; i < n; ++i) x[i] *= inv;
  return std::max(end, n);
}

FLOWRUN_AVX2 void softmax_grad_avx2(const float* p, float* dp, int64_t n) {
  int64_t i = 0;
  __m256 vd = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) vd = _mm256_fmadd_ps(_mm256_loadu_ps(p + i), _mm256_loadu_ps(dp + i), vd);
  float d = hsum8(vd);
  for (; i < n; ++i) d += p[i] * dp[i];
  const __m256 vdot = _mm256_set1_ps(d);
  for (i = 0; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dp + i, _mm256_mul_ps(_mm256_loadu_ps(p + i), _mm256_sub_ps(_mm256_loadu_ps(dp + i), vdot)));
  for (; i < n; ++i) dp[i] = p[i] * (dp[i] - d);
}
#endif

// x[0, n) <- softmax(x[0, n)), x[n, cap) <- 0
void softmax_row(float* x, int64_t n, int64_t cap) {
  int64_t done = 0;
#if FLOWRUN_HAVE_AVX2_CODE
  if (cpu_has_avx2()) done = softmax_avx2(x, n, cap);
#endif
  if (done == 0) {
    const float m = *std::max_element(x, x + n);
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += (x[i] = std::exp(x[i] - m));
    for (int64_t i = 0; i < n; ++i) x[i] *= 1.0f / s;
    done = n;
  }
  std::fill(x + done, x + cap, 0.0f);
}

// dp <- p ⊙ (dp − Σ p ⊙ dp): the gradient of softmax's input from its output's
void softmax_grad_row(const float* p, float* dp, int64_t n) {
#if FLOWRUN_HAVE_AVX2_CODE
  if (cpu_has_avx2()) return softmax_grad_avx2(p, dp, n);
#endif
  float d = 0.0f;
  for (int64_t i = 0; i < n; ++i) d += p[i] * dp[i];
  for (int64_t i = 0; i < n; ++i) dp[i] = p[i] * (dp[i] - d);
}

// ---- the layout: where each (batch, head)'s matrices are, and its blocks

struct Layout {
  int64_t B, H, L, D;
  bool causal;
  float scale;
  int64_t C() const { return H * D; }
  int64_t ld() const { return 3 * C(); }  // rows of q, k, v (and their gradients): the projection's
  // Offsets of (batch, head) bh's q in the projection, and of its output rows in [B, L, C].
  int64_t qkv_at(int64_t bh) const { return (bh / H) * L * ld() + (bh % H) * D; }
  int64_t out_at(int64_t bh) const { return (bh / H) * L * C() + (bh % H) * D; }
  int64_t blocks() const { return causal ? (L + kBlock - 1) / kBlock : 1; }
  int64_t begin(int64_t i) const { return causal ? i * kBlock : 0; }
  int64_t end(int64_t i) const { return causal ? std::min(L, (i + 1) * kBlock) : L; }
  int64_t keys(int64_t i) const { return causal ? end(i) : L; }  // keys query block i sees
  int64_t rows_from(int64_t j) const { return causal ? begin(j) : 0; }  // first row that sees key block j
};

// Every row of every (batch, head), in parallel: f(the row's offset in [B·H, L, L], its position
// r, the keys it sees).
template <typename F>
void for_rows(const Layout& t, F f) {
  at::parallel_for(0, t.B * t.H * t.L, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) f(i * t.L, i % t.L, t.causal ? i % t.L + 1 : t.L);
  });
}

void attend_forward(const Layout& t, const float* x, float* p, float* o) {
  const int64_t L = t.L, D = t.D, ld = t.ld(), C = t.C(), BH = t.B * t.H;
  Gemms s, pv;
  for (int64_t i = 0; i < t.blocks(); ++i) {
    const int64_t r0 = t.begin(i), m = t.end(i) - r0, n = t.keys(i);
    s.add(false, true, m, n, D, t.scale, ld, ld, L);  // S = scale · Q Kᵀ
    for (int64_t bh = 0; bh < BH; ++bh) s.at(x + t.qkv_at(bh) + r0 * ld, x + t.qkv_at(bh) + C, p + bh * L * L + r0 * L);
    pv.add(false, false, m, D, n, 1.0f, L, ld, C);  // O = P V
    for (int64_t bh = 0; bh < BH; ++bh)
      pv.at(p + bh * L * L + r0 * L, x + t.qkv_at(bh) + 2 * C, o + t.out_at(bh) + r0 * C);
  }
  s.run();
  // Row r: the keys it sees, then 0 for the masked rest of its block's keys.
  for_rows(t, [&](int64_t at, int64_t r, int64_t seen) { softmax_row(p + at, seen, t.keys(r / kBlock)); });
  pv.run();
}

void attend_backward(const Layout& t, const float* x, const float* p, const float* go, float* ds, float* dx) {
  const int64_t L = t.L, D = t.D, ld = t.ld(), C = t.C(), BH = t.B * t.H;
  Gemms dp, dq, dkv;
  for (int64_t i = 0; i < t.blocks(); ++i) {
    const int64_t r0 = t.begin(i), m = t.end(i) - r0, n = t.keys(i);
    dp.add(false, true, m, n, D, 1.0f, C, ld, L);  // dP = dO Vᵀ
    for (int64_t bh = 0; bh < BH; ++bh)
      dp.at(go + t.out_at(bh) + r0 * C, x + t.qkv_at(bh) + 2 * C, ds + bh * L * L + r0 * L);
    dq.add(false, false, m, D, n, t.scale, L, ld, ld);  // dQ = scale · dS K
    for (int64_t bh = 0; bh < BH; ++bh) dq.at(ds + bh * L * L + r0 * L, x + t.qkv_at(bh) + C, dx + t.qkv_at(bh) + r0 * ld);
  }
  for (int64_t j = 0; j < t.blocks(); ++j) {
    const int64_t c0 = t.begin(j), w = t.end(j) - c0, r0 = t.rows_from(j), m = L - r0;
    dkv.add(true, false, w, D, m, t.scale, L, ld, ld);  // dK = scale · dSᵀ Q
    for (int64_t bh = 0; bh < BH; ++bh)
      dkv.at(ds + bh * L * L + r0 * L + c0, x + t.qkv_at(bh) + r0 * ld, dx + t.qkv_at(bh) + C + c0 * ld);
    dkv.add(true, false, w, D, m, 1.0f, L, C, ld);  // dV = Pᵀ dO
    for (int64_t bh = 0; bh < BH; ++bh)
      dkv.at(p + bh * L * L + r0 * L + c0, go + t.out_at(bh) + r0 * C, dx + t.qkv_at(bh) + 2 * C + c0 * ld);
  }
  dp.run();
  for_rows(t, [&](int64_t at, int64_t r, int64_t) { softmax_grad_row(p + at, ds + at, t.keys(r / kBlock)); });
  dq.run();
  dkv.run();
}

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

struct CpuSelfAttention : torch::autograd::Function<CpuSelfAttention> {
  // qkv [B, L, 3·H·D] contiguous -> [B, L, H·D]
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& qkv, int64_t H, bool causal, double scale) {
    const Layout t = layout(qkv, H, causal, scale);
    torch::Tensor out = torch::empty({t.B, t.L, t.C()}, qkv.options());
    torch::Tensor p = torch::empty({t.B * t.H, t.L, t.L}, qkv.options());
    attend_forward(t, qkv.data_ptr<float>(), p.data_ptr<float>(), out.data_ptr<float>());
    ctx->save_for_backward({qkv, p});
    ctx->saved_data["H"] = H;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &qkv = saved[0], &p = saved[1];
    const Layout t = layout(qkv, ctx->saved_data["H"].toInt(), ctx->saved_data["causal"].toBool(),
                            ctx->saved_data["scale"].toDouble());
    const torch::Tensor go = grad_out[0].contiguous();
    torch::Tensor ds = torch::empty_like(p), grad = torch::empty_like(qkv);
    attend_backward(t, qkv.data_ptr<float>(), p.data_ptr<float>(), go.data_ptr<float>(), ds.data_ptr<float>(),
                      grad.data_ptr<float>());
    return {grad, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }

  static Layout layout(const torch::Tensor& qkv, int64_t H, bool causal, double scale) {
    const int64_t C = qkv.size(2) / 3;
    return {qkv.size(0), H, qkv.size(1), C / H, causal, static_cast<float>(scale)};
  }
};

}  // namespace

bool cpu_attention_kernel_applies(const torch::Tensor& qkv, const AttentionOptions& o) {
  return cblas_sgemm_batch != nullptr && qkv.device().is_cpu() && qkv.scalar_type() == torch::kFloat &&
         !o.bias.defined();
}

torch::Tensor cpu_self_attention(const torch::Tensor& qkv, int64_t H, bool causal, double scale) {
  return CpuSelfAttention::apply(qkv.contiguous(), H, causal, scale);
}

}  // namespace flowrun
