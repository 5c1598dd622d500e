// Fused CPU kernels for the sequence engine's two sequential phases (gpn_scale.ops.gpn_step.chunk
// calls them through the "cpu" step backend, gpn_scale/ops/gpn_step/cpu.py).
//
// Why by hand: at training batch sizes a step's matmuls are few-row GEMMs of a few hundred
// microseconds, and the eager step runs ~75 (forward) / ~110 (reverse sweep) further small
// ops around them at 5-10 us of dispatch each, so the step took 2.4-3x its matmuls. Here a
// whole chunk runs in one call: the matmuls still go through ATen (any dtype, MKL/oneDNN),
// everything else (norms, gates, activations, the chunk-form memory read/write and its
// reverse) is a plain loop per batch row, in parallel over rows. torch.compile was measured
// first: its per-call overhead alone (~70 us) exceeds what the step may spend outside its
// matmuls. Semantics are exactly those of `forward_chunk` / `reverse_sweep` in
// gpn_scale/ops/gpn_step/reference.py (the PyTorch steps), which stay as the reference and are
// held equal to this file by tests/ops/test_gpn_step.py (forward and every gradient) and
// tests/ops/test_step_kernels.py (build, selection, autocast).
//
// Layouts (as the engine hands them over): dense activations (C, B, width) contiguous; memory
// tensors (B, H, C, n) with any strides but a contiguous last dimension; (B, H, C) tensors
// with any strides.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

namespace {

using at::Tensor;
template <typename T>
using Vec = at::vec::Vectorized<T>;

// ------------------------------------------------------------------ small helpers
template <typename T>
inline T sigmoid(T x) { return T(1) / (T(1) + std::exp(-x)); }

template <typename T>
inline T softplus(T x) { return x > T(20) ? x : std::log1p(std::exp(x)); }  // torch's threshold

// Vectorised with two accumulators: the compiler does not vectorise a floating-point
// reduction by itself (it may not reorder the sum), and these dots (keys against the chunk's
// history, rows of M0 against a gradient) are most of a step's non-matmul work.
template <typename T>
__attribute__((always_inline)) inline T dot(const T* a, const T* b, int64_t n) {
  using V = Vec<T>;
  constexpr int64_t w = V::size();
  V acc0(T(0)), acc1(T(0));
  int64_t i = 0;
  for (; i + 2 * w <= n; i += 2 * w) {
    acc0 = at::vec::fmadd(V::loadu(a + i), V::loadu(b + i), acc0);
    acc1 = at::vec::fmadd(V::loadu(a + i + w), V::loadu(b + i + w), acc1);
  }
  for (; i + w <= n; i += w) acc0 = at::vec::fmadd(V::loadu(a + i), V::loadu(b + i), acc0);
  T lanes[w];
  (acc0 + acc1).store(lanes);
  T s = 0;
  for (int64_t l = 0; l < w; ++l) s += lanes[l];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

template <typename T>
__attribute__((always_inline)) inline void axpy(T a, const T* x, T* y, int64_t n) {  // y += a x
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// (a . x, b . x) in one pass over x
template <typename T>
__attribute__((always_inline)) inline void dot2(const T* a, const T* b, const T* x, int64_t n,
                                                T& ax, T& bx) {
  using V = Vec<T>;
  constexpr int64_t w = V::size();
  V acc_a(T(0)), acc_b(T(0));
  int64_t i = 0;
  for (; i + w <= n; i += w) {
    const V xv = V::loadu(x + i);
    acc_a = at::vec::fmadd(V::loadu(a + i), xv, acc_a);
    acc_b = at::vec::fmadd(V::loadu(b + i), xv, acc_b);
  }
  T la[w], lb[w];
  acc_a.store(la);
  acc_b.store(lb);
  ax = 0;
  bx = 0;
  for (int64_t l = 0; l < w; ++l) {
    ax += la[l];
    bx += lb[l];
  }
  for (; i < n; ++i) {
    ax += a[i] * x[i];
    bx += b[i] * x[i];
  }
}

// ox[c] += sum_r M[r][c] x[r] (and oy with y unless it is null) for an (rows x n) row-major M:
// a memory read M0^T k (forward) or, on M0^T's rows, M0 drq (reverse). Columns in register
// blocks, rows innermost: no horizontal sums (a dot per row needs one per row) and no
// read-modify-write of the outputs per row (an axpy per row does).
template <typename T>
void matvec_rows(const T* M, const T* x, const T* y, T* ox, T* oy, int64_t rows, int64_t n) {
  using V = Vec<T>;
  constexpr int64_t w = V::size();
  int64_t c = 0;
  for (; c + 2 * w <= n; c += 2 * w) {
    V x0 = V::loadu(ox + c), x1 = V::loadu(ox + c + w), y0(T(0)), y1(T(0));
    if (y) { y0 = V::loadu(oy + c); y1 = V::loadu(oy + c + w); }
    for (int64_t r = 0; r < rows; ++r) {
      const T* m = M + r * n + c;
      const V m0 = V::loadu(m), m1 = V::loadu(m + w), xr(x[r]);
      x0 = at::vec::fmadd(m0, xr, x0);
      x1 = at::vec::fmadd(m1, xr, x1);
      if (y) {
        const V yr(y[r]);
        y0 = at::vec::fmadd(m0, yr, y0);
        y1 = at::vec::fmadd(m1, yr, y1);
      }
    }
    x0.store(ox + c);
    x1.store(ox + c + w);
    if (y) { y0.store(oy + c); y1.store(oy + c + w); }
  }
  for (; c < n; ++c) {
    T sx = ox[c], sy = y ? oy[c] : T(0);
    for (int64_t r = 0; r < rows; ++r) {
      sx += M[r * n + c] * x[r];
      if (y) sy += M[r * n + c] * y[r];
    }
    ox[c] = sx;
    if (y) oy[c] = sy;
  }
}

// out[j] = exp(base - G[j]) for j < n: the decay weights of a step against the chunk's history,
// vectorised (instead of one scalar exp per history term).
template <typename T>
void exp_from(T base, const T* G, T* out, int64_t n) {
  using V = Vec<T>;
  const V b(base);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) (b - V::loadu(G + j)).exp().store(out + j);
  if (j < n) (b - V::loadu(G + j, n - j)).exp().store(out + j, n - j);
}

// y1 += a1 x and y2 += a2 x in one pass over x
template <typename T>
__attribute__((always_inline)) inline void axpy2(T a1, T a2, const T* x, T* y1, T* y2,
                                                 int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const T xi = x[i];
    y1[i] += a1 * xi;
    y2[i] += a2 * xi;
  }
}

// y += a1 x1 + a2 x2 in one pass over y
template <typename T>
__attribute__((always_inline)) inline void axpy_pair(T a1, const T* x1, T a2, const T* x2, T* y,
                                                     int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a1 * x1[i] + a2 * x2[i];
}

// out[i] = sigmoid(x[i]) (vectorised: exp dominates the step's elementwise cost)
template <typename T>
void sigmoid_vec(const T* x, T* out, int64_t n) {
  const Vec<T> one(T(1));
  int64_t i = 0;
  for (; i + Vec<T>::size() <= n; i += Vec<T>::size())
    (one / (one + Vec<T>::loadu(x + i).neg().exp())).store(out + i);
  for (; i < n; ++i) out[i] = sigmoid(x[i]);
}

// out[i] = silu(a[i]) * b[i]
template <typename T>
void silu_mul(const T* a, const T* b, T* out, int64_t n) {
  const Vec<T> one(T(1));
  int64_t i = 0;
  for (; i + Vec<T>::size() <= n; i += Vec<T>::size()) {
    Vec<T> x = Vec<T>::loadu(a + i);
    (x / (one + x.neg().exp()) * Vec<T>::loadu(b + i)).store(out + i);
  }
  for (; i < n; ++i) out[i] = a[i] * sigmoid(a[i]) * b[i];
}

// 1 / sqrt(mean(x^2) + eps): the RMSNorm factor of one row
template <typename T>
inline T rms_factor(const T* x, int64_t n, T eps) {
  return T(1) / std::sqrt(dot(x, x, n) / T(n) + eps);
}

// out = l2n(relu(pre)) over n values
template <typename T>
inline T l2n_relu(const T* pre, T* out, int64_t n) {   // returns the norm's factor
  for (int64_t i = 0; i < n; ++i) out[i] = pre[i] > T(0) ? pre[i] : T(0);
  const T rho = T(1) / std::sqrt(dot(out, out, n) + T(1e-12));
  for (int64_t i = 0; i < n; ++i) out[i] *= rho;
  return rho;
}

// d pre of y = l2n(relu(pre)), given dy; `scratch` holds n values
template <typename T>
inline void l2n_relu_back(const T* pre, const T* dy, T* out, T* scratch, int64_t n) {
  const T rho = l2n_relu(pre, scratch, n);  // scratch = y
  const T ydy = dot(scratch, dy, n);
  for (int64_t i = 0; i < n; ++i)
    out[i] = pre[i] > T(0) ? rho * (dy[i] - scratch[i] * ydy) : T(0);
}

// dx of n = x * rms_factor(x), given dn (n is the forward's output)
template <typename T>
inline void rms_back(const T* n_, const T* x, const T* dn, T* dx, int64_t len, T eps) {
  const T r = rms_factor(x, len, eps);
  const T m = dot(dn, n_, len) / T(len);
  for (int64_t i = 0; i < len; ++i) dx[i] = r * (dn[i] - n_[i] * m);
}

// Element access with arbitrary strides (the memory tensors arrive as permuted views).
template <typename T>
struct Strided {
  T* p = nullptr;
  int64_t s[4] = {0, 0, 0, 0};
  Strided() = default;
  explicit Strided(const Tensor& t) : p(t.data_ptr<T>()) {
    for (int64_t i = 0; i < t.dim(); ++i) s[i] = t.stride(i);
  }
  T* at(int64_t a, int64_t b = 0, int64_t c = 0, int64_t d = 0) const {
    return p + a * s[0] + b * s[1] + c * s[2] + d * s[3];
  }
};

void check_rows(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, ": the step kernels run on CPU tensors");
  TORCH_CHECK(t.dim() == 0 || t.stride(-1) == 1, name, ": the last dimension must be contiguous");
}

// out = x @ w (+ bias) in w's dtype (bf16 under autocast), result in out's dtype.
void matmul_into(Tensor& out, const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias) {
#ifdef GPN_SCALE_BENCH_WITHOUT_STEP_MATMULS
  // A benchmark-only build (gpn_scale.bench.engine's roofline, never used for training): the
  // sequential phases' matmuls are left out, so that timing a phase times all its other work.
  // Zeros, not the buffers' old contents: stray denormals would slow that work down.
  (void)x; (void)w; (void)bias;
  out.zero_();
  return;
#endif
  if (w.scalar_type() != x.scalar_type()) {
    out.copy_(at::mm(x.to(w.scalar_type()), w));
    if (bias) out.add_(*bias);
  } else if (bias) {
    at::addmm_out(out, *bias, x, w);
  } else {
    at::mm_out(out, x, w);
  }
}

template <typename F>
void over_rows(int64_t B, const F& f) {
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) f(b);
  });
}

struct Dims {
  int64_t L, H, dk, dv, f, d, B, C;
  bool mem;
  double eps;
  int64_t Hk() const { return H * dk; }
  int64_t Hv() const { return H * dv; }
};

// Column offsets of layer i's fused input matmul: the order of `ColumnLayout`
// (gpn_scale/ops/gpn_step/interface.py), recomputed here from the dimensions.
struct InCols {
  int64_t kn = -1, v = -1, beta = -1, decay = -1, q = -1, rg = -1, ffn = 0, pg = 0;
  InCols(const Dims& D, int64_t i) {
    int64_t at = 0;
    if (D.mem && i == 0) {
      kn = at; at += D.Hk();
      v = at; at += D.Hv();
      beta = at; at += D.H;
      decay = at; at += D.H;
    }
    if (D.mem) {
      q = at; at += D.Hk();
      rg = at; at += D.Hv();
    }
    ffn = at; at += 2 * D.f;
    pg = at;
  }
};

// ================================================================== forward
template <typename T>
std::vector<Tensor> forward_impl(const Dims& D, const std::vector<Tensor>& w_in,
                                 const std::vector<Tensor>& b_in, const std::vector<Tensor>& w_out,
                                 const Tensor& w_fg, const Tensor& b_fg,
                                 const std::optional<Tensor>& A_opt, const Tensor& fuse,
                                 const Tensor& s0, const Tensor& s_prev0,
                                 const std::optional<Tensor>& M0_opt, Tensor& P,
                                 const std::optional<Tensor>& S_out) {
  const int64_t B = D.B, C = D.C, d = D.d, H = D.H, dk = D.dk, dv = D.dv, Hk = D.Hk(), Hv = D.Hv();
  const T eps = T(D.eps);
  auto opts = s0.options();
  Tensor s = s0.contiguous().clone(), s_prev = s_prev0.contiguous().clone();
  Tensor c = at::empty({B, d}, opts), n = at::empty({B, d}, opts), z = at::empty({B, d}, opts);
  Tensor g = at::empty({B, d}, opts);
  const Tensor b_fg_c = b_fg.contiguous();
  std::vector<Tensor> y, hid, bias_in;
  for (int64_t i = 0; i < D.L; ++i) {
    bias_in.push_back(b_in[i].contiguous());
    y.push_back(at::empty({B, w_in[i].size(1)}, opts));
    hid.push_back(at::empty({B, w_out[i].size(0)}, opts));
  }
  Tensor K, U, Gh, k, Gp, Gc, o, M0, A;
  if (D.mem) {
    K = at::zeros({B, H, C, dk}, opts);
    U = at::zeros({B, H, C, dv}, opts);
    Gh = at::zeros({B, H, C}, opts);
    k = at::empty({B, H, dk}, opts);
    Gp = at::zeros({B, H}, opts);
    Gc = at::empty({B, H}, opts);
    o = at::empty({B, Hv}, opts);
    M0 = M0_opt->contiguous();
    A = A_opt->contiguous();
    // The chunk's first key comes from s_prev.
    T* np = n.data_ptr<T>();
    const T* sp = s_prev.data_ptr<T>();
    over_rows(B, [&](int64_t b) {
      const T r = rms_factor(sp + b * d, d, eps);
      for (int64_t j = 0; j < d; ++j) np[b * d + j] = sp[b * d + j] * r;
    });
    Tensor k_pre = at::empty({B, Hk}, opts);
    matmul_into(k_pre, n, w_in[0].narrow(1, 0, Hk), b_in[0].narrow(0, 0, Hk));
    const T* kp = k_pre.data_ptr<T>();
    T* kk = k.data_ptr<T>();
    for (int64_t r = 0; r < B * H; ++r) l2n_relu(kp + r * dk, kk + r * dk, dk);
  }
  const Strided<T> Pv(P), Fv(fuse);
  Strided<T> Sv;
  if (S_out) Sv = Strided<T>(*S_out);
  T* sd = s.data_ptr<T>();
  T* spd = s_prev.data_ptr<T>();
  T* cd = c.data_ptr<T>();
  T* nd = n.data_ptr<T>();
  T* zd = z.data_ptr<T>();
  T* gd = g.data_ptr<T>();

  // The state entering step t: recorded, copied to c and normalised (the last region of
  // step t-1 does this for step t, saving a fork/join per step).
  const auto enter = [&](int64_t b, int64_t tau) {
    const T* sb = sd + b * d;
    if (S_out) std::copy(sb, sb + d, Sv.at(b, tau));
    std::copy(sb, sb + d, cd + b * d);
    const T r = rms_factor(sb, d, eps);
    for (int64_t j = 0; j < d; ++j) nd[b * d + j] = sb[j] * r;
  };
  over_rows(B, [&](int64_t b) { enter(b, 0); });
  for (int64_t tau = 0; tau < C; ++tau) {
    for (int64_t i = 0; i < D.L; ++i) {
      const InCols col(D, i);
      // The bias is added in the row loop below: addmm's extra pass costs more than that.
      matmul_into(y[i], n, w_in[i], std::nullopt);
      const int64_t Win = y[i].size(1), Wout = hid[i].size(1);
      T* yd = y[i].data_ptr<T>();
      const T* bias = bias_in[i].data_ptr<T>();
      T* hd = hid[i].data_ptr<T>();
      over_rows(B, [&](int64_t b) {
        T* yb = yd + b * Win;
        for (int64_t j = 0; j < Win; ++j) yb[j] += bias[j];
        T* hb = hd + b * Wout;
        if (D.mem) {
          std::vector<T> q(dk), rk(dv), rq(dv), err(dv), wk(C), wq(C);
          T* ob = o.data_ptr<T>() + b * Hv;
          const T* Ad = A.data_ptr<T>();
          for (int64_t h = 0; h < H; ++h) {
            const int64_t bh = b * H + h;
            const T* M = M0.data_ptr<T>() + bh * dk * dv;
            const T* Kbh = K.data_ptr<T>() + bh * C * dk;
            T* Ubh = U.data_ptr<T>() + bh * C * dv;
            T* Gbh = Gh.data_ptr<T>() + bh * C;
            T* out = ob + h * dv;
            l2n_relu(yb + col.q + h * dk, q.data(), dk);
            if (i == 0) {
              T* kb = k.data_ptr<T>() + bh * dk;
              const T gp = Gp.data_ptr<T>()[bh];
              const T G = gp - Ad[h] * softplus(yb[col.decay + h]);
              Gc.data_ptr<T>()[bh] = G;
              // One pass over M0 for the key (error term) and the query (read after write).
              std::fill(rk.begin(), rk.end(), T(0));
              std::fill(rq.begin(), rq.end(), T(0));
              matvec_rows(M, kb, q.data(), rk.data(), rq.data(), dk, dv);
              const T egp = std::exp(gp), eg = std::exp(G);
              for (int64_t v = 0; v < dv; ++v) {
                err[v] = egp * rk[v];
                out[v] = eg * rq[v];
              }
              exp_from(gp, Gbh, wk.data(), tau);
              exp_from(G, Gbh, wq.data(), tau);
              for (int64_t j = 0; j < tau; ++j) {
                T sk, sq;
                dot2(kb, q.data(), Kbh + j * dk, dk, sk, sq);
                axpy2(sk * wk[j], sq * wq[j], Ubh + j * dv, err.data(), out, dv);
              }
              const T beta = sigmoid(yb[col.beta + h]);
              const T qk = dot(q.data(), kb, dk);
              const T* vv = yb + col.v + h * dv;
              T* Ut = Ubh + tau * dv;
              for (int64_t v = 0; v < dv; ++v) {
                const T u = beta * (vv[v] - err[v]);
                Ut[v] = u;
                out[v] += qk * u;
              }
              std::copy(kb, kb + dk, K.data_ptr<T>() + (bh * C + tau) * dk);
              Gbh[tau] = G;
              l2n_relu(yb + col.kn + h * dk, kb, dk);  // the key of the next step
            } else {
              const T G = Gc.data_ptr<T>()[bh];
              std::fill(rq.begin(), rq.end(), T(0));
              matvec_rows(M, q.data(), static_cast<const T*>(nullptr), rq.data(),
                          static_cast<T*>(nullptr), dk, dv);
              const T eg = std::exp(G);
              for (int64_t v = 0; v < dv; ++v) out[v] = eg * rq[v];
              exp_from(G, Gbh, wq.data(), tau + 1);
              for (int64_t j = 0; j <= tau; ++j)
                axpy(dot(q.data(), Kbh + j * dk, dk) * wq[j], Ubh + j * dv, out, dv);
            }
          }
          // hidden = [silu(rg) * rms(o), silu(a) * b]
          const T r = rms_factor(ob, Hv, eps);
          std::vector<T> ro(Hv);
          for (int64_t v = 0; v < Hv; ++v) ro[v] = ob[v] * r;
          silu_mul(yb + col.rg, ro.data(), hb, Hv);
          silu_mul(yb + col.ffn, yb + col.ffn + D.f, hb + Hv, D.f);
        } else {
          silu_mul(yb + col.ffn, yb + col.ffn + D.f, hb, D.f);
        }
      });
      matmul_into(z, hid[i], w_out[i], std::nullopt);
      // c = sigmoid(pg) * c + z; n = rms(c)  (the next layer's or the fuse gate's input)
      over_rows(B, [&](int64_t b) {
        T* cb = cd + b * d;
        const T* zb = zd + b * d;
        sigmoid_vec(yd + b * Win + col.pg, nd + b * d, d);   // n as scratch for the gate
        for (int64_t j = 0; j < d; ++j) cb[j] = nd[b * d + j] * cb[j] + zb[j];
        const T r = rms_factor(cb, d, eps);
        for (int64_t j = 0; j < d; ++j) nd[b * d + j] = cb[j] * r;
      });
    }
    matmul_into(g, n, w_fg, std::nullopt);
    const T* bias_fg = b_fg_c.data_ptr<T>();
    // P[:, tau] = c; s_prev = s; s = sigmoid(gate) * c + fuse[:, tau]
    over_rows(B, [&](int64_t b) {
      T* sb = sd + b * d;
      const T* cb = cd + b * d;
      T* gb = gd + b * d;
      std::copy(cb, cb + d, Pv.at(b, tau));
      std::copy(sb, sb + d, spd + b * d);
      for (int64_t j = 0; j < d; ++j) gb[j] += bias_fg[j];
      sigmoid_vec(gb, gb, d);
      const T* fb = Fv.at(b, tau);
      for (int64_t j = 0; j < d; ++j) sb[j] = gb[j] * cb[j] + fb[j];
      if (D.mem) std::copy(Gc.data_ptr<T>() + b * H, Gc.data_ptr<T>() + (b + 1) * H,
                           Gp.data_ptr<T>() + b * H);
      if (tau + 1 < C) enter(b, tau + 1);
    });
  }
  if (!D.mem) return {s, s_prev};
  return {s, s_prev, K, U, Gh};
}

std::vector<Tensor> chunk_forward(int64_t L, bool mem, int64_t H, int64_t dk, int64_t dv,
                                  int64_t f, double eps, std::vector<Tensor> w_in,
                                  std::vector<Tensor> b_in, std::vector<Tensor> w_out,
                                  Tensor w_fg, Tensor b_fg, std::optional<Tensor> A, Tensor fuse,
                                  Tensor s0, Tensor s_prev0, std::optional<Tensor> M0, Tensor P,
                                  std::optional<Tensor> S_out) {
  check_rows(fuse, "fuse");
  check_rows(P, "P");
  if (S_out) check_rows(*S_out, "S_out");
  TORCH_CHECK(!mem || (A && M0), "chunk_forward: the memory needs A and M0");
  Dims D{L, H, dk, dv, f, fuse.size(2), fuse.size(0), fuse.size(1), mem, eps};
  std::vector<Tensor> result;
  AT_DISPATCH_FLOATING_TYPES(s0.scalar_type(), "chunk_forward", [&] {
    result = forward_impl<scalar_t>(D, w_in, b_in, w_out, w_fg, b_fg, A, fuse, s0, s_prev0, M0,
                                    P, S_out);
  });
  return result;
}

// ================================================================== reverse sweep
struct Acts {  // what `chunk._recompute_chunk` produced (see ChunkActs in ops/gpn_step/interface.py)
  std::vector<Tensor> c, n, y, o, ro, q, rq;
  Tensor n_p, gate, p;
  Tensor k_pre, k, v, beta, U, G, pred, rk, M0;
};

// The reverse sweep defers the history terms' pushes onto dU_j, dK_j (j before the current
// block of steps) and applies them once per block of this many steps, as a few axpys per j with
// everything in L1. Pushed at every step, those read-modify-writes of the chunk's adjoints were
// most of the sweep's memory traffic outside the matmuls (measured: deferring them took ~23 us
// off a SMALL step's ~560; blocks of 4 and 16 measured the same as 8).
constexpr int64_t kSweepBlock = 8;

struct Adjoints {  // accumulators the sweep adds to (allocated by the caller)
  std::vector<Tensor> dY, dZ, dRq;
  Tensor dYfg, d_fuse, dK, dU, dG, dRk, dA;
};

template <typename T>
std::vector<Tensor> backward_impl(const Dims& D, const std::vector<Tensor>& wt_in,
                                  const std::vector<Tensor>& wt_out, const Tensor& wt_fg,
                                  const Tensor& A_t, const Acts& X, const Tensor& dP,
                                  const std::optional<Tensor>& ds_end,
                                  const std::optional<Tensor>& ds_prev_end, Adjoints& J) {
  const int64_t B = D.B, C = D.C, d = D.d, H = D.H, dk = D.dk, dv = D.dv, Hk = D.Hk(), Hv = D.Hv();
  const T eps = T(D.eps);
  auto opts = dP.options();
  Tensor dg = ds_end ? ds_end->contiguous().clone() : at::zeros({B, d}, opts);
  Tensor dc = at::empty({B, d}, opts), dc_in = at::empty({B, d}, opts);
  Tensor t1 = at::empty({B, d}, opts), dcm = at::empty({B, d}, opts);
  std::vector<Tensor> dh;
  for (int64_t i = 0; i < D.L; ++i) dh.push_back(at::empty({B, wt_out[i].size(1)}, opts));
  Tensor dkn, dk_pre0, dGs, dAb, coef, dvecs;
  if (D.mem) {
    dkn = at::zeros({B, Hk}, opts);   // d(pre-activation of k_{t+1})
    dk_pre0 = at::zeros({B, Hk}, opts);
    dGs = at::zeros({B, H}, opts);    // suffix sum of dG: d log a_t
    dAb = at::zeros({B, H}, opts);
    // Per (b, h), for the steps of the current block: the deferred pushes' coefficients
    // (four per earlier step j: onto dU_j of do_t and dpred_t, onto dK_j of q_t and k_t) and
    // the vectors they multiply, do_t and dpred_t.
    coef = at::empty({B, H, kSweepBlock, 4, C}, opts);
    dvecs = at::empty({B, H, kSweepBlock, 2, dv}, opts);
  }
  const Strided<T> dPv(dP), dFv(J.d_fuse);
  Strided<T> qv, rqv, kv, vv, betav, Uv, Gv, predv, rkv, dKv, dUv, dGv, dRkv;
  std::vector<Strided<T>> qs, rqs, dRqs;
  const T* Ad = nullptr;
  if (D.mem) {
    for (int64_t i = 0; i < D.L; ++i) {
      qs.emplace_back(X.q[i]);
      rqs.emplace_back(X.rq[i]);
      dRqs.emplace_back(J.dRq[i]);
    }
    kv = Strided<T>(X.k); vv = Strided<T>(X.v); betav = Strided<T>(X.beta);
    Uv = Strided<T>(X.U); Gv = Strided<T>(X.G); predv = Strided<T>(X.pred);
    rkv = Strided<T>(X.rk); dKv = Strided<T>(J.dK); dUv = Strided<T>(J.dU);
    dGv = Strided<T>(J.dG); dRkv = Strided<T>(J.dRk);
    Ad = A_t.data_ptr<T>();
  }
  // The reverse reads M0 as M0 x (x: drq, drk), i.e. along M0^T's rows (see matvec_rows);
  // one transposed copy per chunk costs a fraction of one step's pass over M0.
  const Tensor M0T = D.mem ? X.M0.transpose(-2, -1).contiguous() : Tensor();
  const T* M0d = D.mem ? M0T.data_ptr<T>() : nullptr;
  T* dgd = dg.data_ptr<T>();
  T* dcd = dc.data_ptr<T>();
  T* dcin = dc_in.data_ptr<T>();
  T* t1d = t1.data_ptr<T>();
  T* dcmd = dcm.data_ptr<T>();
  const auto G_at = [&](int64_t b, int64_t h, int64_t j) -> T& { return *Gv.at(b, h, j); };
  const auto dG_at = [&](int64_t b, int64_t h, int64_t j) -> T& { return *dGv.at(b, h, j); };

  // Rows of the (C, B, width) activations at step t, without building a tensor per step.
  const auto row = [&](const Tensor& t, int64_t tau) { return t.data_ptr<T>() + tau * t.stride(0); };
  const T* dspe = ds_prev_end ? ds_prev_end->data_ptr<T>() : nullptr;
  // The last stage of a layer's reverse (dc = dc_in + rms_back(.., dY W_in^T)) runs at the
  // start of the next parallel region instead of one of its own: one fork/join less per layer.
  struct Pending { bool on = false; const T* nin = nullptr; const T* cin = nullptr; bool sprev = false; };
  Pending pending;
  const auto finish = [&](int64_t b) {
    if (!pending.on) return;
    T* dcb = dcd + b * d;
    rms_back(pending.nin + b * d, pending.cin + b * d, dcmd + b * d, dcb, d, eps);
    for (int64_t j = 0; j < d; ++j) dcb[j] += dcin[b * d + j];
    if (pending.sprev)   // s_prev at the chunk's end is the state that entered step C-1
      for (int64_t j = 0; j < d; ++j) dcb[j] += dspe[b * d + j];
  };

  for (int64_t tau = C - 1; tau >= 0; --tau) {
    // Ground: s_next = gate * p + fuse.
    const T* pd = row(X.p, tau);
    const T* gated = row(X.gate, tau);
    const T* npd = row(X.n_p, tau);
    Tensor dyfg = J.dYfg[tau];
    T* dyfgd = dyfg.data_ptr<T>();
    over_rows(B, [&](int64_t b) {
      if (pending.on) {   // the previous (later) step's end: dg = the state gradient
        finish(b);
        std::copy(dcd + b * d, dcd + (b + 1) * d, dgd + b * d);
      }
      const T* dgb = dgd + b * d;
      std::copy(dgb, dgb + d, dFv.at(b, tau));
      for (int64_t j = 0; j < d; ++j) {
        const T gt = gated[b * d + j];
        dyfgd[b * d + j] = dgb[j] * pd[b * d + j] * gt * (T(1) - gt);
      }
    });
    pending.on = false;
    matmul_into(t1, dyfg, wt_fg, std::nullopt);
    for (int64_t i = D.L - 1; i >= 0; --i) {
      const InCols col(D, i);
      const Tensor dYt = J.dY[i][tau];
      const int64_t Win = X.y[i].size(2), Wout = dh[i].size(1);
      const T* yd = row(X.y[i], tau);
      T* dyd = dYt.data_ptr<T>();
      const T* cin = row(X.c[i], tau);
      const T* nin = row(X.n[i], tau);
      T* dZd = row(J.dZ[i], tau);
      const T* rod = D.mem ? row(X.ro[i], tau) : nullptr;
      const T* od = D.mem ? row(X.o[i], tau) : nullptr;
      const T* kpred = D.mem && i == 0 ? row(X.k_pre, tau) : nullptr;
      const bool top = i == D.L - 1;
      over_rows(B, [&](int64_t b) {
        if (top) {   // dc of the last layer's output p: decode, ground gate, the next state
          rms_back(npd + b * d, pd + b * d, t1d + b * d, dcd + b * d, d, eps);
          const T* dPb = dPv.at(b, tau);
          for (int64_t j = 0; j < d; ++j)
            dcd[b * d + j] += dPb[j] + gated[b * d + j] * dgd[b * d + j];
        } else {
          finish(b);
        }
        T* dpg = dyd + b * Win + col.pg;
        T* sg = dcin + b * d;
        sigmoid_vec(yd + b * Win + col.pg, sg, d);
        for (int64_t j = 0; j < d; ++j) {
          const T x = dcd[b * d + j];
          dZd[b * d + j] = x;
          dpg[j] = x * cin[b * d + j] * sg[j] * (T(1) - sg[j]);
          sg[j] *= x;   // dc_in = dc * sigmoid(pg)
        }
      });
      pending.on = false;
      matmul_into(dh[i], dc, wt_out[i], std::nullopt);
      const T* dhd = dh[i].data_ptr<T>();
      over_rows(B, [&](int64_t b) {
        const T* yb = yd + b * Win;
        T* dyb = dyd + b * Win;
        const T* dhb = dhd + b * Wout;
        // FFN: hidden = silu(a) * b
        const int64_t off = D.mem ? Hv : 0;
        T* sa = dyb + col.ffn + D.f;   // sigmoid(a), then overwritten by d b
        sigmoid_vec(yb + col.ffn, sa, D.f);
        for (int64_t j = 0; j < D.f; ++j) {
          const T a = yb[col.ffn + j], bb = yb[col.ffn + D.f + j], g = dhb[off + j], s = sa[j];
          dyb[col.ffn + j] = g * bb * s * (T(1) + a * (T(1) - s));
          sa[j] = g * a * s;
        }
        if (!D.mem) return;
        std::vector<T> dsr(Hv), dov(Hv), dq(dk), scratch(dk), dpred(dv), dkv(dk), wr_(C), ww_(C);
        const T* ro = rod + b * Hv;
        const T* ob = od + b * Hv;
        T* srg = dyb + col.rg;          // sigmoid(rg), then overwritten by d rg
        sigmoid_vec(yb + col.rg, srg, Hv);
        for (int64_t v = 0; v < Hv; ++v) {
          const T rg = yb[col.rg + v], s = srg[v], g = dhb[v];
          dsr[v] = g * rg * s;   // d rms(o)
          srg[v] = g * ro[v] * s * (T(1) + rg * (T(1) - s));
        }
        rms_back(ro, ob, dsr.data(), dov.data(), Hv, eps);
        for (int64_t h = 0; h < H; ++h) {
          // Read after write: o = e^{G_t} M0^T q + sum_{j<=t} e^{G_t - G_j} (q.k_j) u_j.
          const T* MT = M0d + (b * H + h) * dv * dk;   // M0^T of this row and head
          const T* q = qs[i].at(b, h, tau);
          const T* dob = dov.data() + h * dv;
          const T Gt = G_at(b, h, tau), eG = std::exp(Gt);
          T* drq = dRqs[i].at(b, h, tau);
          for (int64_t v = 0; v < dv; ++v) drq[v] = eG * dob[v];
          const T dGt = eG * dot(dob, rqs[i].at(b, h, tau), dv);
          std::fill(dq.begin(), dq.end(), T(0));
          // The read's term j, decay weight w = e^{G_t - G_j}: adds to dU_j, dK_j, dG_j and dq;
          // returns its share of dG_t.
          const auto read_term = [&](int64_t j, T w) -> T {
            const T* Kj = kv.at(b, h, j);
            const T sdot = dot(Kj, q, dk);
            const T dsd = dot(Uv.at(b, h, j), dob, dv) * w;
            axpy(w * sdot, dob, dUv.at(b, h, j), dv);
            axpy(dsd, Kj, dq.data(), dk);
            axpy(dsd, q, dKv.at(b, h, j), dk);
            dG_at(b, h, j) -= dsd * sdot;
            return dsd * sdot;
          };
          // j = t first: it completes du_t, which the write's reverse below needs.
          T sum_dw = read_term(tau, T(1));
          if (i != 0) {   // a read-only layer
            exp_from(Gt, Gv.at(b, h, 0), wr_.data(), tau);
            for (int64_t j = 0; j < tau; ++j) sum_dw += read_term(j, wr_[j]);
            dG_at(b, h, tau) += dGt + sum_dw;
            matvec_rows(MT, drq, static_cast<const T*>(nullptr), dq.data(),
                        static_cast<T*>(nullptr), dv, dk);
            l2n_relu_back(yb + col.q + h * dk, dq.data(), dyb + col.q + h * dk, scratch.data(), dk);
            continue;
          }
          // Step t's write reversed: u_t = beta (v - M_{t-1}^T k_t) and the decay.
          const T* du = dUv.at(b, h, tau);
          const T beta = *betav.at(b, h, tau);
          T* dkn_bh = dkn.data_ptr<T>() + b * Hk + h * dk;
          std::copy(dkn_bh, dkn_bh + dk, dyb + col.kn + h * dk);   // k_{t+1} is computed at step t
          const T* vt = vv.at(b, h, tau);
          const T* pr = predv.at(b, h, tau);
          const T s_err = dot(du, vt, dv) - dot(du, pr, dv);
          dyb[col.beta + h] = s_err * beta * (T(1) - beta);
          for (int64_t v = 0; v < dv; ++v) {
            dyb[col.v + h * dv + v] = beta * du[v];
            dpred[v] = -beta * du[v];
          }
          // pred = e^{G_{t-1}} M0^T k_t + sum_{j<t} e^{G_{t-1} - G_j} (k_t.k_j) u_j
          const T* kt = kv.at(b, h, tau);
          const T Gp = tau ? G_at(b, h, tau - 1) : T(0), eGp = std::exp(Gp);
          T* drk = dRkv.at(b, h, tau);
          for (int64_t v = 0; v < dv; ++v) drk[v] = eGp * dpred[v];
          std::fill(dkv.begin(), dkv.end(), T(0));
          // The read's and the write's history terms in one pass over the chunk's k_j, u_j.
          // Onto dU_j, dK_j of steps before this block they are deferred (kSweepBlock).
          const int64_t blk = tau - tau % kSweepBlock, slot = tau - blk;
          T* cf = coef.data_ptr<T>() + ((b * H + h) * kSweepBlock + slot) * 4 * C;
          T* dvs = dvecs.data_ptr<T>() + ((b * H + h) * kSweepBlock + slot) * 2 * dv;
          std::copy(dob, dob + dv, dvs);
          std::copy(dpred.data(), dpred.data() + dv, dvs + dv);
          T sw = 0;
          exp_from(Gt, Gv.at(b, h, 0), wr_.data(), tau);
          exp_from(Gp, Gv.at(b, h, 0), ww_.data(), tau);
          for (int64_t j = 0; j < tau; ++j) {
            const T* Kj = kv.at(b, h, j);
            const T* Uj = Uv.at(b, h, j);
            const T wr = wr_[j], ww = ww_[j];
            T sr, sk, ur, uw;
            dot2(q, kt, Kj, dk, sr, sk);
            dot2(dob, dpred.data(), Uj, dv, ur, uw);
            const T dr = ur * wr, dw_ = uw * ww;
            const T ar = wr * sr, aw = ww * sk;
            axpy2(dr, dw_, Kj, dq.data(), dkv.data(), dk);
            if (j < blk) {
              cf[j] = ar;
              cf[C + j] = aw;
              cf[2 * C + j] = dr;
              cf[3 * C + j] = dw_;
            } else {
              axpy_pair(ar, dob, aw, dpred.data(), dUv.at(b, h, j), dv);
              axpy_pair(dr, q, dw_, kt, dKv.at(b, h, j), dk);
            }
            dG_at(b, h, j) -= dr * sr + dw_ * sk;
            sum_dw += dr * sr;
            sw += dw_ * sk;
          }
          if (slot == 0 && blk > 0) {   // the block is done: apply its deferred pushes
            const int64_t steps = std::min(kSweepBlock, C - blk);
            const T* cf0 = coef.data_ptr<T>() + (b * H + h) * kSweepBlock * 4 * C;
            const T* dv0 = dvecs.data_ptr<T>() + (b * H + h) * kSweepBlock * 2 * dv;
            for (int64_t j = 0; j < blk; ++j) {
              T* dUj = dUv.at(b, h, j);
              T* dKj = dKv.at(b, h, j);
              for (int64_t s_ = 0; s_ < steps; ++s_) {
                const T* c_ = cf0 + s_ * 4 * C;
                const T* dos = dv0 + s_ * 2 * dv;
                const T ar = c_[j], aw = c_[C + j], dr = c_[2 * C + j], dw_ = c_[3 * C + j];
                axpy_pair(ar, dos, aw, dos + dv, dUj, dv);
                axpy_pair(dr, qs[0].at(b, h, blk + s_), dw_, kv.at(b, h, blk + s_), dKj, dk);
              }
            }
          }
          dG_at(b, h, tau) += dGt + sum_dw;
          if (tau) dG_at(b, h, tau - 1) += eGp * dot(dpred.data(), rkv.at(b, h, tau), dv) + sw;
          // One pass over M0 for both: dq += M0 drq, dk += M0 drk.
          matvec_rows(MT, drq, drk, dq.data(), dkv.data(), dv, dk);
          l2n_relu_back(yb + col.q + h * dk, dq.data(), dyb + col.q + h * dk, scratch.data(), dk);
          T* dKt = dKv.at(b, h, tau);
          for (int64_t a = 0; a < dk; ++a) dKt[a] += dkv[a];
          // G_t = G_{t-1} + log a_t, so d log a_t = sum over t' >= t of dG_t' (complete now).
          T& gs = dGs.data_ptr<T>()[b * H + h];
          gs += dG_at(b, h, tau);
          const T dpre = yb[col.decay + h];
          dyb[col.decay + h] = gs * (-Ad[h]) * sigmoid(dpre);
          dAb.data_ptr<T>()[b * H + h] -= gs * softplus(dpre);
          T* dst = tau ? dkn_bh : dk_pre0.data_ptr<T>() + b * Hk + h * dk;
          l2n_relu_back(kpred + b * Hk + h * dk, dKt, dst, scratch.data(), dk);
        }
      });
      matmul_into(dcm, dYt, wt_in[i], std::nullopt);
      pending = Pending{true, nin, cin, i == 0 && tau == C - 1 && dspe != nullptr};
    }
  }
  over_rows(B, [&](int64_t b) {   // the gradient of the state entering the chunk
    finish(b);
    std::copy(dcd + b * d, dcd + (b + 1) * d, dgd + b * d);
  });
  if (D.mem) J.dA.add_(dAb.sum(0));
  return {dg, dk_pre0};
}

std::vector<Tensor> chunk_backward(
    int64_t L, bool mem, int64_t H, int64_t dk, int64_t dv, int64_t f, double eps,
    std::vector<Tensor> wt_in, std::vector<Tensor> wt_out, Tensor wt_fg, std::optional<Tensor> A,
    std::vector<Tensor> c, std::vector<Tensor> n, std::vector<Tensor> y, std::vector<Tensor> o,
    std::vector<Tensor> ro, std::vector<Tensor> q, std::vector<Tensor> rq, Tensor n_p,
    Tensor gate, Tensor p, std::vector<Tensor> memory_acts, Tensor dP,
    std::optional<Tensor> ds_end, std::optional<Tensor> ds_prev_end, std::vector<Tensor> dY,
    std::vector<Tensor> dZ, std::vector<Tensor> dRq, Tensor dYfg, Tensor d_fuse,
    std::vector<Tensor> memory_adjoints) {
  // Dense activations and adjoints are read as rows of contiguous (C, B, width) blocks.
  const auto dense = [](std::vector<Tensor> ts) {
    for (auto& t : ts) t = t.contiguous();
    return ts;
  };
  for (const auto& t : dY) TORCH_CHECK(t.is_contiguous(), "dY: expected contiguous (C, B, width)");
  for (const auto& t : dZ) TORCH_CHECK(t.is_contiguous(), "dZ: expected contiguous (C, B, d)");
  TORCH_CHECK(dYfg.is_contiguous(), "dYfg: expected contiguous (C, B, d)");
  Acts X{dense(c), dense(n), dense(y), dense(o), dense(ro), q, rq,
         n_p.contiguous(), gate.contiguous(), p.contiguous()};
  if (ds_prev_end) ds_prev_end = ds_prev_end->contiguous();
  check_rows(dP, "dP");
  check_rows(d_fuse, "d_fuse");
  Adjoints J{dY, dZ, dRq, dYfg, d_fuse};
  Tensor A_t;
  if (mem) {
    TORCH_CHECK(memory_acts.size() == 9 && memory_adjoints.size() == 5 && A,
                "chunk_backward: expected 9 memory activations and 5 memory adjoints");
    X.k_pre = memory_acts[0].contiguous(); X.k = memory_acts[1]; X.v = memory_acts[2];
    X.beta = memory_acts[3]; X.U = memory_acts[4]; X.G = memory_acts[5];
    X.pred = memory_acts[6]; X.rk = memory_acts[7]; X.M0 = memory_acts[8].contiguous();
    J.dK = memory_adjoints[0]; J.dU = memory_adjoints[1]; J.dG = memory_adjoints[2];
    J.dRk = memory_adjoints[3]; J.dA = memory_adjoints[4];
    for (const auto& t : {X.k, X.v, X.U, X.G, X.pred, X.rk, J.dK, J.dU, J.dRk})
      check_rows(t, "memory");
    for (const auto& t : q) check_rows(t, "q");
    for (const auto& t : dRq) check_rows(t, "dRq");
    A_t = A->contiguous();
  }
  Dims D{L, H, dk, dv, f, n_p.size(2), n_p.size(1), n_p.size(0), mem, eps};
  std::vector<Tensor> result;
  AT_DISPATCH_FLOATING_TYPES(dP.scalar_type(), "chunk_backward", [&] {
    result = backward_impl<scalar_t>(D, wt_in, wt_out, wt_fg, A_t, X, dP, ds_end, ds_prev_end, J);
  });
  return result;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gpn_scale: fused CPU kernels of the sequence engine's sequential phases";
  m.def("chunk_forward", &chunk_forward, "the steps of one chunk, no autograd (see engine._run_chunk)");
  m.def("chunk_backward", &chunk_backward, "one chunk's reverse sweep (see ops/gpn_step/chunk.py, _chunk_backward)");
}
