// Paged decode attention (see attention.h), compiled with AVX2 + FMA + F16C. head_dim a multiple
// of 8 (64, 128: every model here) and every fp16 cache take the intrinsics path: per chunk of
// keys, the scores of every query head of the group, one vectorized exp over them, then each
// value row added to every head's accumulator. Other head sizes take a plain `omp simd` loop of
// the same arithmetic.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "attention.h"
#include "avx2_math.h"

namespace pds_cpu {
namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void scale_add(float* acc, float alpha, const float* v, float p, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] * alpha + p * v[i];
}

// e^x for x <= 0 (exp_clamped_avx2). Below -87.3 (and for -inf, the padding) the result is 0,
// which is what the softmax needs there.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);  // false for -inf and NaN-free pads
  return _mm256_and_ps(exp_clamped_avx2(_mm256_max_ps(x, lo)), zero_mask);
}

// 8 cache elements as fp32: fp32 as they are, fp16 widened (exactly)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// A unit's end: the normalized output (`keys` the whole context), or its part's softmax state
// (acc [group][d], then the maxima and the sums) for decode_attention_merge.
void finish(const DecodeAttention& a, int64_t b, int64_t kvh, const DecodeKeys& keys, const float* acc,
            const float* run_max, const float* run_sum) {
  const int64_t group = a.heads / a.kv_heads, d = a.head_dim;
  if (keys.state != nullptr) {
    std::copy(acc, acc + group * d, keys.state);
    std::copy(run_max, run_max + group, keys.state + group * d);
    std::copy(run_sum, run_sum + group, keys.state + group * d + group);
    return;
  }
  float* out = a.out + (b * a.heads + kvh * group) * d;
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.0f / run_sum[g];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = acc[g * d + i] * inv;
  }
}

// The head_dim % 8 == 0 path over cache elements T; same scratch layout as the generic one,
// scores padded to 8.
template <class T>
void decode_attention_vec(const DecodeAttention& a, int64_t b, int64_t kvh, const DecodeKeys& keys, float* scratch) {
  const int64_t group = a.heads / a.kv_heads, d = a.head_dim;
  const int64_t row = a.kv_heads * d;
  const float* q = a.q + b * a.q_stride + kvh * group * d;
  const int64_t* table = a.tables + b * a.table_stride;
  float* acc = scratch;
  float* scores = acc + group * d;
  float* run_max = scores + group * kKeysPerChunk;
  float* run_sum = run_max + group;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t g = 0; g < group; ++g) {
    run_max[g] = neg_inf;
    run_sum[g] = 0.0f;
    for (int64_t i = 0; i < d; ++i) acc[g * d + i] = 0.0f;
  }
  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int64_t t0 = keys.begin; t0 < keys.end;) {
    const KeyChunk chunk = key_chunk(a, table, kvh, t0, keys.end, kKeysPerChunk);
    const int64_t n = chunk.n, base = chunk.base;
    prefetch_rows(static_cast<const T*>(a.v_cache) + base, n, row, d);
    if (t0 + n < keys.end) {
      const KeyChunk next = key_chunk(a, table, kvh, t0 + n, keys.end, kKeysPerChunk);
      prefetch_rows(static_cast<const T*>(a.k_cache) + next.base, next.n, row, d);
    }
    const int64_t padded = (n + 7) & ~int64_t{7};
    for (int64_t j = 0; j < n; ++j) {  // scores: each key row read once for the whole group
      const T* k = static_cast<const T*>(a.k_cache) + base + j * row;
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q + g * d;
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= d; i += 16) {
          s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), load8(k + i), s0);
          s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i + 8), load8(k + i + 8), s1);
        }
        if (i < d) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), load8(k + i), s0);
        scores[g * kKeysPerChunk + j] = hsum_avx2(_mm256_add_ps(s0, s1));
      }
    }
    for (int64_t g = 0; g < group; ++g) {  // online softmax update, 8 scores at a time
      float* s = scores + g * kKeysPerChunk;
      for (int64_t j = n; j < padded; ++j) s[j] = neg_inf;
      __m256 mx = _mm256_set1_ps(run_max[g]);
      for (int64_t j = 0; j < padded; j += 8) {
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(s + j), scale);
        _mm256_storeu_ps(s + j, v);
        mx = _mm256_max_ps(mx, v);
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float m = _mm_cvtss_f32(m4);
      const __m256 mv = _mm256_set1_ps(m);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t j = 0; j < padded; j += 8) {
        const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, p);
        sum = _mm256_add_ps(sum, p);
      }
      const float alpha = std::exp(run_max[g] - m);  // 0 on the first chunk (exp(-inf))
      run_sum[g] = run_sum[g] * alpha + hsum_avx2(sum);
      run_max[g] = m;
      if (alpha != 1.0f) {
        const __m256 av = _mm256_set1_ps(alpha);
        float* o = acc + g * d;
        for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), av));
      }
    }
    for (int64_t j = 0; j < n; ++j) {  // values: each row read once for the whole group
      const T* v = static_cast<const T*>(a.v_cache) + base + j * row;
      for (int64_t g = 0; g < group; ++g) {
        const __m256 p = _mm256_set1_ps(scores[g * kKeysPerChunk + j]);
        float* o = acc + g * d;
        for (int64_t i = 0; i < d; i += 8)
          _mm256_storeu_ps(o + i, _mm256_fmadd_ps(p, load8(v + i), _mm256_loadu_ps(o + i)));
      }
    }
    t0 += n;
  }
  finish(a, b, kvh, keys, acc, run_max, run_sum);
}

}  // namespace

void decode_attention_merge(const DecodeAttention& a, int64_t b, int64_t kvh, const float* states, int64_t parts) {
  const int64_t group = a.heads / a.kv_heads, d = a.head_dim, stride = decode_state_floats(a);
  float* out = a.out + (b * a.heads + kvh * group) * d;
  for (int64_t g = 0; g < group; ++g) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < parts; ++p) m = std::max(m, states[p * stride + group * d + g]);
    float sum = 0.0f;
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = 0.0f;
    for (int64_t p = 0; p < parts; ++p) {  // in part order: the same bits whoever merges
      const float* st = states + p * stride;
      const float w = std::exp(st[group * d + g] - m);
      sum += st[group * d + group + g] * w;
      for (int64_t i = 0; i < d; ++i) out[g * d + i] += st[g * d + i] * w;
    }
    const float inv = 1.0f / sum;
    for (int64_t i = 0; i < d; ++i) out[g * d + i] *= inv;
  }
}

void decode_attention_avx2(const DecodeAttention& a, int64_t b, int64_t kvh, const DecodeKeys& keys,
                           float* scratch) {
  if (a.kv_half) return decode_attention_vec<uint16_t>(a, b, kvh, keys, scratch);  // head_dim % 16 == 0 (checked)
  if (a.head_dim % 8 == 0) return decode_attention_vec<float>(a, b, kvh, keys, scratch);
  const int64_t group = a.heads / a.kv_heads, d = a.head_dim;
  const int64_t row = a.kv_heads * d;  // floats between neighbouring tokens
  const float* q = a.q + b * a.q_stride + kvh * group * d;
  const int64_t* table = a.tables + b * a.table_stride;
  float* acc = scratch;                        // [group][d]
  float* scores = acc + group * d;             // [group][kKeysPerChunk]
  float* run_max = scores + group * kKeysPerChunk;  // [group]
  float* run_sum = run_max + group;                 // [group]
  for (int64_t g = 0; g < group; ++g) {
    run_max[g] = -std::numeric_limits<float>::infinity();
    run_sum[g] = 0.0f;
    for (int64_t i = 0; i < d; ++i) acc[g * d + i] = 0.0f;
  }
  const float* kv_rows[kKeysPerChunk];
  const float* vv_rows[kKeysPerChunk];
  for (int64_t t0 = keys.begin; t0 < keys.end;) {
    // the keys of one chunk never cross a block boundary: one table lookup per chunk
    const KeyChunk chunk = key_chunk(a, table, kvh, t0, keys.end, kKeysPerChunk);
    const int64_t n = chunk.n, base = chunk.base;
    for (int64_t j = 0; j < n; ++j) {
      kv_rows[j] = static_cast<const float*>(a.k_cache) + base + j * row;
      vv_rows[j] = static_cast<const float*>(a.v_cache) + base + j * row;
    }
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores + g * kKeysPerChunk;
      float m = run_max[g];
      for (int64_t j = 0; j < n; ++j) {
        s[j] = dot(q + g * d, kv_rows[j], d) * a.scale;
        m = std::max(m, s[j]);
      }
      const float alpha = std::exp(run_max[g] - m);  // 0 on the first chunk (exp(-inf))
      float sum = run_sum[g] * alpha;
      float* o = acc + g * d;
      for (int64_t j = 0; j < n; ++j) {
        const float p = std::exp(s[j] - m);
        sum += p;
        scale_add(o, j == 0 ? alpha : 1.0f, vv_rows[j], p, d);
      }
      run_max[g] = m;
      run_sum[g] = sum;
    }
    t0 += n;
  }
  finish(a, b, kvh, keys, acc, run_max, run_sum);
}

}  // namespace pds_cpu
