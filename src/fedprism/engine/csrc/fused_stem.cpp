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
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
inline v16 load(const float* p) { return *(const v16u*)p; }
inline void store(float* p, v16 v) { *(v16u*)p = v; }
inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }

// Channels q < OB, pooled positions [p0, p0 + n): the four window corners d of each position are four
// planes of the sample's patch matrix P [T][4][Q] (Q: the pooled positions, padded to a multiple of 16).
template <int OB>
inline void tile(const float* P, int64_t Q, int64_t T, const float* w, const float* b, float* out,
                 int64_t QO, int64_t p0, int n) {
  v16 acc[OB][4];
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
#pragma GCC unroll 8
  for (int q = 0; q < OB; ++q) {
    v16 m = vmax(vmax(vmax(acc[q][0], acc[q][1]), vmax(acc[q][2], acc[q][3])), v16{});
    if (n == 16) {
      store(out + q * QO + p0, m);
    } else {
      for (int l = 0; l < n; ++l) out[q * QO + p0 + l] = m[l];
    }
  }
}

template <int OB>
void channels(const float* P, int64_t Q, int64_t T, const float* w, const float* b, float* out, int64_t QO) {
  for (int64_t p0 = 0; p0 < QO; p0 += 16)
    tile<OB>(P, Q, T, w, b, out, QO, p0, (int)std::min<int64_t>(16, QO - p0));
}

at::Tensor stem_forward(const at::Tensor& x_, const at::Tensor& w_, const at::Tensor& b_, int64_t k) {
  TORCH_CHECK(x_.dim() == 5 && w_.dim() == 3 && b_.dim() == 2,
              "stem_forward: x [G,N,C,H,W], w [G,O,T], b [G,O]");
  TORCH_CHECK(x_.scalar_type() == at::kFloat && w_.scalar_type() == at::kFloat &&
              b_.scalar_type() == at::kFloat, "stem_forward: float32 only");
  const at::Tensor x = x_.contiguous(), w = w_.contiguous(), b = b_.contiguous();
  const int64_t G = x.size(0), N = x.size(1), C = x.size(2), H = x.size(3), W = x.size(4);
  const int64_t O = w.size(1), T = C * k * k, Hp = (H - k + 1) / 2, Wp = (W - k + 1) / 2;
  TORCH_CHECK(w.size(0) == G && w.size(2) == T && b.size(0) == G && b.size(1) == O && Hp > 0 && Wp > 0,
              "stem_forward: shapes do not match");
  const int64_t QO = Hp * Wp, Q = (QO + 15) / 16 * 16;
  at::Tensor out = at::empty({G, N, O, Hp, Wp}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, G * N, 1, [&](int64_t s0, int64_t s1) {
    std::vector<float> P(T * 4 * Q, 0.f);
    for (int64_t s = s0; s < s1; ++s) {
      const float* xs = xp + s * C * H * W;
      for (int64_t c = 0; c < C; ++c)
        for (int64_t ki = 0; ki < k; ++ki)
          for (int64_t kj = 0; kj < k; ++kj)
            for (int64_t d = 0; d < 4; ++d) {
              float* pt = P.data() + (((c * k + ki) * k + kj) * 4 + d) * Q;
              for (int64_t i = 0; i < Hp; ++i) {
                const float* xr = xs + (c * H + 2 * i + (d >> 1) + ki) * W + kj + (d & 1);
                for (int64_t j = 0; j < Wp; ++j) pt[i * Wp + j] = xr[2 * j];
              }
            }
      const int64_t g = s / N;
      for (int64_t o0 = 0; o0 < O; o0 += 6) {
        const float* wb = wp + (g * O + o0) * T;
        const float* bb = bp + g * O + o0;
        float* od = op + (s * O + o0) * QO;
        switch (std::min<int64_t>(6, O - o0)) {
          case 6: channels<6>(P.data(), Q, T, wb, bb, od, QO); break;
          case 5: channels<5>(P.data(), Q, T, wb, bb, od, QO); break;
          case 4: channels<4>(P.data(), Q, T, wb, bb, od, QO); break;
          case 3: channels<3>(P.data(), Q, T, wb, bb, od, QO); break;
          case 2: channels<2>(P.data(), Q, T, wb, bb, od, QO); break;
          default: channels<1>(P.data(), Q, T, wb, bb, od, QO); break;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(fedprism_kernels, m) { m.def("stem_forward(Tensor x, Tensor w, Tensor b, int k) -> Tensor"); }
TORCH_LIBRARY_IMPL(fedprism_kernels, CPU, m) { m.impl("stem_forward", &stem_forward); }
