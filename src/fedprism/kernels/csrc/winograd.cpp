// Evaluation by minimal filtering (eval.kernels = winograd): a block conv(5 x 5, stride 1, no padding) ->
// ReLU -> max_pool2d(2) as F(2 x 2, 5 x 5) of Lavin & Gray, "Fast Algorithms for Convolutional Neural
// Networks" (CVPR 2016, arXiv:1509.09308). fedprism/engine/fused.py builds and loads this file beside
// fused_stem.cpp, as its own library, so that the direct kernels' object code does not change with it.
//
// A 2 x 2 tile of conv outputs is Y = A^T [(G g G^T) * (B^T d B)] A from its 6 x 6 tile d of inputs, with
// the interpolation points 0, 1, -1, 2, -2 and infinity: 36 products per tile and input channel instead of
// 100. A tile is exactly one pooling window, so each pooled output is relu(max(Y) + bias) of one tile
// (max(a + c, b + c) = max(a, b) + c holds in floating point too). The sums are not the convolution's: the
// outputs differ from the direct kernel's at float32 rounding of the transformed values (a few 1e-6 of
// the largest output; bench/README.md, "Evaluation by minimal filtering").
//
// x [G, N, C, H, W], w [G, O, C * 25], b [G, O] -> [G, N, O, (H - 4) / 2, (W - 4) / 2], as the direct
// kernel's stem_forward. Per image: the input tiles' transforms V[p][c][t] (p: the 36 positions of a
// transformed tile, t = i Wp + j), then per pair of filter blocks (VL filters each) and a few tiles at a
// time, M[p][t] = sum over c of V[p][c][t] U[p][c] (a small GEMM per position, filters in the vector
// lanes), then the output transform and the pooling.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Floats per vector (the lanes hold filters), as in fused_stem.cpp.
#ifdef __AVX512F__
constexpr int VL = 16;
#else
constexpr int VL = 8;
#endif
constexpr int TILES = 10;       // tiles per pass, in fives: their products (36 x 10 x 2 vectors) stay in L1

typedef float vf __attribute__((vector_size(4 * VL)));
typedef float vfu __attribute__((vector_size(4 * VL), aligned(4)));
inline vf load(const float* p) { return *(const vfu*)p; }

// One image's geometry: C channels of H x W, Hp x Wp pooled outputs (= tiles)
struct Image {
  int64_t C, H, W, Hp, Wp;
};

// r = B^T d for one column of six inputs (in place)
inline void input_1d(vf& d0, vf& d1, vf& d2, vf& d3, vf& d4, vf& d5) {
  const vf s12 = d1 + d2, d21 = d2 - d1, s34 = d3 + d4, d34 = d3 - d4, d42 = d4 - d2, d31 = d3 - d1;
  const vf r0 = 4.f * d0 - 5.f * d2 + d4, r5 = 4.f * d1 - 5.f * d3 + d5;
  d0 = r0;
  d1 = 4.f * s12 - s34;
  d2 = 4.f * d21 + d34;
  d3 = d42 + 2.f * d31;
  d4 = d42 - 2.f * d31;
  d5 = r5;
}

// (y0, y1) = A^T m for one column of six products
inline void output_1d(const vf& m0, const vf& m1, const vf& m2, const vf& m3, const vf& m4, const vf& m5,
                      vf& y0, vf& y1) {
  y0 = (m0 + m1) + (m2 + m3) + m4;
  y1 = (m1 - m2) + 2.f * (m3 - m4) + m5;
}

// The transformed filters: U[(blk * 36 + p) * C + c][0 .. VL) = (G g G^T)[p] of filters blk VL .. for
// channel c (in double, then rounded), zero for padding filters. w [O][C * 25] of one group.
void filter_tiles(const float* w, int64_t O, int64_t C, float* U) {
  static const double Gm[6][5] = {{1. / 4, 0, 0, 0, 0},
                                  {1. / 6, 1. / 6, 1. / 6, 1. / 6, 1. / 6},
                                  {1. / 6, -1. / 6, 1. / 6, -1. / 6, 1. / 6},
                                  {1. / 24, 1. / 12, 1. / 6, 1. / 3, 2. / 3},
                                  {1. / 24, -1. / 12, 1. / 6, -1. / 3, 2. / 3},
                                  {0, 0, 0, 0, 1}};
  for (int64_t o = 0; o < O; ++o)
    for (int64_t c = 0; c < C; ++c) {
      const float* g = w + (o * C + c) * 25;
      double t[6][5];                              // G g
      for (int a = 0; a < 6; ++a)
        for (int v = 0; v < 5; ++v) {
          double s = 0;
          for (int u = 0; u < 5; ++u) s += Gm[a][u] * g[u * 5 + v];
          t[a][v] = s;
        }
      for (int a = 0; a < 6; ++a)
        for (int b = 0; b < 6; ++b) {
          double s = 0;
          for (int v = 0; v < 5; ++v) s += t[a][v] * Gm[b][v];
          U[(((o / VL) * 36 + a * 6 + b) * C + c) * VL + o % VL] = (float)s;
        }
    }
}

// d[v][j] = x[2 (j0 + j) + v] of one image row x (W floats), v < 6, j < VL, for the row's nj tiles from
// j0; the other lanes hold values from past the row's end (inputs of tiles that are not written) or 0.
// `end`: the end of the tensor's storage, past which nothing is read. Only AVX2 has a vector path (two
// loads, split into even and odd columns by shuffles); AVX-512 builds read lane by lane, since no machine
// with AVX-512 was at hand to measure one.
inline void row_taps(const float* x, int64_t W, int64_t j0, int64_t nj, const float* end, vf (&d)[6]) {
  const float* r = x + 2 * j0;
#if !defined(__AVX512F__) && defined(__AVX2__)
  if (nj <= 6 && r + 16 <= end) {       // (e0 e2 .. e14) and (e1 .. e15), then shifted by one and two lanes
    const __m256 a = _mm256_loadu_ps(r), b = _mm256_loadu_ps(r + 8);
    const __m256 e = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0))), 0xD8));
    const __m256 o = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))), 0xD8));
    const __m256i s1 = _mm256_setr_epi32(1, 2, 3, 4, 5, 6, 7, 7);
    const __m256i s2 = _mm256_setr_epi32(2, 3, 4, 5, 6, 7, 7, 7);
    d[0] = (vf)e, d[1] = (vf)o;
    d[2] = (vf)_mm256_permutevar8x32_ps(e, s1), d[3] = (vf)_mm256_permutevar8x32_ps(o, s1);
    d[4] = (vf)_mm256_permutevar8x32_ps(e, s2), d[5] = (vf)_mm256_permutevar8x32_ps(o, s2);
    return;
  }
#endif
  for (int v = 0; v < 6; ++v)
    for (int j = 0; j < VL; ++j) {
      const int64_t col = 2 * (j0 + j) + v;
      d[v][j] = col < W ? x[col] : 0.f;
    }
}

// The stages are kept out of line (noinline) so that a profile (perf) names each one; bench/README.md's
// figures are of this layout.
//
// V[p][c][t] = (B^T d B)[p] for channel c's tile t = i Wp + j of one image xs [C, H, W] (channel stride xc).
// First B^T along each input row r, once per row (a row serves up to three rows of tiles), VL tiles at a
// time, into Hr[c][b][r & 1][(r >> 1) Wp + j]: rows of one parity side by side, so that the inputs of the
// column transform, rows 2 i + u, are runs over t (Hr[c][b][u & 1][t + (u >> 1) Wp]); then B^T along the
// columns, VL tiles of all rows at a time. Lanes past a row's (or the image's) last tile land on the next
// row's, written after them, or in the padding (HS floats a plane, TP a channel of V).
__attribute__((noinline)) void input_tiles(const float* xs, int64_t xc, const Image& g, const float* end,
                                           int64_t TP, float* V, float* Hr) {
  const int64_t C = g.C, QO = g.Hp * g.Wp, HS = (g.Hp + 2) * g.Wp + VL, P = C * TP;
  for (int64_t c = 0; c < C; ++c)               // all channels' rows first: the column transform's loads
    for (int64_t r = 0; r < 2 * g.Hp + 4; ++r)  // straddle the rows' stores, which must have left the
      for (int64_t j0 = 0; j0 < g.Wp; j0 += VL) {   // store buffer (a forwarding stall otherwise)
        vf d[6];
        row_taps(xs + c * xc + r * g.W, g.W, j0, g.Wp - j0, end, d);
        input_1d(d[0], d[1], d[2], d[3], d[4], d[5]);
        float* h = Hr + (c * 12 + (r & 1)) * HS + (r >> 1) * g.Wp + j0;
#pragma GCC unroll 6
        for (int b = 0; b < 6; ++b) *(vfu*)(h + b * 2 * HS) = d[b];
      }
  for (int64_t c = 0; c < C; ++c) {
    for (int b = 0; b < 6; ++b)
      for (int64_t t0 = 0; t0 < QO; t0 += VL) {
        const float* h = Hr + (c * 12 + b * 2) * HS + t0;
        vf d[6];
#pragma GCC unroll 6
        for (int u = 0; u < 6; ++u) d[u] = load(h + (u & 1) * HS + (u >> 1) * g.Wp);
        input_1d(d[0], d[1], d[2], d[3], d[4], d[5]);
        float* dst = V + b * P + c * TP + t0;
#pragma GCC unroll 6
        for (int a = 0; a < 6; ++a) *(vfu*)(dst + a * 6 * P) = d[a];
      }
  }
}

// M[p][tt][f] (vectors of VL filters) = sum over the channels c, in order, of V[p][c][t0 + tt] * U_f[p][c]
// for the FB filter blocks U_f = Ub[f], tiles tt < nt rounded up to TB (those past nt read and write the
// buffers' padding): FB x TB independent sums in registers, as a GEMM's micro-kernel.
template <int FB, int TB>
__attribute__((noinline)) void tile_products(const float* V, int64_t TP, const float* const* Ub, int64_t C,
                                             int64_t t0, int nt, float* M) {
  for (int p = 0; p < 36; ++p) {
    const float* v = V + p * C * TP + t0;
    float* m = M + p * TILES * FB * VL;
    for (int tt = 0; tt < nt; tt += TB) {
      vf acc[TB][FB] = {};
      for (int64_t c = 0; c < C; ++c) {
        vf u[FB];
#pragma GCC unroll 2
        for (int f = 0; f < FB; ++f) {
          u[f] = load(Ub[f] + (p * C + c) * VL);
#ifdef __AVX512F__                   // in a register: GCC would fold a load into each multiply-add
          asm("" : "+v"(u[f]));
#elif defined(__AVX2__)
          asm("" : "+x"(u[f]));
#endif
        }
#pragma GCC unroll 8
        for (int i = 0; i < TB; ++i) {
          const float xv = v[c * TP + tt + i];
#pragma GCC unroll 2
          for (int f = 0; f < FB; ++f) acc[i][f] += xv * u[f];
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < TB; ++i)
#pragma GCC unroll 2
        for (int f = 0; f < FB; ++f) *(vfu*)(m + ((tt + i) * FB + f) * VL) = acc[i][f];
    }
  }
}

// The pooled outputs of tiles tt < nt: relu(max over the tile of A^T M A + bias), from the products
// M[p][tt] (vectors of VL filters, FB filter blocks side by side), to out[l QO + tt] for filters l < nO.
template <int FB>
__attribute__((noinline)) void output_tiles(const float* M, int nt, const float* b, int nO, int64_t QO,
                                            float* out) {
  const vf bias = load(b);
  const int64_t P = TILES * FB * VL;           // from one position's products to the next
  for (int tt = 0; tt < nt; ++tt) {
    const float* m = M + tt * FB * VL;
    vf h0[6], h1[6];                                // A^T over each row a of the 6 x 6 products
#pragma GCC unroll 6
    for (int a = 0; a < 6; ++a)
      output_1d(load(m + (a * 6) * P), load(m + (a * 6 + 1) * P), load(m + (a * 6 + 2) * P),
                load(m + (a * 6 + 3) * P), load(m + (a * 6 + 4) * P), load(m + (a * 6 + 5) * P),
                h0[a], h1[a]);
    vf y[4];                                        // corners (0, 0), (0, 1), (1, 0), (1, 1)
    output_1d(h0[0], h0[1], h0[2], h0[3], h0[4], h0[5], y[0], y[2]);
    output_1d(h1[0], h1[1], h1[2], h1[3], h1[4], h1[5], y[1], y[3]);
    vf mx = y[0];
#pragma GCC unroll 3
    for (int d = 1; d < 4; ++d) mx = y[d] > mx ? y[d] : mx;
    mx += bias;
    mx = mx > vf{} ? mx : vf{};
    for (int l = 0; l < nO; ++l) out[l * QO + tt] = mx[l];
  }
}

// x [G, N, C, H, W], w [G, O, C * 25], b [G, O] -> [G, N, O, (H - 4) / 2, (W - 4) / 2], as stem_forward.
at::Tensor winograd_forward(const at::Tensor& x_, const at::Tensor& w_, const at::Tensor& b_, int64_t k) {
  TORCH_CHECK(x_.dim() == 5 && w_.dim() == 3 && b_.dim() == 2,
              "winograd forward: x [G,N,C,H,W], w [G,O,T], b [G,O]");
  TORCH_CHECK(x_.scalar_type() == at::kFloat && w_.scalar_type() == at::kFloat &&
              b_.scalar_type() == at::kFloat, "winograd forward: float32 only");
  TORCH_CHECK(k == 5, "winograd forward: 5 x 5 filters only, got k = ", k);
  const bool rows =
      x_.stride(4) == 1 && x_.stride(3) == x_.size(4) && x_.stride(2) == x_.size(3) * x_.size(4);
  const at::Tensor x = rows ? x_ : x_.contiguous(), w = w_.contiguous(), b = b_.contiguous();
  const int64_t G = x.size(0), N = x.size(1), O = w.size(1);
  const Image g{x.size(2), x.size(3), x.size(4), (x.size(3) - 4) / 2, (x.size(4) - 4) / 2};
  const int64_t C = g.C, QO = g.Hp * g.Wp, TP = QO + VL, NB = (O + VL - 1) / VL, sg = x.stride(0),
                sn = x.stride(1);
  TORCH_CHECK(w.size(0) == G && w.size(2) == C * 25 && b.size(0) == G && b.size(1) == O && g.Hp > 0 &&
              g.Wp > 0, "winograd forward: shapes do not match");
  std::vector<float> U(G * NB * 36 * C * VL, 0.f), bk(G * NB * VL, 0.f);
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t gi = g0; gi < g1; ++gi)
      filter_tiles(w.data_ptr<float>() + gi * O * C * 25, O, C, U.data() + gi * NB * 36 * C * VL);
  });
  for (int64_t gi = 0; gi < G; ++gi)
    for (int64_t o = 0; o < O; ++o) bk[(gi * NB + o / VL) * VL + o % VL] = b.data_ptr<float>()[gi * O + o];
  at::Tensor out = at::empty({G, N, O, g.Hp, g.Wp}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* end = (const float*)((const char*)x.storage().data() + x.storage().nbytes());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, G * N, 1, [&](int64_t s0, int64_t s1) {
    std::vector<float> V(36 * C * TP), M(36 * TILES * 2 * VL),
        Hr(C * 12 * ((g.Hp + 2) * g.Wp + VL));
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t gi = s / N;
      input_tiles(xp + gi * sg + (s % N) * sn, g.H * g.W, g, end, TP, V.data(), Hr.data());
      for (int64_t blk = 0; blk < NB; blk += 2) {          // filter blocks in pairs
        const int FB = (int)std::min<int64_t>(2, NB - blk);
        const float* Ub[2] = {U.data() + (gi * NB + blk) * 36 * C * VL,
                              U.data() + (gi * NB + blk + FB - 1) * 36 * C * VL};
        for (int64_t t0 = 0; t0 < QO; t0 += TILES) {
          const int nt = (int)std::min<int64_t>(TILES, QO - t0);
          if (FB == 2)
            tile_products<2, 5>(V.data(), TP, Ub, C, t0, nt, M.data());
          else
            tile_products<1, 5>(V.data(), TP, Ub, C, t0, nt, M.data());
          for (int f = 0; f < FB; ++f)
            (FB == 2 ? output_tiles<2> : output_tiles<1>)(M.data() + f * VL, nt,
                                                           bk.data() + (gi * NB + blk + f) * VL,
                                                           (int)std::min<int64_t>(VL, O - (blk + f) * VL), QO,
                                                           op + (s * O + (blk + f) * VL) * QO + t0);
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fedprism_kernels, m) {
  m.def("winograd_forward(Tensor x, Tensor w, Tensor b, int k) -> Tensor");
}
TORCH_LIBRARY_IMPL(fedprism_kernels, CPU, m) { m.impl("winograd_forward", &winograd_forward); }
