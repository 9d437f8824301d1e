// A block conv(k x k, stride 1, no padding) -> ReLU -> max_pool2d(2) in one pass on the CPU:
// fedprism/engine/fused.py builds and loads this file. Each output is
//   relu(max over the 2 x 2 window of (b[o] + sum_t w[o][t] x[patch t]))
// with the taps t summed in order (channel, row, column); the k x k conv map is never written.
// x [G, N, C, H, W], w [G, O, C*k*k], b [G, O] -> [G, N, O, (H-k+1)/2, (W-k+1)/2]: group g's images
// through group g's filters (G = 1 with the filters of all models stacked: a shared input batch).
// Two layouts of the same sums: with few input channels (a first layer, on AVX-512) a vector holds VL
// pooled positions of one filter, read from the image's polyphase planes; with more (an inner layer, and
// every layer on AVX2) a vector holds VL filters at one position, times a broadcast input value. VL and
// the register blocking follow the instruction set the file is compiled for (`VL` below): 16 floats and
// 32 registers with AVX-512, 8 floats and 16 registers otherwise (AVX2). The outputs are the same sums in
// the same order for both; the bias gradients and a first block's filter gradients (partial sums per lane,
// added at the end) and an inner block's input gradient for rows wider than 16 (cut into vectors of VL)
// are summed in another order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Floats per vector and the register blocking of each kernel: accumulators plus operands stay within the
// vector registers (AVX-512: 32 of 16 floats; AVX2: 16 of 8 floats). Blocked for AVX-512 on a CPU
// without it, a 16-float vector takes two registers and the accumulators spill to the stack: the kernels
// then ran 2-4x slower than PyTorch's (bench/README.md, "The fused blocks on AVX2").
#ifdef __AVX512F__
constexpr int VL = 16;
constexpr int TILE_FILTERS = 6;      // first layers: filters x 4 corners accumulators per tile
constexpr int WINDOWS = 7;           // inner layers: windows x 4 corners accumulators per pass
constexpr int GRAD_FILTERS = 6, GRAD_TAPS = 4;   // a first block's filter gradients: filters x taps
constexpr int DW_ROWS = 16;          // an inner block's filter gradients: kernel rows per pass (all)
constexpr int COL_VECTORS = 10;      // an inner block's patch gradients: vectors of taps per pass
#else
constexpr int VL = 8;
constexpr int TILE_FILTERS = 3;
constexpr int WINDOWS = 3;
constexpr int GRAD_FILTERS = 3, GRAD_TAPS = 3;
constexpr int DW_ROWS = 2;
constexpr int COL_VECTORS = 10;
#endif

// Above this many input channels a block's forward is filter-vectorized (see `windows`). AVX2 takes that
// layout for every block: LeNet-5's first block (one input channel) then evaluates about 1.5x and runs its
// training forward 1.2-1.3x as fast as by position, with the same sums (bench/README.md, "Four AVX2
// changes").
#ifdef __AVX512F__
constexpr int64_t MAX_POSITION_CHANNELS = 3;
#else
constexpr int64_t MAX_POSITION_CHANNELS = 0;
#endif

typedef float vf __attribute__((vector_size(4 * VL)));
typedef float vfu __attribute__((vector_size(4 * VL), aligned(4)));
inline vf load(const float* p) { return *(const vfu*)p; }

#if !defined(__AVX512F__) && defined(__AVX2__)
// AVX2's masks: all bits set in lanes [lo, lo + n)
inline __m256i lanes(int lo, int n) {
  const __m256i l = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_and_si256(_mm256_cmpgt_epi32(l, _mm256_set1_epi32(lo - 1)),
                          _mm256_cmpgt_epi32(_mm256_set1_epi32(lo + n), l));
}
#endif

// Neighbouring taps read overlapping inputs, and GCC then carries loaded values from tap to tap in
// registers and re-broadcasts them with shuffles, which compete with the multiply-adds for a port. A
// compiler barrier at each tap makes it read them again as memory operands of the multiply-adds.
inline void reload() { asm volatile("" ::: "memory"); }

// The first `n` lanes of v to p[0 .. n).
inline void store_first(float* p, vf v, int n) {
#ifdef __AVX512F__
  _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), (__m512)v);
#elif defined(__AVX2__)
  _mm256_maskstore_ps(p, lanes(0, n), (__m256)v);
#else
  for (int l = 0; l < n; ++l) p[l] = v[l];
#endif
}

// The first `n` (0 <= n <= VL) pooled gradients g[0 .. n) and their winning corners a[0 .. n) as floats;
// lanes from n on hold gradient 0 and corner 255 (no winner).
inline void load_pooled(const float* g, const uint8_t* a, int n, vf& gv, vf& av) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  const __mmask16 m = (__mmask16)((1u << n) - 1);
  gv = (vf)_mm512_maskz_loadu_ps(m, g);
  av = (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_mask_loadu_epi8(_mm_set1_epi8(-1), m, a)));
#elif defined(__AVX2__) && !defined(__AVX512F__)
  gv = (vf)_mm256_maskload_ps(g, lanes(0, n));
  if (n == VL) {
    av = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)a)));
  } else {
    av = vf{} + 255.f;
    for (int l = 0; l < n; ++l) av[l] = (float)a[l];
  }
#else
  gv = vf{};
  av = vf{} + 255.f;
  for (int l = 0; l < n; ++l) gv[l] = g[l], av[l] = (float)a[l];
#endif
}

inline float lane_sum(vf v) {
  float s = 0.f;
  for (int l = 0; l < VL; ++l) s += v[l];
  return s;
}

// relu(max over the four corners), and in idx the first corner holding that maximum (255 where it is
// <= 0: ReLU's gradient is 0 there): max_pool2d's choice after ReLU, in exact arithmetic.
inline vf pool4(const vf (&a)[4], vf* idx) {
  vf m = a[0], i = vf{};
#pragma GCC unroll 3
  for (int d = 1; d < 4; ++d) {
    const auto gt = a[d] > m;
    m = gt ? a[d] : m;
    i = gt ? vf{} + (float)d : i;
  }
  const auto on = m > vf{};
  if (idx != nullptr) *idx = on ? i : vf{} + 255.f;
  return on ? m : vf{};
}

// One image's geometry. The pooled position (i, j) sits at q = i * S + j of a grid S >= Wp + k/2 wide
// (a multiple of 16, so a vector is a stretch of one pooled row; lanes j >= Wp are computed and dropped).
struct Geo {
  int64_t C, H, W, k, Hp, Wp, S, R, PH;
  Geo(int64_t C_, int64_t H_, int64_t W_, int64_t k_)
      : C(C_), H(H_), W(W_), k(k_), Hp((H_ - k_ + 1) / 2), Wp((W_ - k_ + 1) / 2) {
    S = (Wp + k / 2 + 15) / 16 * 16;
    R = Hp + k / 2 + 1;                  // the rows read, and one more for the dropped lanes' reads
    PH = R * S;
  }
  int64_t grid() const { return Hp * S; }
  int64_t phase_floats() const { return C * 4 * PH + 16; }
  // The conv input under tap (c, ki, kj) at window corner d = 2 dy + dx of every grid position:
  // x[c][2i + ki + dy][2j + kj + dx] = phase (c, u & 1, v & 1)[i + u / 2][j + v / 2],
  // u = ki + dy, v = kj + dx.
  int64_t tap(int64_t c, int64_t ki, int64_t kj, int d) const {
    const int64_t u = ki + (d >> 1), v = kj + (d & 1);
    return ((c * 2 + (u & 1)) * 2 + (v & 1)) * PH + (u >> 1) * S + (v >> 1);
  }
};

// The four polyphase planes of each channel of one image [C, H, W] (channel stride xc, contiguous rows):
// ph[c][a][b][i][j] = x[c][2i + a][2j + b], 0 outside. With them every tap of every corner is a plain
// (unaligned) vector load at Geo::tap: no im2col.
void phases(const float* xs, int64_t xc, const Geo& g, float* ph, std::vector<float>& row) {
#ifdef __AVX512F__
  if (g.S == 16 && g.W <= 32) {         // a row in two vectors, split into its even and odd columns
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __mmask16 lo = (__mmask16)((1u << std::min<int64_t>(g.W, 16)) - 1);
    const __mmask16 hi = (__mmask16)((1u << std::max<int64_t>(g.W - 16, 0)) - 1);
    for (int64_t c = 0; c < g.C; ++c)
      for (int a = 0; a < 2; ++a)
        for (int64_t i = 0; i < g.R; ++i) {
          const int64_t y = 2 * i + a;
          __m512 l = _mm512_setzero_ps(), h = _mm512_setzero_ps();
          if (y < g.H) {
            l = _mm512_maskz_loadu_ps(lo, xs + c * xc + y * g.W);
            h = _mm512_maskz_loadu_ps(hi, xs + c * xc + y * g.W + 16);
          }
          float* out = ph + (c * 2 + a) * 2 * g.PH + i * 16;
          _mm512_storeu_ps(out, _mm512_permutex2var_ps(l, even, h));
          _mm512_storeu_ps(out + g.PH, _mm512_permutex2var_ps(l, odd, h));
        }
    return;
  }
#elif defined(__AVX2__)
  if (g.S == 16 && g.W <= 32) {         // a row in four vectors, split into its even and odd columns
    for (int64_t c = 0; c < g.C; ++c)
      for (int a = 0; a < 2; ++a)
        for (int64_t i = 0; i < g.R; ++i) {
          const int64_t y = 2 * i + a;
          __m256 v[4];
          for (int u = 0; u < 4; ++u) {
            const int n = (int)std::clamp<int64_t>(g.W - 8 * u, 0, 8);
            v[u] = y < g.H ? _mm256_maskload_ps(xs + c * xc + y * g.W + 8 * u, lanes(0, n))
                           : _mm256_setzero_ps();
          }
          float* out = ph + (c * 2 + a) * 2 * g.PH + i * 16;
          for (int h = 0; h < 2; ++h) {      // columns 16 h ..: (e0 e2 f0 f2 e4 e6 f4 f6) -> in order
            const __m256 e = _mm256_shuffle_ps(v[2 * h], v[2 * h + 1], _MM_SHUFFLE(2, 0, 2, 0));
            const __m256 o = _mm256_shuffle_ps(v[2 * h], v[2 * h + 1], _MM_SHUFFLE(3, 1, 3, 1));
            _mm256_storeu_ps(out + 8 * h, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), 0xD8)));
            _mm256_storeu_ps(out + g.PH + 8 * h,
                             _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), 0xD8)));
          }
        }
    return;
  }
#endif
  const int64_t half = g.S + 2;
  row.assign(2 * half, 0.f);
  for (int64_t c = 0; c < g.C; ++c)
    for (int a = 0; a < 2; ++a)
      for (int64_t i = 0; i < g.R; ++i) {
        const int64_t y = 2 * i + a;
        std::fill(row.begin(), row.end(), 0.f);
        if (y < g.H)
          for (int64_t x = 0; x < std::min(g.W, 2 * half); ++x)
            row[(x & 1) * half + (x >> 1)] = xs[c * xc + y * g.W + x];
        for (int b = 0; b < 2; ++b)
          std::copy_n(row.data() + b * half, g.S, ph + ((c * 2 + a) * 2 + b) * g.PH + i * g.S);
      }
}

// Position-vectorized (first layers: few input channels): OB <= TILE_FILTERS filters, the VL grid positions
// from p0, all four corners in 4 OB accumulators; w holds the block's filters interleaved, [T][OB].
template <int OB, int K>
inline void tile(const float* ph, const Geo& g, const float* w, const float* b, int64_t p0, float* out,
                 uint8_t* arg) {
  const int64_t k = K > 0 ? K : g.k;
  vf acc[OB][4];
#pragma GCC unroll 8
  for (int q = 0; q < OB; ++q)
#pragma GCC unroll 4
    for (int d = 0; d < 4; ++d) acc[q][d] = vf{} + b[q];
  const int64_t C = g.C, S = g.S, PH = g.PH;               // locals: the barrier below reloads memory
  for (int64_t c = 0; c < C; ++c)
    for (int64_t ki = 0; ki < k; ++ki) {
      const float* wt = w + (c * k + ki) * k * OB;
      const float* r[2][2];                                   // [dy][v & 1]: Geo::tap without the v / 2
      for (int dy = 0; dy < 2; ++dy)
        for (int pv = 0; pv < 2; ++pv) {
          const int64_t u = ki + dy;
          r[dy][pv] = ph + ((c * 2 + (u & 1)) * 2 + pv) * PH + (u >> 1) * S + p0;
        }
#pragma GCC unroll 8
      for (int64_t kj = 0; kj < k; ++kj) {
        reload();
        vf x[4];
#pragma GCC unroll 4
        for (int d = 0; d < 4; ++d) {
          const int64_t v = kj + (d & 1);
          x[d] = load(r[d >> 1][v & 1] + (v >> 1));
        }
#pragma GCC unroll 8
        for (int q = 0; q < OB; ++q) {
          const float wv = wt[kj * OB + q];
#pragma GCC unroll 4
          for (int d = 0; d < 4; ++d) acc[q][d] += wv * x[d];
        }
      }
    }
  const int64_t QO = g.Hp * g.Wp, i = p0 / g.S, j0 = p0 % g.S, at = i * g.Wp + j0;
  const int n = (int)std::min<int64_t>(VL, g.Wp - j0);
#pragma GCC unroll 8
  for (int q = 0; q < OB; ++q) {
    vf idx;
    store_first(out + q * QO + at, pool4(acc[q], arg == nullptr ? nullptr : &idx), n);
    if (arg != nullptr)
      for (int l = 0; l < n; ++l) arg[q * QO + at + l] = (uint8_t)idx[l];
  }
}

template <int OB>
void positions(const float* ph, const Geo& g, const float* w, const float* b, float* out, uint8_t* arg) {
  for (int64_t i = 0; i < g.Hp; ++i)
    for (int64_t j0 = 0; j0 < g.Wp; j0 += VL) {
      if (g.k == 5) tile<OB, 5>(ph, g, w, b, i * g.S + j0, out, arg);
      else if (g.k == 3) tile<OB, 3>(ph, g, w, b, i * g.S + j0, out, arg);
      else tile<OB, 0>(ph, g, w, b, i * g.S + j0, out, arg);
    }
}

// Filter-vectorized (inner layers, e.g. LeNet-5's second: 6 -> 16 channels): NW windows of one pooled
// row, their four corners, VL filters (one vector) per accumulator; per tap one load of the VL filters'
// weights (w: [T][VL]) and 4 NW products with a broadcast input value. With `arg`, also the winning
// corners (as `tile`).
template <int NW>
inline void windows(const float* x, const Geo& g, const float* w, const float* b, float* out, uint8_t* arg,
                    int64_t q0, int nO) {
  vf acc[NW][4];
  const vf bias = load(b);
#pragma GCC unroll 7
  for (int j = 0; j < NW; ++j)
#pragma GCC unroll 4
    for (int d = 0; d < 4; ++d) acc[j][d] = bias;
  const int64_t C = g.C, H = g.H, W = g.W, k = g.k;       // locals: the barrier below reloads memory
  for (int64_t c = 0; c < C; ++c)
    for (int64_t ki = 0; ki < k; ++ki) {
      const float* r0 = x + (c * H + ki) * W;
      const float* r1 = r0 + W;
      int64_t kj = 0;
#ifndef __AVX512F__
      // 8-float builds (AVX2): taps kj and kj + 1 together, so a window's two corners of a row read three
      // inputs, not four (each accumulator still adds tap kj's term, then kj + 1's)
      for (; kj + 1 < k; kj += 2, w += 2 * VL) {
        reload();
        const vf w0 = load(w), w1 = load(w + VL);
#pragma GCC unroll 7
        for (int j = 0; j < NW; ++j)
#pragma GCC unroll 2
          for (int dy = 0; dy < 2; ++dy) {
            const float* r = (dy ? r1 : r0) + kj + 2 * j;
            const float xa = r[0], xb = r[1], xc = r[2];
            acc[j][2 * dy] += xa * w0;
            acc[j][2 * dy + 1] += xb * w0;
            acc[j][2 * dy] += xb * w1;
            acc[j][2 * dy + 1] += xc * w1;
          }
      }
#endif
      for (; kj < k; ++kj, w += VL) {
        reload();
        const vf wv = load(w);
#pragma GCC unroll 7
        for (int j = 0; j < NW; ++j) {
          acc[j][0] += r0[kj + 2 * j] * wv;
          acc[j][1] += r0[kj + 2 * j + 1] * wv;
          acc[j][2] += r1[kj + 2 * j] * wv;
          acc[j][3] += r1[kj + 2 * j + 1] * wv;
        }
      }
    }
  const int64_t QO = g.Hp * g.Wp;
#pragma GCC unroll 7
  for (int j = 0; j < NW; ++j) {
    vf idx;
    const vf m = pool4(acc[j], arg == nullptr ? nullptr : &idx);
    for (int l = 0; l < nO; ++l) out[l * QO + q0 + j] = m[l];
    if (arg != nullptr)
      for (int l = 0; l < nO; ++l) arg[l * QO + q0 + j] = (uint8_t)idx[l];
  }
}

// The block's output, and with keep_arg each output's winning corner (uint8; else an empty tensor).
// x may be a strided view over its first two dimensions (each image [C, H, W] contiguous).
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x_, const at::Tensor& w_, const at::Tensor& b_,
                                           int64_t k, bool keep_arg) {
  TORCH_CHECK(x_.dim() == 5 && w_.dim() == 3 && b_.dim() == 2,
              "fused stem: x [G,N,C,H,W], w [G,O,T], b [G,O]");
  TORCH_CHECK(x_.scalar_type() == at::kFloat && w_.scalar_type() == at::kFloat &&
              b_.scalar_type() == at::kFloat, "fused stem: float32 only");
  const bool rows =
      x_.stride(4) == 1 && x_.stride(3) == x_.size(4) && x_.stride(2) == x_.size(3) * x_.size(4);
  const at::Tensor x = rows ? x_ : x_.contiguous(), w = w_.contiguous(), b = b_.contiguous();
  const int64_t G = x.size(0), N = x.size(1), O = w.size(1);
  const Geo g(x.size(2), x.size(3), x.size(4), k);
  const int64_t T = g.C * k * k, QO = g.Hp * g.Wp, sg = x.stride(0), sn = x.stride(1);
  TORCH_CHECK(w.size(0) == G && w.size(2) == T && b.size(0) == G && b.size(1) == O && g.Hp > 0 && g.Wp > 0,
              "fused stem: shapes do not match");
  // Filters regrouped: position-vectorized blocks of TILE_FILTERS interleaved [T][TILE_FILTERS];
  // filter-vectorized blocks of VL as [T][VL] (zero padded), biases [VL].
  const bool by_filter = g.C > MAX_POSITION_CHANNELS;
  const int64_t OB = by_filter ? VL : TILE_FILTERS, NB = (O + OB - 1) / OB;
  std::vector<float> wk(G * NB * T * OB, 0.f), bk(G * NB * OB, 0.f);
  const float* wp = w.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  for (int64_t gi = 0; gi < G; ++gi)
    for (int64_t o = 0; o < O; ++o) {
      const int64_t blk = gi * NB + o / OB, ob = by_filter ? OB : std::min(OB, O - o / OB * OB);
      bk[blk * OB + o % OB] = bp[gi * O + o];
      for (int64_t t = 0; t < T; ++t) wk[blk * T * OB + t * ob + o % OB] = wp[(gi * O + o) * T + t];
    }
  at::Tensor out = at::empty({G, N, O, g.Hp, g.Wp}, x.options());
  at::Tensor arg = at::empty({keep_arg ? G : 0, N, O, g.Hp, g.Wp}, x.options().dtype(at::kByte));
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  uint8_t* ap = keep_arg ? arg.data_ptr<uint8_t>() : nullptr;
  at::parallel_for(0, G * N, 1, [&](int64_t s0, int64_t s1) {
    std::vector<float> ph(by_filter ? 0 : g.phase_floats(), 0.f), row;
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t gi = s / N;
      const float* xs = xp + gi * sg + (s % N) * sn;
      if (by_filter) {
        for (int64_t blk = 0; blk < NB; ++blk) {
          const int nO = (int)std::min<int64_t>(VL, O - blk * VL);
          const float* wb = wk.data() + (gi * NB + blk) * T * VL;
          const float* bb = bk.data() + (gi * NB + blk) * VL;
          float* od = op + (s * O + blk * VL) * QO;
          uint8_t* ad = ap == nullptr ? nullptr : ap + (s * O + blk * VL) * QO;
          for (int64_t i = 0; i < g.Hp; ++i)
            for (int64_t j0 = 0; j0 < g.Wp; j0 += WINDOWS) {
              const float* xr = xs + 2 * i * g.W + 2 * j0;
              const int64_t q0 = i * g.Wp + j0;
              switch (std::min<int64_t>(WINDOWS, g.Wp - j0)) {
                case 7: windows<7>(xr, g, wb, bb, od, ad, q0, nO); break;
                case 6: windows<6>(xr, g, wb, bb, od, ad, q0, nO); break;
                case 5: windows<5>(xr, g, wb, bb, od, ad, q0, nO); break;
                case 4: windows<4>(xr, g, wb, bb, od, ad, q0, nO); break;
                case 3: windows<3>(xr, g, wb, bb, od, ad, q0, nO); break;
                case 2: windows<2>(xr, g, wb, bb, od, ad, q0, nO); break;
                default: windows<1>(xr, g, wb, bb, od, ad, q0, nO); break;
              }
            }
        }
        continue;
      }
      phases(xs, g.H * g.W, g, ph.data(), row);
      for (int64_t blk = 0; blk < NB; ++blk) {
        const int64_t o0 = blk * TILE_FILTERS;
        const float* wb = wk.data() + (gi * NB + blk) * T * TILE_FILTERS;
        const float* bb = bk.data() + (gi * NB + blk) * TILE_FILTERS;
        float* od = op + (s * O + o0) * QO;
        uint8_t* ad = ap == nullptr ? nullptr : ap + (s * O + o0) * QO;
        switch (std::min<int64_t>(TILE_FILTERS, O - o0)) {
          case 6: positions<6>(ph.data(), g, wb, bb, od, ad); break;
          case 5: positions<5>(ph.data(), g, wb, bb, od, ad); break;
          case 4: positions<4>(ph.data(), g, wb, bb, od, ad); break;
          case 3: positions<3>(ph.data(), g, wb, bb, od, ad); break;
          case 2: positions<2>(ph.data(), g, wb, bb, od, ad); break;
          default: positions<1>(ph.data(), g, wb, bb, od, ad); break;
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

// acc[o][t] (vector partial sums) += sum over corners d and grid positions of Gd[o][d][.] * x(tap t, d)[.]
template <int OB, int TB>
inline void grad_block(const float* Gd, const float* ph, const int64_t* off, int64_t Q, int64_t o0,
                       int64_t t0, vf* acc, int64_t T) {
  vf a[OB][TB];
#pragma GCC unroll 8
  for (int q = 0; q < OB; ++q)
#pragma GCC unroll 4
    for (int r = 0; r < TB; ++r) a[q][r] = acc[(o0 + q) * T + t0 + r];
  for (int64_t d = 0; d < 4; ++d)
    for (int64_t p0 = 0; p0 < Q; p0 += VL) {
      vf g[OB], p[TB];
#pragma GCC unroll 8
      for (int q = 0; q < OB; ++q) g[q] = load(Gd + ((o0 + q) * 4 + d) * Q + p0);
#pragma GCC unroll 4
      for (int r = 0; r < TB; ++r) p[r] = load(ph + off[(t0 + r) * 4 + d] + p0);
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
inline void grad_rows(const float* Gd, const float* ph, const int64_t* off, int64_t Q, int64_t o0, vf* acc,
                      int64_t T) {
  int64_t t0 = 0;
  for (; t0 + GRAD_TAPS <= T; t0 += GRAD_TAPS) grad_block<OB, GRAD_TAPS>(Gd, ph, off, Q, o0, t0, acc, T);
  for (; t0 < T; ++t0) grad_block<OB, 1>(Gd, ph, off, Q, o0, t0, acc, T);
}

// grad [G, N, O, Hp, Wp], arg (from stem_train_forward), x [G or 1, N, C, H, W] -> (dw [G, O, T], db [G, O])
std::tuple<at::Tensor, at::Tensor> stem_backward(const at::Tensor& grad_, const at::Tensor& arg_,
                                                 const at::Tensor& x_, int64_t k) {
  const at::Tensor grad = grad_.contiguous(), arg = arg_.contiguous(), x = x_.contiguous();
  TORCH_CHECK(grad.dim() == 5 && arg.sizes() == grad.sizes() && x.dim() == 5 &&
              arg.scalar_type() == at::kByte,
              "stem_backward: grad/arg [G,N,O,Hp,Wp], x [G or 1,N,C,H,W]");
  const int64_t G = grad.size(0), N = grad.size(1), O = grad.size(2);
  const Geo g(x.size(2), x.size(3), x.size(4), k);
  const int64_t T = g.C * k * k, QO = g.Hp * g.Wp, Q = g.grid(), xg = x.size(0) == 1 ? 0 : 1;
  TORCH_CHECK((x.size(0) == G || x.size(0) == 1) && x.size(1) == N && g.Hp == grad.size(3) &&
              g.Wp == grad.size(4), "stem_backward: shapes do not match");
  std::vector<int64_t> off(T * 4);                    // tap t = (c, ki, kj), corner d -> Geo::tap
  for (int64_t c = 0, t = 0; c < g.C; ++c)
    for (int64_t ki = 0; ki < k; ++ki)
      for (int64_t kj = 0; kj < k; ++kj, ++t)
        for (int d = 0; d < 4; ++d) off[t * 4 + d] = g.tap(c, ki, kj, d);
  at::Tensor dw = at::empty({G, O, T}, grad.options());
  at::Tensor db = at::empty({G, O}, grad.options());
  const float* gp = grad.data_ptr<float>();
  const uint8_t* ap = arg.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* dwp = dw.data_ptr<float>();
  float* dbp = db.data_ptr<float>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> ph(g.phase_floats(), 0.f), row, Gd(O * 4 * Q);
    std::vector<vf> acc(O * T);
    for (int64_t gi = g0; gi < g1; ++gi) {
      std::fill(acc.begin(), acc.end(), vf{});
      std::vector<float> bsum(O, 0.f);
      for (int64_t n = 0; n < N; ++n) {
        phases(xp + (gi * xg * N + n) * g.C * g.H * g.W, g.H * g.W, g, ph.data(), row);
        const float* gn = gp + (gi * N + n) * O * QO;
        const uint8_t* an = ap + (gi * N + n) * O * QO;
        // Gd[o][d]: each pooled gradient at its winning corner d, 0 elsewhere (every lane written, VL
        // at a time), and the biases' gradients: the sum of the winners' pooled gradients
        for (int64_t o = 0; o < O; ++o) {
          vf bs = vf{};
          for (int64_t i = 0; i < g.Hp; ++i)
            for (int64_t j0 = 0; j0 < g.S; j0 += VL) {
              vf gv, av;
              const int64_t at = o * QO + i * g.Wp + j0;
              load_pooled(gn + at, an + at, (int)std::clamp<int64_t>(g.Wp - j0, 0, VL), gv, av);
              bs += av < 4.f ? gv : vf{};
#pragma GCC unroll 4
              for (int d = 0; d < 4; ++d)
                *(vfu*)(Gd.data() + (o * 4 + d) * Q + i * g.S + j0) = av == (float)d ? gv : vf{};
            }
          bsum[o] += lane_sum(bs);
        }
        for (int64_t o0 = 0; o0 < O; o0 += GRAD_FILTERS) {
          switch (std::min<int64_t>(GRAD_FILTERS, O - o0)) {
            case 6: grad_rows<6>(Gd.data(), ph.data(), off.data(), Q, o0, acc.data(), T); break;
            case 5: grad_rows<5>(Gd.data(), ph.data(), off.data(), Q, o0, acc.data(), T); break;
            case 4: grad_rows<4>(Gd.data(), ph.data(), off.data(), Q, o0, acc.data(), T); break;
            case 3: grad_rows<3>(Gd.data(), ph.data(), off.data(), Q, o0, acc.data(), T); break;
            case 2: grad_rows<2>(Gd.data(), ph.data(), off.data(), Q, o0, acc.data(), T); break;
            default: grad_rows<1>(Gd.data(), ph.data(), off.data(), Q, o0, acc.data(), T); break;
          }
        }
      }
      for (int64_t o = 0; o < O; ++o) {
        dbp[gi * O + o] = bsum[o];
        for (int64_t t = 0; t < T; ++t) {
          dwp[(gi * O + o) * T + t] = lane_sum(acc[o * T + t]);
        }
      }
    }
  });
  return {dw, db};
}

// ---- an inner block's backward (filter-vectorized, as its forward): the filters' and biases' gradients
// and the gradient of the block's input, which the previous block's backward takes. Every pass keeps its
// sums in registers: read-modify-writes of overlapping rows through memory stall on store forwarding. ----

// dW[taps of channel c, kernel rows k0 .. k0 + R) (vectors of VL filters) += sum over windows q and
// corners d of Gq[q][d] (the filters' pooled gradients where corner d won, else 0)
// * x[c][2i + dy + ki][2j + dx + kj];
// rowof / colof: window q's first conv row 2i and column 2j (no division per window). K = 0: any k, all
// rows (R unused), through memory.
template <int K, int R>
inline void grad_taps(const float* xc, const Geo& g, const float* Gq, const int64_t* rowof,
                      const int64_t* colof, vf* dw, int64_t k0) {
  const int64_t k = K > 0 ? K : g.k, rows = K > 0 ? R : g.k, W = g.W, QO = g.Hp * g.Wp;
  constexpr int RK = K > 0 ? R * K : 1;
  vf a[RK];
  vf* acc = K > 0 ? a : dw;
  if (K > 0)
    for (int t = 0; t < RK; ++t) a[t] = dw[k0 * k + t];
#ifndef __AVX512F__
  if constexpr (K > 0) {
    // 8-float builds (AVX2): corners d = 2 dy and 2 dy + 1 in one pass over a row's K + 1 inputs, each
    // broadcast once for both (a tap still adds corner 2 dy's term, then 2 dy + 1's: the same sums in the
    // same order)
    for (int64_t q = 0; q < QO; ++q)
      for (int dy = 0; dy < 2; ++dy) {
        const vf g0 = load(Gq + (q * 4 + 2 * dy) * VL), g1 = load(Gq + (q * 4 + 2 * dy + 1) * VL);
        const float* base = xc + (rowof[q] + k0 + dy) * W + colof[q];
#pragma GCC unroll 8
        for (int ki = 0; ki < R; ++ki) {
          const float* row = base + ki * W;
#pragma GCC unroll 8
          for (int c = 0; c <= K; ++c) {
            const float x = row[c];
            if (c < K) a[ki * K + c] += x * g0;
            if (c > 0) a[ki * K + c - 1] += x * g1;
          }
        }
      }
    for (int t = 0; t < RK; ++t) dw[k0 * k + t] = a[t];
    return;
  }
#endif
  for (int64_t q = 0; q < QO; ++q)
    for (int d = 0; d < 4; ++d) {
      const vf gv = load(Gq + (q * 4 + d) * VL);
      const float* base = xc + (rowof[q] + k0) * W + colof[q] + (d >> 1) * W + (d & 1);
#pragma GCC unroll 8
      for (int64_t ki = 0; ki < rows; ++ki) {
        // a pointer per row, the taps displacements from it (an index per tap cost a load and an add
        // per multiply-add: GCC kept the 25 indices on the stack)
        const float* row = base + ki * W;
#pragma GCC unroll 8
        for (int64_t kj = 0; kj < k; ++kj) acc[ki * k + kj] += row[kj] * gv;
      }
    }
  if (K > 0)
    for (int t = 0; t < RK; ++t) dw[k0 * k + t] = a[t];
}

// All K x K taps of channel c, DW_ROWS kernel rows per pass (each tap's sum keeps its order).
template <int K>
inline void grad_channel(const float* xc, const Geo& g, const float* Gq, const int64_t* rowof,
                         const int64_t* colof, vf* dw) {
  if constexpr (K == 0) {
    grad_taps<0, 1>(xc, g, Gq, rowof, colof, dw, 0);
  } else {
    constexpr int R = std::min(DW_ROWS, K);
    int64_t k0 = 0;
    for (; k0 + R <= K; k0 += R) grad_taps<K, R>(xc, g, Gq, rowof, colof, dw, k0);
    if constexpr (K % R != 0) grad_taps<K, K % R>(xc, g, Gq, rowof, colof, dw, k0);
  }
}

// acc[lanes px .. px + n) += src[0 .. n) (n + px <= VL; lanes outside are untouched)
inline vf add_at(vf acc, const float* src, int64_t px, int n) {
#ifdef __AVX512F__
  // a masked load from src - px: lanes below px are masked off, so nothing is read there
  return acc + (vf)_mm512_maskz_loadu_ps((__mmask16)(((1u << n) - 1) << px), src - px);
#elif defined(__AVX2__)
  return acc + (vf)_mm256_maskload_ps(src - px, lanes((int)px, n));   // as above: no read outside the lanes
#else
  for (int l = 0; l < n; ++l) acc[px + l] += src[l];
  return acc;
#endif
}

// col[0 .. TV VL) = sum over the filters o in lst[0 .. n) of v[o] * w[o][0 .. TV VL), in registers
// (w: rows of stride Tp); TV = 0: the whole row of any Tp, through memory. LeNet-5's second block has
// 150 taps, padded to 160: one pass of 10 vectors with AVX-512, two with AVX2.
template <int TV>
inline void weighted_rows(const int* lst, int n, const float* v, const float* wpad, int64_t Tp, float* col) {
  if (TV == 0) {
    std::fill(col, col + Tp, 0.f);
    for (int i = 0; i < n; ++i)
      for (int64_t t = 0; t < Tp; ++t) col[t] += v[lst[i]] * wpad[lst[i] * Tp + t];
    return;
  }
  constexpr int NV = TV > 0 ? TV : 1;
  vf a[NV];
#pragma GCC unroll 16
  for (int u = 0; u < NV; ++u) a[u] = vf{};
  for (int i = 0; i < n; ++i) {
    const float cv = v[lst[i]];
    const float* wr = wpad + lst[i] * Tp;
#pragma GCC unroll 16
    for (int u = 0; u < NV; ++u) a[u] += cv * load(wr + VL * u);
  }
#pragma GCC unroll 16
  for (int u = 0; u < NV; ++u) *(vfu*)(col + VL * u) = a[u];
}

// grad, arg [G, N, O, Hp, Wp], x [G, N, C, H, W] (the block's input), w [G, O, T]
//   -> (dw [G, O, T], db [G, O], dx [G, N, C, H, W])
std::tuple<at::Tensor, at::Tensor, at::Tensor> block_backward(const at::Tensor& grad_, const at::Tensor& arg_,
                                                              const at::Tensor& x_, const at::Tensor& w_,
                                                              int64_t k_) {
  const int64_t k = k_;
  const at::Tensor grad = grad_.contiguous(), arg = arg_.contiguous();
  const at::Tensor x = x_.contiguous(), w = w_.contiguous();
  TORCH_CHECK(grad.dim() == 5 && arg.sizes() == grad.sizes() && x.dim() == 5 && w.dim() == 3 &&
              arg.scalar_type() == at::kByte,
              "block_backward: grad/arg [G,N,O,Hp,Wp], x [G,N,C,H,W], w [G,O,T]");
  const int64_t G = grad.size(0), N = grad.size(1), O = grad.size(2);
  const Geo g(x.size(2), x.size(3), x.size(4), k);
  const int64_t T = g.C * k * k, QO = g.Hp * g.Wp, Tp_ = (T + 15) / 16 * 16;
  TORCH_CHECK(x.size(0) == G && x.size(1) == N && w.size(0) == G && w.size(1) == O && w.size(2) == T &&
              g.Hp == grad.size(3) && g.Wp == grad.size(4) && k <= 16, "block_backward: shapes do not match");
  at::Tensor dw = at::empty({G, O, T}, grad.options());
  at::Tensor db = at::empty({G, O}, grad.options());
  at::Tensor dx = at::empty(x.sizes(), x.options());
  const float* gp = grad.data_ptr<float>();
  const uint8_t* ap = arg.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* dwp = dw.data_ptr<float>();
  float* dbp = db.data_ptr<float>();
  float* dxp = dx.data_ptr<float>();
  const int64_t NB = (O + VL - 1) / VL, CH_ = 2 * g.Hp, CW_ = 2 * g.Wp;    // the conv positions that pool
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> Gq(NB * QO * 4 * VL), wpad(NB * VL * Tp_), col(CH_ * CW_ * Tp_), gv(NB * VL);
    std::vector<int> won(QO * 4 * O), nwon(QO * 4);
    std::vector<vf> acc(NB * T);
    const int64_t C = g.C, H = g.H, W = g.W, k = k_, Tp = Tp_, CH = CH_, CW = CW_;   // locals, not captures
    std::vector<int64_t> rowof(QO), colof(QO);
    for (int64_t q = 0; q < QO; ++q) rowof[q] = 2 * (q / g.Wp), colof[q] = 2 * (q % g.Wp);
    for (int64_t gi = g0; gi < g1; ++gi) {
      std::fill(acc.begin(), acc.end(), vf{});
      std::fill(wpad.begin(), wpad.end(), 0.f);                 // [filter (padded to NB * VL)][Tp]
      for (int64_t o = 0; o < O; ++o) std::copy_n(wp + (gi * O + o) * T, T, wpad.data() + o * Tp);
      std::vector<float> bsum(O, 0.f);
      for (int64_t n = 0; n < N; ++n) {
        const float* xs = xp + (gi * N + n) * g.C * g.H * g.W;
        float* dxs = dxp + (gi * N + n) * g.C * g.H * g.W;
        const float* gn = gp + (gi * N + n) * O * QO;
        const uint8_t* an = ap + (gi * N + n) * O * QO;
        // Gq[blk][q][d][l]: filter blk * VL + l's pooled gradient at window q if corner d won it, else 0;
        // won / nwon: the filters each corner won
        std::fill(Gq.begin(), Gq.end(), 0.f);
        std::fill(nwon.begin(), nwon.end(), 0);
        for (int64_t o = 0; o < O; ++o) {
          vf bs = vf{};                                       // the biases' gradients, VL windows at a time
          for (int64_t q0 = 0; q0 < QO; q0 += VL) {
            vf gv, av;
            load_pooled(gn + o * QO + q0, an + o * QO + q0, (int)std::min<int64_t>(VL, QO - q0), gv, av);
            bs += av < 4.f ? gv : vf{};
          }
          bsum[o] += lane_sum(bs);
          for (int64_t q = 0; q < QO; ++q) {
            const uint8_t a = an[o * QO + q];
            if (a > 3) continue;
            Gq[(((o / VL) * QO + q) * 4 + a) * VL + o % VL] = gn[o * QO + q];
            won[(q * 4 + a) * O + nwon[q * 4 + a]++] = (int)o;
          }
        }
        for (int64_t blk = 0; blk < NB; ++blk)                  // 1. dW
          for (int64_t c = 0; c < g.C; ++c) {
            const float* Gb = Gq.data() + blk * QO * 4 * VL;
            vf* dwc = acc.data() + blk * T + c * k * k;
            if (k == 5) grad_channel<5>(xs + c * H * W, g, Gb, rowof.data(), colof.data(), dwc);
            else if (k == 3) grad_channel<3>(xs + c * H * W, g, Gb, rowof.data(), colof.data(), dwc);
            else grad_channel<0>(xs + c * H * W, g, Gb, rowof.data(), colof.data(), dwc);
          }
        for (int64_t q = 0; q < QO; ++q) {                       // 2. each conv position's patch gradient
          for (int64_t o = 0; o < O; ++o) gv[o] = gn[o * QO + q];
          for (int d = 0; d < 4; ++d) {
            const int64_t py = rowof[q] + (d >> 1), px = colof[q] + (d & 1);
            const int* lst = won.data() + (q * 4 + d) * O;
            float* cl = col.data() + (py * CW + px) * Tp;
            if (Tp % (COL_VECTORS * VL) == 0)
              for (int64_t c0 = 0; c0 < Tp; c0 += COL_VECTORS * VL)
                weighted_rows<COL_VECTORS>(lst, nwon[q * 4 + d], gv.data(), wpad.data() + c0, Tp, cl + c0);
            else weighted_rows<0>(lst, nwon[q * 4 + d], gv.data(), wpad.data(), Tp, cl);
          }
        }
        // 3. dx[c][y][x] = sum over ki and conv positions (y - ki, px) of their patch gradient's row (c, ki)
        // at lanes px .. px + k: a vector per input row (VL columns at a time), no read-modify-writes
        for (int64_t c = 0; c < C; ++c)
          for (int64_t y = 0; y < H; ++y) {
#ifndef __AVX512F__
            if (VL < W && W <= 16) {       // 8-float builds, two vectors per row (LeNet-5's 14 columns):
              vf lo = vf{}, hi = vf{}, lo_odd = vf{}, hi_odd = vf{};   // each lane summed as AVX-512 sums it
              for (int64_t ki = 0; ki < k; ++ki) {
                const int64_t py = y - ki;
                if (py < 0 || py >= CH) continue;
                const float* src = col.data() + py * CW * Tp + (c * k + ki) * k;
                // column px's k taps go to lanes px .. px + k: the low vector takes px < VL, the high one
                // px + k > VL; even and odd px in two chains each
                const auto low = [&](vf a, int64_t px) {
                  return add_at(a, src + px * Tp, px, (int)std::min<int64_t>(k, VL - px));
                };
                const auto high = [&](vf a, int64_t px) {
                  const int64_t first = std::max<int64_t>(px, VL);
                  return add_at(a, src + px * Tp + (first - px), first - VL, (int)(px + k - first));
                };
                int64_t px = 0;                                           // CW and VL are even
                for (; px < std::min<int64_t>(VL, CW); px += 2)
                  lo = low(lo, px), lo_odd = low(lo_odd, px + 1);
                px = std::max<int64_t>(0, VL - k + 1);
                if (px & 1) hi_odd = high(hi_odd, px++);
                for (; px < CW; px += 2) hi = high(hi, px), hi_odd = high(hi_odd, px + 1);
              }
              store_first(dxs + (c * H + y) * W, lo + lo_odd, VL);
              store_first(dxs + (c * H + y) * W + VL, hi + hi_odd, (int)(W - VL));
              continue;
            }
#endif
            for (int64_t x0 = 0; x0 < W; x0 += VL) {
              vf row = vf{}, odd = vf{};                    // two chains of additions, not one
              for (int64_t ki = 0; ki < k; ++ki) {
                const int64_t py = y - ki;
                if (py < 0 || py >= CH) continue;
                const float* src = col.data() + py * CW * Tp + (c * k + ki) * k;
                if (W <= VL) {                       // one vector per row: lanes px .. px + k (CW is even)
                  for (int64_t px = 0; px + 1 < CW; px += 2) {
                    row = add_at(row, src + px * Tp, px, (int)k);
                    odd = add_at(odd, src + (px + 1) * Tp, px + 1, (int)k);
                  }
                  continue;
                }
                for (int64_t px = std::max<int64_t>(0, x0 - k + 1); px < std::min(CW, x0 + VL); ++px) {
                  const int64_t lo = std::max(px, x0), hi = std::min(px + k, x0 + VL);   // lanes [lo, hi)
                  row = add_at(row, src + px * Tp + (lo - px), lo - x0, (int)(hi - lo));
                }
              }
              store_first(dxs + (c * H + y) * W + x0, row + odd, (int)std::min<int64_t>(VL, W - x0));
            }
          }
      }
      for (int64_t o = 0; o < O; ++o) {
        dbp[gi * O + o] = bsum[o];
        for (int64_t t = 0; t < T; ++t) dwp[(gi * O + o) * T + t] = acc[(o / VL) * T + t][o % VL];
      }
    }
  });
  return {dw, db, dx};
}

// The floats per vector this build was compiled for (a run's provenance records it: the first block's filter
// gradients group their partial sums by it).
int64_t vector_floats() { return VL; }

}  // namespace

TORCH_LIBRARY(fedprism_kernels, m) {
  m.def("vector_floats() -> int", &vector_floats);
  m.def("stem_forward(Tensor x, Tensor w, Tensor b, int k) -> Tensor");
  m.def("stem_train_forward(Tensor x, Tensor w, Tensor b, int k) -> (Tensor, Tensor)");
  m.def("stem_backward(Tensor grad, Tensor arg, Tensor x, int k) -> (Tensor, Tensor)");
  m.def("block_backward(Tensor grad, Tensor arg, Tensor x, Tensor w, int k) -> (Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(fedprism_kernels, CPU, m) {
  m.impl("stem_forward", &stem_forward);
  m.impl("stem_train_forward", &stem_train_forward);
  m.impl("stem_backward", &stem_backward);
  m.impl("block_backward", &block_backward);
}
