// The extend attention of one unit (attention.h: sequence, KV head, tile of new tokens), written
// once over an instruction set's vector type `V` and included by each ISA unit
// (extend_attention_avx2.cpp, extend_attention_avx512.cpp). `V` is a struct in that unit's
// anonymous namespace, so every instantiation below has internal linkage: two units compiled
// with different flags never share a symbol the linker could pick either of.
//
// Layout: the vector lanes run over query rows (m = token-in-tile * group + head-in-group), so
//   scores   S[j][m]  = sum_i K[j][i] * Qt[i][m]      (K elements broadcast, Qt rows loaded)
//   values   Ot[i][m] = alpha[m] Ot[i][m] + sum_j V[j][i] * P[j][m]
// and the online softmax (per row m: max over keys, exp, sum) is element-wise over vectors of
// rows: no horizontal reductions, no transposed copy of K, and each K and V row is read from the
// cache in place (through the block table) once per chunk for every row of the tile.
//
// An fp16 cache (`kv_half`): each chunk's K rows, then its V rows, are widened to fp32 (exactly)
// into the unit's scratch, and the same arithmetic runs over them.
//
// V provides: reg, W (lanes), KB (keys per score tile), IB (head dims per value tile), MB (row
// vectors per tile); zero, load, store, bcast (one float broadcast), set1, fmadd(a, b, c) = a*b+c,
// mul, add, sub, max, exp_nonpositive (e^x for x <= 0, 0 below -87.3, at -inf and for NaN),
// widen (n fp16 values to fp32, n a multiple of W).
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "attention.h"

namespace pds_cpu {
namespace extend_detail {

// S[j0 + kb][(mv0 + mb) * W ...] for kb < KB, mb < MB: KB keys against MB vectors of rows.
// Not inlined: inlined into score_cols, GCC kept a copy of the accumulators on the stack and
// stored it every iteration in the tiles of fewer vectors (the tail tiles ran half as fast).
template <class V, int KB, int MB>
__attribute__((noinline)) void score_tile(const float* const* krow, const float* qt, int64_t mp, int64_t d,
                                          float* s, int64_t j0, int64_t mv0) {
  using reg = typename V::reg;
  reg acc[KB][MB];
  const float* kp[KB];
  for (int kb = 0; kb < KB; ++kb) {
    kp[kb] = krow[j0 + kb];
    for (int mb = 0; mb < MB; ++mb) acc[kb][mb] = V::zero();
  }
  const float* qrow = qt + mv0 * V::W;
  for (int64_t i = 0; i < d; ++i, qrow += mp) {
    reg qv[MB];
    for (int mb = 0; mb < MB; ++mb) qv[mb] = V::load(qrow + mb * V::W);
    for (int kb = 0; kb < KB; ++kb) {
      const reg k = V::bcast(kp[kb] + i);
      for (int mb = 0; mb < MB; ++mb) acc[kb][mb] = V::fmadd(k, qv[mb], acc[kb][mb]);
    }
  }
  for (int kb = 0; kb < KB; ++kb)
    for (int mb = 0; mb < MB; ++mb) V::store(s + (j0 + kb) * mp + (mv0 + mb) * V::W, acc[kb][mb]);
}

// Every row vector from mv0 on, MB at a time, then the rest with fewer.
template <class V, int KB, int MB>
inline void score_cols(const float* const* krow, const float* qt, int64_t mp, int64_t d, float* s,
                       int64_t j0, int64_t mv0, int64_t nv) {
  for (; mv0 + MB <= nv; mv0 += MB) score_tile<V, KB, MB>(krow, qt, mp, d, s, j0, mv0);
  if constexpr (MB > 1) {
    if (mv0 < nv) score_cols<V, KB, MB - 1>(krow, qt, mp, d, s, j0, mv0, nv);
  }
}

// Ot[i0 + ib][(mv0 + mb) * W ...] = alpha * Ot + sum_j V[j][i0 + ib] * P[j][...], j < kc.
// Not inlined, for the same reason as score_tile.
template <class V, int IB, int MB>
__attribute__((noinline)) void value_tile(const float* const* vrow, const float* p, const float* alpha,
                                          int64_t mp, int64_t kc, float* ot, int64_t i0, int64_t mv0) {
  using reg = typename V::reg;
  reg acc[IB][MB];
  for (int mb = 0; mb < MB; ++mb) {
    const reg al = V::load(alpha + (mv0 + mb) * V::W);
    for (int ib = 0; ib < IB; ++ib) acc[ib][mb] = V::mul(V::load(ot + (i0 + ib) * mp + (mv0 + mb) * V::W), al);
  }
  const float* prow = p + mv0 * V::W;
  for (int64_t j = 0; j < kc; ++j, prow += mp) {
    reg pv[MB];
    for (int mb = 0; mb < MB; ++mb) pv[mb] = V::load(prow + mb * V::W);
    const float* v = vrow[j] + i0;
    for (int ib = 0; ib < IB; ++ib) {
      const reg vb = V::bcast(v + ib);
      for (int mb = 0; mb < MB; ++mb) acc[ib][mb] = V::fmadd(vb, pv[mb], acc[ib][mb]);
    }
  }
  for (int ib = 0; ib < IB; ++ib)
    for (int mb = 0; mb < MB; ++mb) V::store(ot + (i0 + ib) * mp + (mv0 + mb) * V::W, acc[ib][mb]);
}

template <class V, int IB, int MB>
inline void value_cols(const float* const* vrow, const float* p, const float* alpha, int64_t mp,
                       int64_t kc, float* ot, int64_t i0, int64_t mv0, int64_t nv) {
  for (; mv0 + MB <= nv; mv0 += MB) value_tile<V, IB, MB>(vrow, p, alpha, mp, kc, ot, i0, mv0);
  if constexpr (MB > 1) {
    if (mv0 < nv) value_cols<V, IB, MB - 1>(vrow, p, alpha, mp, kc, ot, i0, mv0, nv);
  }
}

// The s-th of `steps` equal slices of `n` cache rows (`d` elements each, at offsets `at`), asked
// for into L1 (attention.h: prefetch_rows).
template <class T>
inline void prefetch_slice(const T* cache, const int64_t* at, int64_t n, int64_t s, int64_t steps, int64_t d) {
  for (int64_t j = n * s / steps; j < n * (s + 1) / steps; ++j) prefetch_rows(cache + at[j], 1, 0, d);
}

// One unit: sequence b, KV head kvh, new tokens [tok0, tok1) of the sequence; cache elements T.
template <class V, class T>
void extend_unit_of(const ExtendAttention& a, int64_t b, int64_t kvh, int64_t tok0, float* scratch) {
  constexpr int W = V::W;
  using reg = typename V::reg;
  const int64_t group = a.heads / a.kv_heads, d = a.head_dim, bs = a.block_size;
  const int64_t start = a.starts[b], n = a.starts[b + 1] - start, ctx = a.lens[b];
  const int64_t first = ctx - n;  // position of the first new token
  const int64_t tok1 = std::min(n, tok0 + extend_tokens_per_tile(a));
  const int64_t m = (tok1 - tok0) * group, mp = (m + W - 1) / W * W, nv = mp / W;
  const int64_t row = a.kv_heads * d;  // floats between neighbouring tokens of the cache
  const int64_t* table = a.tables + b * a.table_stride;
  float* qt = scratch;        // [d][mp]   the tile's queries, transposed, times the scale
  float* ot = qt + d * mp;    // [d][mp]   output accumulators
  float* s = ot + d * mp;     // [kExtendKeys][mp] scores, then probabilities
  float* run_max = s + kExtendKeys * mp;  // [mp]
  float* run_sum = run_max + mp;          // [mp]
  float* alpha = run_sum + mp;            // [mp] this chunk's rescale of the accumulators
  float* wide = alpha + mp;  // fp16 cache: [kExtendKeys][d] this chunk's keys, then its values, as fp32
  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t t = tok0; t < tok1; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const float* q = a.q + (start + t) * a.q_stride + (kvh * group + g) * d;
      const int64_t r = (t - tok0) * group + g;
      for (int64_t i = 0; i < d; ++i) qt[i * mp + r] = q[i] * a.scale;
    }
  for (int64_t i = 0; i < d; ++i)  // padding rows: zero queries (finite scores, never written out)
    for (int64_t r = m; r < mp; ++r) qt[i * mp + r] = 0.0f;
  std::fill(ot, ot + d * mp, 0.0f);
  std::fill(run_max, run_max + mp, neg_inf);
  std::fill(run_sum, run_sum + mp, 0.0f);

  // Keys [0, diag] are seen by every row of the tile; the last row sees up to kend - 1, and no
  // key after that is read (the causally masked chunks are skipped).
  const int64_t diag = first + tok0, kend = first + tok1;
  // f(t, offset of key t's row for this KV head) for keys [t0, t1): one table lookup a block
  const auto for_rows = [&](int64_t t0, int64_t t1, const auto& f) {
    for (int64_t t = t0; t < t1;) {
      const int64_t blk = t / bs, end = std::min(t1, (blk + 1) * bs);
      const int64_t base = (table[blk] * bs - blk * bs) * row + kvh * d;
      for (; t < end; ++t) f(t, base + t * row);
    }
  };
  const float* krow[kExtendKeys + V::KB];
  const float* vrow[kExtendKeys];
  int64_t offs[kExtendKeys];
  // fp16: the chunk's rows widened into `wide` (keys before the scores, values after the
  // softmax: one buffer, so the tile's working set stays in L1)
  const auto widen_rows = [&](const T* cache, const float** rows, int64_t kc) {
    if constexpr (!std::is_same_v<T, float>) {
      for (int64_t j = 0; j < kc; ++j) {
        V::widen(cache + offs[j], wide + j * d, d);
        rows[j] = wide + j * d;
      }
    }
  };
  for (int64_t c0 = 0; c0 < kend; c0 += kExtendKeys) {
    const int64_t kc = std::min(kExtendKeys, kend - c0);
    for_rows(c0, c0 + kc, [&](int64_t j, int64_t off) { offs[j - c0] = off; });
    if constexpr (std::is_same_v<T, float>) {
      for (int64_t j = 0; j < kc; ++j) {
        krow[j] = k_cache + offs[j];
        vrow[j] = v_cache + offs[j];
      }
    } else {
      widen_rows(k_cache, krow, kc);
    }
    // Each chunk's blocks may sit anywhere in the cache, so the hardware prefetchers cannot run
    // ahead of the block table; the kernel asks for the rows itself. The next chunk's rows into
    // L2 now; this chunk's value rows into L1 while it is scored, and the next chunk's key rows
    // while the values are summed, a slice with each tile: all of a chunk's rows asked for at
    // once filled the fill buffers, and the tiles stalled behind them.
    int64_t next_offs[kExtendKeys], next_kc = 0;
    for_rows(c0 + kc, std::min(kend, c0 + kc + kExtendKeys), [&](int64_t, int64_t off) {
      next_offs[next_kc++] = off;
      for (int64_t i = 0; i < d; i += 64 / static_cast<int64_t>(sizeof(T))) {  // a cache line
        __builtin_prefetch(k_cache + off + i, 0, 2);
        __builtin_prefetch(v_cache + off + i, 0, 2);
      }
    });
    const int64_t kcp = (kc + V::KB - 1) / V::KB * V::KB;
    for (int64_t j = kc; j < kcp; ++j) krow[j] = krow[kc - 1];  // score rows never read
    for (int64_t j0 = 0; j0 < kcp; j0 += V::KB) {
      prefetch_slice(v_cache, offs, kc, j0 / V::KB, kcp / V::KB, d);
      score_cols<V, V::KB, V::MB>(krow, qt, mp, d, s, j0, 0, nv);
    }
    // causal mask: key c0 + j > diag is hidden from the rows whose token is before it
    for (int64_t j = std::max<int64_t>(0, diag + 1 - c0); j < kc; ++j)
      std::fill(s + j * mp, s + j * mp + (c0 + j - diag) * group, neg_inf);
    // online softmax, element-wise over vectors of rows
    for (int64_t v = 0; v < nv; ++v) {
      const reg old_max = V::load(run_max + v * W);
      // four chains: one would wait on each max's latency (the max of -inf and finite scores
      // is the same in any order)
      reg mx = old_max, mx1 = old_max, mx2 = old_max, mx3 = old_max;
      int64_t j = 0;
      for (; j + 4 <= kc; j += 4) {
        mx = V::max(mx, V::load(s + j * mp + v * W));
        mx1 = V::max(mx1, V::load(s + (j + 1) * mp + v * W));
        mx2 = V::max(mx2, V::load(s + (j + 2) * mp + v * W));
        mx3 = V::max(mx3, V::load(s + (j + 3) * mp + v * W));
      }
      for (; j < kc; ++j) mx = V::max(mx, V::load(s + j * mp + v * W));
      mx = V::max(V::max(mx, mx1), V::max(mx2, mx3));
      reg sum = V::zero();
      for (int64_t j = 0; j < kc; ++j) {
        const reg p = V::exp_nonpositive(V::sub(V::load(s + j * mp + v * W), mx));
        V::store(s + j * mp + v * W, p);
        sum = V::add(sum, p);
      }
      // e^(old - new): 0 on the first chunk (old = -inf); a row whose keys of this chunk are
      // all masked keeps its max, so alpha is 1 and its probabilities 0
      const reg al = V::exp_nonpositive(V::sub(old_max, mx));
      V::store(alpha + v * W, al);
      V::store(run_sum + v * W, V::fmadd(V::load(run_sum + v * W), al, sum));
      V::store(run_max + v * W, mx);
    }
    if constexpr (!std::is_same_v<T, float>) widen_rows(v_cache, vrow, kc);
    int64_t i0 = 0;
    for (; i0 + V::IB <= d; i0 += V::IB) {
      prefetch_slice(k_cache, next_offs, next_kc, i0 / V::IB, d / V::IB, d);
      value_cols<V, V::IB, V::MB>(vrow, s, alpha, mp, kc, ot, i0, 0, nv);
    }
    for (; i0 < d; ++i0) value_cols<V, 1, V::MB>(vrow, s, alpha, mp, kc, ot, i0, 0, nv);
  }
  for (int64_t t = tok0; t < tok1; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = (t - tok0) * group + g;
      const float inv = 1.0f / run_sum[r];
      float* out = a.out + ((start + t) * a.heads + kvh * group + g) * d;
      for (int64_t i = 0; i < d; ++i) out[i] = ot[i * mp + r] * inv;
    }
}

template <class V>
void extend_unit(const ExtendAttention& a, int64_t b, int64_t kvh, int64_t tok0, float* scratch) {
  if (a.kv_half)
    extend_unit_of<V, uint16_t>(a, b, kvh, tok0, scratch);
  else
    extend_unit_of<V, float>(a, b, kvh, tok0, scratch);
}

}  // namespace extend_detail
}  // namespace pds_cpu
