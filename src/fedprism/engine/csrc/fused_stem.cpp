// A model's first block, conv(k x k, stride 1, no padding) -> ReLU -> max_pool2d(2), in one pass on the CPU:
// fedprism/engine/fused.py builds and loads this file. Each output is
//   relu(max over the 2 x 2 window of (b[o] + sum_t w[o][t] x[patch t]))
// with the taps t summed in order (channel, row, column); the k x k conv map is never written.
// x [G, N, C, H, W], w [G, O, C*k*k], b [G, O] -> [G, N, O, (H-k+1)/2, (W-k+1)/2]: group g's images
// through group g's filters (G = 1 with the filters of all models stacked: a shared input batch).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
inline v16 load(const float* p) { return *(const v16u*)p; }
inline void store(float* p, v16 v) { *(v16u*)p = v; }

// The conv outputs at the four corners d of the pooled positions [p0, p0 + 16) for channels q < OB:
// acc[q][d] = b[q] + sum_t w[q][t] P[t][d][p0 ..], the taps in order. P is one image's patch matrix
// [T][4][Q] (Q: the pooled positions, padded to a multiple of 16).
template <int OB>
inline void corners(const float* P, int64_t Q, int64_t T, const float* w, const float* b, int64_t p0,
                    v16 (&acc)[OB][4]) {
#pragma GCC unroll 8
  for (int q = 0; q < OB; ++q)
#pragma GCC unroll 4
    for (int d = 0; d < 4; ++d) acc[q][d] = v16{} + b[q];
  for (int64_t t = 0; t < T; ++t) {
    v16 x[4];
#pragma GCC unroll 4
    for (int d = 0; d < 4; ++d) x[d] = load(P + (t * 4 + d) * Q + p0);
#pragma GCC unroll 8
    for (int q = 0; q < OB; ++q) {
      const float wv = w[q * T + t];
#pragma GCC unroll 4
      for (int d = 0; d < 4; ++d) acc[q][d] += wv * x[d];
    }
  }
}

// One image's patch matrix P [C*k*k][4][Q]: tap t of pooled position (i, j) at window corner d.
void im2col4(const float* xs, int64_t C, int64_t H, int64_t W, int64_t k, int64_t Hp, int64_t Wp, int64_t Q,
             float* P) {
  for (int64_t c = 0; c < C; ++c)
    for (int64_t ki = 0; ki < k; ++ki)
      for (int64_t kj = 0; kj < k; ++kj)
        for (int64_t d = 0; d < 4; ++d) {
          float* pt = P + (((c * k + ki) * k + kj) * 4 + d) * Q;
          for (int64_t i = 0; i < Hp; ++i) {
            const float* xr = xs + (c * H + 2 * i + (d >> 1) + ki) * W + kj + (d & 1);
            for (int64_t j = 0; j < Wp; ++j) pt[i * Wp + j] = xr[2 * j];
          }
        }
}

// Channels q < OB, pooled positions [p0, p0 + n): out = relu(max over the corners), in rows of QO. With
// `arg`, also the first corner holding the window's maximum, or 255 where that maximum is <= 0 (ReLU's
// gradient is 0 there): max_pool2d's choice after ReLU, in exact arithmetic.
template <int OB>
inline void tile(const float* P, int64_t Q, int64_t T, const float* w, const float* b, float* out,
                 uint8_t* arg, int64_t QO, int64_t p0, int n) {
  v16 acc[OB][4];
  corners<OB>(P, Q, T, w, b, p0, acc);
#pragma GCC unroll 8
  for (int q = 0; q < OB; ++q) {
    v16 m = acc[q][0], idx = v16{};
#pragma GCC unroll 3
    for (int d = 1; d < 4; ++d) {
      const auto gt = acc[q][d] > m;
      m = gt ? acc[q][d] : m;
      idx = gt ? v16{} + (float)d : idx;
    }
    const auto on = m > v16{};
    m = on ? m : v16{};
    if (n == 16) {
      store(out + q * QO + p0, m);
    } else {
      for (int l = 0; l < n; ++l) out[q * QO + p0 + l] = m[l];
    }
    if (arg != nullptr) {
      idx = on ? idx : v16{} + 255.f;
      for (int l = 0; l < n; ++l) arg[q * QO + p0 + l] = (uint8_t)idx[l];
    }
  }
}

template <int OB>
void channels(const float* P, int64_t Q, int64_t T, const float* w, const float* b, float* out, uint8_t* arg,
              int64_t QO) {
  for (int64_t p0 = 0; p0 < QO; p0 += 16)
    tile<OB>(P, Q, T, w, b, out, arg, QO, p0, (int)std::min<int64_t>(16, QO - p0));
}

// The block's output, and with keep_arg each output's winning corner (uint8; else an empty tensor).
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x_, const at::Tensor& w_, const at::Tensor& b_,
                                           int64_t k, bool keep_arg) {
  TORCH_CHECK(x_.dim() == 5 && w_.dim() == 3 && b_.dim() == 2,
              "fused stem: x [G,N,C,H,W], w [G,O,T], b [G,O]");
  TORCH_CHECK(x_.scalar_type() == at::kFloat && w_.scalar_type() == at::kFloat &&
              b_.scalar_type() == at::kFloat, "fused stem: float32 only");
  const at::Tensor x = x_.contiguous(), w = w_.contiguous(), b = b_.contiguous();
  const int64_t G = x.size(0), N = x.size(1), C = x.size(2), H = x.size(3), W = x.size(4);
  const int64_t O = w.size(1), T = C * k * k, Hp = (H - k + 1) / 2, Wp = (W - k + 1) / 2;
  TORCH_CHECK(w.size(0) == G && w.size(2) == T && b.size(0) == G && b.size(1) == O && Hp > 0 && Wp > 0,
              "fused stem: shapes do not match");
  const int64_t QO = Hp * Wp, Q = (QO + 15) / 16 * 16;
  at::Tensor out = at::empty({G, N, O, Hp, Wp}, x.options());
  at::Tensor arg = at::empty({keep_arg ? G : 0, N, O, Hp, Wp}, x.options().dtype(at::kByte));
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* op = out.data_ptr<float>();
  uint8_t* ap = keep_arg ? arg.data_ptr<uint8_t>() : nullptr;
  at::parallel_for(0, G * N, 1, [&](int64_t s0, int64_t s1) {
    std::vector<float> P(T * 4 * Q, 0.f);
    for (int64_t s = s0; s < s1; ++s) {
      im2col4(xp + s * C * H * W, C, H, W, k, Hp, Wp, Q, P.data());
      const int64_t g = s / N;
      for (int64_t o0 = 0; o0 < O; o0 += 6) {
        const float* wb = wp + (g * O + o0) * T;
        const float* bb = bp + g * O + o0;
        float* od = op + (s * O + o0) * QO;
        uint8_t* ad = ap == nullptr ? nullptr : ap + (s * O + o0) * QO;
        switch (std::min<int64_t>(6, O - o0)) {
          case 6: channels<6>(P.data(), Q, T, wb, bb, od, ad, QO); break;
          case 5: channels<5>(P.data(), Q, T, wb, bb, od, ad, QO); break;
          case 4: channels<4>(P.data(), Q, T, wb, bb, od, ad, QO); break;
          case 3: channels<3>(P.data(), Q, T, wb, bb, od, ad, QO); break;
          case 2: channels<2>(P.data(), Q, T, wb, bb, od, ad, QO); break;
          default: channels<1>(P.data(), Q, T, wb, bb, od, ad, QO); break;
        }
      }
    }
  });
  return {out, arg};
}

at::Tensor stem_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, int64_t k) {
  return std::get<0>(forward(x, w, b, k, false));
}

std::tuple<at::Tensor, at::Tensor> stem_train_forward(const at::Tensor& x, const at::Tensor& w,
                                                      const at::Tensor& b, int64_t k) {
  return forward(x, w, b, k, true);
}

// ---- the backward: the filters' and biases' gradients from the gradient of the block's output, its
// winning corners and the images (not the input's gradient: the block is a model's first layer).
// fedprism/engine/fused.py composes forward and backward with torch.func (StemSplit). ----

// acc[o][t] (vector partial sums) += sum over corners d and positions of Gd[o][d][.] * P[t][d][.]
template <int OB, int TB>
inline void grad_block(const float* Gd, const float* P, int64_t Q, int64_t o0, int64_t t0, v16* acc,
                       int64_t T) {
  v16 a[OB][TB];
#pragma GCC unroll 8
  for (int q = 0; q < OB; ++q)
#pragma GCC unroll 4
    for (int r = 0; r < TB; ++r) a[q][r] = acc[(o0 + q) * T + t0 + r];
  for (int64_t d = 0; d < 4; ++d)
    for (int64_t p0 = 0; p0 < Q; p0 += 16) {
      v16 g[OB], p[TB];
#pragma GCC unroll 8
      for (int q = 0; q < OB; ++q) g[q] = load(Gd + ((o0 + q) * 4 + d) * Q + p0);
#pragma GCC unroll 4
      for (int r = 0; r < TB; ++r) p[r] = load(P + ((t0 + r) * 4 + d) * Q + p0);
#pragma GCC unroll 8
      for (int q = 0; q < OB; ++q)
#pragma GCC unroll 4
        for (int r = 0; r < TB; ++r) a[q][r] += g[q] * p[r];
    }
#pragma GCC unroll 8
  for (int q = 0; q < OB; ++q)
#pragma GCC unroll 4
    for (int r = 0; r < TB; ++r) acc[(o0 + q) * T + t0 + r] = a[q][r];
}

template <int OB>
inline void grad_rows(const float* Gd, const float* P, int64_t Q, int64_t o0, v16* acc, int64_t T) {
  int64_t t0 = 0;
  for (; t0 + 4 <= T; t0 += 4) grad_block<OB, 4>(Gd, P, Q, o0, t0, acc, T);
  for (; t0 < T; ++t0) grad_block<OB, 1>(Gd, P, Q, o0, t0, acc, T);
}

// grad [G, N, O, Hp, Wp], arg (from stem_train_forward), x [G or 1, N, C, H, W] -> (dw [G, O, T], db [G, O])
std::tuple<at::Tensor, at::Tensor> stem_backward(const at::Tensor& grad_, const at::Tensor& arg_,
                                                 const at::Tensor& x_, int64_t k) {
  const at::Tensor grad = grad_.contiguous(), arg = arg_.contiguous(), x = x_.contiguous();
  TORCH_CHECK(grad.dim() == 5 && arg.sizes() == grad.sizes() && x.dim() == 5 &&
              arg.scalar_type() == at::kByte,
              "stem_backward: grad/arg [G,N,O,Hp,Wp], x [G or 1,N,C,H,W]");
  const int64_t G = grad.size(0), N = grad.size(1), O = grad.size(2), Hp = grad.size(3), Wp = grad.size(4);
  const int64_t C = x.size(2), H = x.size(3), W = x.size(4), T = C * k * k;
  TORCH_CHECK((x.size(0) == G || x.size(0) == 1) && x.size(1) == N && (H - k + 1) / 2 == Hp &&
              (W - k + 1) / 2 == Wp, "stem_backward: shapes do not match");
  const int64_t QO = Hp * Wp, Q = (QO + 15) / 16 * 16, xg = x.size(0) == 1 ? 0 : 1;
  at::Tensor dw = at::empty({G, O, T}, grad.options());
  at::Tensor db = at::empty({G, O}, grad.options());
  const float* gp = grad.data_ptr<float>();
  const uint8_t* ap = arg.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* dwp = dw.data_ptr<float>();
  float* dbp = db.data_ptr<float>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> P(T * 4 * Q, 0.f), Gd(O * 4 * Q, 0.f);
    std::vector<v16> acc(O * T);
    for (int64_t g = g0; g < g1; ++g) {
      std::fill(acc.begin(), acc.end(), v16{});
      std::vector<float> bsum(O, 0.f);
      for (int64_t n = 0; n < N; ++n) {
        im2col4(xp + (g * xg * N + n) * C * H * W, C, H, W, k, Hp, Wp, Q, P.data());
        const float* gn = gp + (g * N + n) * O * QO;
        const uint8_t* an = ap + (g * N + n) * O * QO;
        std::fill(Gd.begin(), Gd.end(), 0.f);
        for (int64_t o = 0; o < O; ++o)
          for (int64_t q = 0; q < QO; ++q) {
            const uint8_t a = an[o * QO + q];
            if (a < 4) {
              const float v = gn[o * QO + q];
              Gd[(o * 4 + a) * Q + q] = v;
              bsum[o] += v;
            }
          }
        for (int64_t o0 = 0; o0 < O; o0 += 6) {
          switch (std::min<int64_t>(6, O - o0)) {
            case 6: grad_rows<6>(Gd.data(), P.data(), Q, o0, acc.data(), T); break;
            case 5: grad_rows<5>(Gd.data(), P.data(), Q, o0, acc.data(), T); break;
            case 4: grad_rows<4>(Gd.data(), P.data(), Q, o0, acc.data(), T); break;
            case 3: grad_rows<3>(Gd.data(), P.data(), Q, o0, acc.data(), T); break;
            case 2: grad_rows<2>(Gd.data(), P.data(), Q, o0, acc.data(), T); break;
            default: grad_rows<1>(Gd.data(), P.data(), Q, o0, acc.data(), T); break;
          }
        }
      }
      for (int64_t o = 0; o < O; ++o) {
        dbp[g * O + o] = bsum[o];
        for (int64_t t = 0; t < T; ++t) {
          const v16 v = acc[o * T + t];
          float s = 0.f;
          for (int l = 0; l < 16; ++l) s += v[l];
          dwp[(g * O + o) * T + t] = s;
        }
      }
    }
  });
  return {dw, db};
}

}  // namespace

TORCH_LIBRARY(fedprism_kernels, m) {
  m.def("stem_forward(Tensor x, Tensor w, Tensor b, int k) -> Tensor");
  m.def("stem_train_forward(Tensor x, Tensor w, Tensor b, int k) -> (Tensor, Tensor)");
  m.def("stem_backward(Tensor grad, Tensor arg, Tensor x, int k) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(fedprism_kernels, CPU, m) {
  m.impl("stem_forward", &stem_forward);
  m.impl("stem_train_forward", &stem_train_forward);
  m.impl("stem_backward", &stem_backward);
}
