// Paged decode attention (attention.h) on AVX-512F for head_dim 64 or 128 and up to 8 query heads
// per KV head (every model here), over an fp32 or fp16 cache; other shapes take the AVX2 kernel.
//
// Why a second kernel: the AVX2 one keeps each head's output accumulator in memory (a load, an
// FMA and a store per 8 dims per key and head) and sums each score with a 256-bit horizontal add.
// Here the group's accumulators live in registers (G x head_dim / 16 zmm), a value row is loaded
// once and feeds G x head_dim / 16 FMAs with the probability broadcast from memory, and a score
// is head_dim / 16 FMAs and one 512-bit reduction. Same online softmax, per chunk of up to 16 keys
// of one block.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "attention.h"
#include "avx512_math.h"

namespace pds_cpu {
namespace {

constexpr int kChunk = 16;  // keys per softmax update (one vector of scores)

// 16 cache elements as fp32: fp32 as they are, fp16 widened (exactly)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// G query heads of head_dim 16 * D over one KV head, cache elements T; `probs` is scratch for
// G x 16 floats.
template <int G, int D, class T>
void decode_unit(const DecodeAttention& a, int64_t b, int64_t kvh, const DecodeKeys& keys, float* probs) {
  const int64_t d = 16 * D, row = a.kv_heads * d;
  const float* q = a.q + b * a.q_stride + kvh * G * d;
  const int64_t* table = a.tables + b * a.table_stride;
  __m512 qv[G][D], acc[G][D];
  float run_max[G], run_sum[G];
  for (int g = 0; g < G; ++g) {
    for (int i = 0; i < D; ++i) {
      qv[g][i] = _mm512_loadu_ps(q + g * d + 16 * i);
      acc[g][i] = _mm512_setzero_ps();
    }
    run_max[g] = -std::numeric_limits<float>::infinity();
    run_sum[g] = 0.0f;
  }
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int64_t t0 = keys.begin; t0 < keys.end;) {
    const KeyChunk chunk = key_chunk(a, table, kvh, t0, keys.end, kChunk);
    const int64_t n = chunk.n;
    const T* k0 = static_cast<const T*>(a.k_cache) + chunk.base;
    const T* v0 = static_cast<const T*>(a.v_cache) + chunk.base;
    prefetch_rows(v0, n, row, d);
    if (t0 + n < keys.end) {
      const KeyChunk next = key_chunk(a, table, kvh, t0 + n, keys.end, kChunk);
      prefetch_rows(static_cast<const T*>(a.k_cache) + next.base, next.n, row, d);
    }
    for (int64_t j = 0; j < n; ++j) {  // scores: each key row read once for the group
      const T* k = k0 + j * row;
      __m512 kv[D];
      for (int i = 0; i < D; ++i) kv[i] = load16(k + 16 * i);
      for (int g = 0; g < G; ++g) {
        __m512 s = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int i = 1; i < D; ++i) s = _mm512_fmadd_ps(qv[g][i], kv[i], s);
        probs[g * kChunk + j] = _mm512_reduce_add_ps(s);
      }
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    for (int g = 0; g < G; ++g) {  // online softmax update
      const __m512 s = _mm512_mask_mul_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid,
                                          _mm512_loadu_ps(probs + g * kChunk), scale);
      const float m = std::max(run_max[g], _mm512_reduce_max_ps(s));
      const __m512 p = exp_nonpositive_avx512(_mm512_sub_ps(s, _mm512_set1_ps(m)));
      _mm512_storeu_ps(probs + g * kChunk, p);
      const float alpha = std::exp(run_max[g] - m);  // 0 on the first chunk (exp(-inf))
      run_sum[g] = run_sum[g] * alpha + _mm512_reduce_add_ps(p);
      run_max[g] = m;
      if (alpha != 1.0f) {
        const __m512 av = _mm512_set1_ps(alpha);
        for (int i = 0; i < D; ++i) acc[g][i] = _mm512_mul_ps(acc[g][i], av);
      }
    }
    for (int64_t j = 0; j < n; ++j) {  // values: each row loaded once for the group
      const T* v = v0 + j * row;
      __m512 vv[D];
      for (int i = 0; i < D; ++i) vv[i] = load16(v + 16 * i);
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(probs[g * kChunk + j]);
        for (int i = 0; i < D; ++i) acc[g][i] = _mm512_fmadd_ps(p, vv[i], acc[g][i]);
      }
    }
    t0 += n;
  }
  if (keys.state != nullptr) {  // one part of the keys: its state, for decode_attention_merge
    for (int g = 0; g < G; ++g) {
      for (int i = 0; i < D; ++i) _mm512_storeu_ps(keys.state + g * d + 16 * i, acc[g][i]);
      keys.state[G * d + g] = run_max[g];
      keys.state[G * d + G + g] = run_sum[g];
    }
    return;
  }
  float* out = a.out + (b * a.heads + kvh * G) * d;
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(1.0f / run_sum[g]);
    for (int i = 0; i < D; ++i) _mm512_storeu_ps(out + g * d + 16 * i, _mm512_mul_ps(acc[g][i], inv));
  }
}

template <int D, class T>
bool decode_group(const DecodeAttention& a, int64_t b, int64_t kvh, const DecodeKeys& keys, float* probs) {
  switch (a.heads / a.kv_heads) {
    case 1: decode_unit<1, D, T>(a, b, kvh, keys, probs); return true;
    case 2: decode_unit<2, D, T>(a, b, kvh, keys, probs); return true;
    case 3: decode_unit<3, D, T>(a, b, kvh, keys, probs); return true;
    case 4: decode_unit<4, D, T>(a, b, kvh, keys, probs); return true;
    case 5: decode_unit<5, D, T>(a, b, kvh, keys, probs); return true;
    case 6: decode_unit<6, D, T>(a, b, kvh, keys, probs); return true;
    case 7: decode_unit<7, D, T>(a, b, kvh, keys, probs); return true;
    case 8: decode_unit<8, D, T>(a, b, kvh, keys, probs); return true;
    default: return false;
  }
}

template <int D>
bool decode_group(const DecodeAttention& a, int64_t b, int64_t kvh, const DecodeKeys& keys, float* probs) {
  return a.kv_half ? decode_group<D, uint16_t>(a, b, kvh, keys, probs)
                   : decode_group<D, float>(a, b, kvh, keys, probs);
}

}  // namespace

bool decode_attention_avx512(const DecodeAttention& a, int64_t b, int64_t kvh, const DecodeKeys& keys,
                             float* scratch) {
  if (a.head_dim == 64) return decode_group<4>(a, b, kvh, keys, scratch);
  if (a.head_dim == 128) return decode_group<8>(a, b, kvh, keys, scratch);
  return false;
}

}  // namespace pds_cpu
