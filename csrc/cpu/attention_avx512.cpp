// Paged decode attention (attention.h) on AVX-512F for head_dim 64 or 128 and up to 8 query heads
// per KV head (every model here), over an fp32 or fp16 cache; other shapes take the AVX2 kernel.
//
// Why a second kernel: the AVX2 one keeps each head's output accumulator in memory (a load, an
// FMA and a store per 8 dims per key and head) and sums each score with a 256-bit horizontal add.
// Here the group's accumulators live in registers (G x head_dim / 16 zmm), a value row is loaded
// once and feeds G x head_dim / 16 FMAs with the probability broadcast from memory, and a score
// is head_dim / 16 FMAs and one 512-bit reduction. Same online softmax, per chunk of up to 16 keys
// of one block. Rows that share their first blocks may run as one unit (decode_rows): each row's
// state is parked in scratch between chunks, so the shared chunks are loaded once for all.
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

// The running state of one unit (G query heads of head_dim 16 * D over one KV head) in
// registers: the queries, the unnormalized output, the running maxima and sums. One chunk of keys
// is `add`; `save` and `load` park it in memory exactly (fp32 in, fp32 out), so a unit that
// pauses between chunks computes the same bits as one that does not.
template <int G, int D, class T>
struct UnitState {
  __m512 qv[G][D], acc[G][D];
  float run_max[G], run_sum[G];

  void start(const float* q) {
    for (int g = 0; g < G; ++g) {
      for (int i = 0; i < D; ++i) {
        qv[g][i] = _mm512_loadu_ps(q + g * 16 * D + 16 * i);
        acc[g][i] = _mm512_setzero_ps();
      }
      run_max[g] = -std::numeric_limits<float>::infinity();
      run_sum[g] = 0.0f;
    }
  }

  // `n` keys and values at k0 and v0, `row` elements apart; `probs` is scratch for G x 16 floats.
  void add(const T* k0, const T* v0, int64_t n, int64_t row, __m512 scale, float* probs) {
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
  }

  static constexpr int64_t kFloats = G * (16 * D + 2);  // what save writes
  void save(float* s) const {
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < D; ++i) _mm512_storeu_ps(s + (g * D + i) * 16, acc[g][i]);
    std::copy(run_max, run_max + G, s + G * 16 * D);
    std::copy(run_sum, run_sum + G, s + G * 16 * D + G);
  }
  void load(const float* q, const float* s) {
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < D; ++i) {
        qv[g][i] = _mm512_loadu_ps(q + g * 16 * D + 16 * i);
        acc[g][i] = _mm512_loadu_ps(s + (g * D + i) * 16);
      }
    std::copy(s + G * 16 * D, s + G * 16 * D + G, run_max);
    std::copy(s + G * 16 * D + G, s + G * 16 * D + 2 * G, run_sum);
  }

  // Keys [t0, end) of row b through its block table, chunk by chunk, prefetching a chunk ahead.
  void scan(const DecodeAttention& a, int64_t b, int64_t kvh, int64_t t0, int64_t end, float* probs) {
    const int64_t row = a.kv_heads * 16 * D;
    const int64_t* table = a.tables + b * a.table_stride;
    const __m512 scale = _mm512_set1_ps(a.scale);
    while (t0 < end) {
      const KeyChunk chunk = key_chunk(a, table, kvh, t0, end, kChunk);
      const T* v0 = static_cast<const T*>(a.v_cache) + chunk.base;
      prefetch_rows(v0, chunk.n, row, 16 * D);
      if (t0 + chunk.n < end) {
        const KeyChunk next = key_chunk(a, table, kvh, t0 + chunk.n, end, kChunk);
        prefetch_rows(static_cast<const T*>(a.k_cache) + next.base, next.n, row, 16 * D);
      }
      add(static_cast<const T*>(a.k_cache) + chunk.base, v0, chunk.n, row, scale, probs);
      t0 += chunk.n;
    }
  }

  // The unit's end: its part's softmax state (for decode_attention_merge), or the normalized output.
  void finish(const DecodeAttention& a, int64_t b, int64_t kvh, const DecodeKeys& keys) const {
    constexpr int64_t d = 16 * D;
    if (keys.state != nullptr) {
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
};

template <int G, int D, class T>
void decode_unit(const DecodeAttention& a, int64_t b, int64_t kvh, const DecodeKeys& keys, float* probs) {
  UnitState<G, D, T> s;
  s.start(a.q + b * a.q_stride + kvh * G * 16 * D);
  s.scan(a, b, kvh, keys.begin, keys.end, probs);
  s.finish(a, b, kvh, keys);
}

// Rows that share their first blocks (decode_split.h): `rows[i]` is row i as a batch of one, its
// keys `keys[i]`; keys [keys[i].begin, shared) are the same cache rows for all of them. Each chunk
// of those is loaded once and added to every row's state in turn (parked in scratch between
// rows), so the rows read it from L1; then each row goes on alone over the rest of its keys. A
// row's operations, and so its bits, are those of decode_unit.
template <int G, int D, class T>
void decode_rows(const DecodeAttention* rows, int64_t n, int64_t kvh, const DecodeKeys* keys, int64_t shared,
                 float* scratch) {
  using State = UnitState<G, D, T>;
  constexpr int64_t d = 16 * D;
  float* probs = scratch;                   // G x kChunk
  float* states = scratch + G * kChunk;     // n x State::kFloats
  const DecodeAttention& a = rows[0];
  const int64_t row = a.kv_heads * d;
  const int64_t* table = a.tables;
  const __m512 scale = _mm512_set1_ps(a.scale);
  State s;
  for (int64_t r = 0; r < n; ++r) {
    s.start(rows[r].q + kvh * G * d);
    s.save(states + r * State::kFloats);
  }
  for (int64_t t0 = keys[0].begin; t0 < shared;) {
    const KeyChunk chunk = key_chunk(a, table, kvh, t0, shared, kChunk);
    const T* k0 = static_cast<const T*>(a.k_cache) + chunk.base;
    const T* v0 = static_cast<const T*>(a.v_cache) + chunk.base;
    prefetch_rows(v0, chunk.n, row, d);
    if (t0 + chunk.n < shared) {
      const KeyChunk next = key_chunk(a, table, kvh, t0 + chunk.n, shared, kChunk);
      prefetch_rows(static_cast<const T*>(a.k_cache) + next.base, next.n, row, d);
    }
    for (int64_t r = 0; r < n; ++r) {
      s.load(rows[r].q + kvh * G * d, states + r * State::kFloats);
      s.add(k0, v0, chunk.n, row, scale, probs);
      s.save(states + r * State::kFloats);
    }
    t0 += chunk.n;
  }
  for (int64_t r = 0; r < n; ++r) {
    s.load(rows[r].q + kvh * G * d, states + r * State::kFloats);
    s.scan(rows[r], 0, kvh, shared, keys[r].end, probs);
    s.finish(rows[r], 0, kvh, keys[r]);
  }
}

// f.template run<G, D, T>() for the call's shape: G query heads per KV head, head_dim 16 * D,
// cache elements T. False (nothing run) for shapes this kernel does not cover.
template <int D, class T, class F>
bool with_group(int64_t group, const F& f) {
  switch (group) {
    case 1: f.template run<1, D, T>(); return true;
    case 2: f.template run<2, D, T>(); return true;
    case 3: f.template run<3, D, T>(); return true;
    case 4: f.template run<4, D, T>(); return true;
    case 5: f.template run<5, D, T>(); return true;
    case 6: f.template run<6, D, T>(); return true;
    case 7: f.template run<7, D, T>(); return true;
    case 8: f.template run<8, D, T>(); return true;
    default: return false;
  }
}

template <class F>
bool with_shape(const DecodeAttention& a, const F& f) {
  const int64_t group = a.heads / a.kv_heads;
  if (a.head_dim == 64) return a.kv_half ? with_group<4, uint16_t>(group, f) : with_group<4, float>(group, f);
  if (a.head_dim == 128) return a.kv_half ? with_group<8, uint16_t>(group, f) : with_group<8, float>(group, f);
  return false;
}

struct OneRow {
  const DecodeAttention& a;
  int64_t b, kvh;
  const DecodeKeys& keys;
  float* scratch;
  template <int G, int D, class T>
  void run() const { decode_unit<G, D, T>(a, b, kvh, keys, scratch); }
};

struct SharedRows {
  const DecodeAttention* rows;
  int64_t n, kvh;
  const DecodeKeys* keys;
  int64_t shared;
  float* scratch;
  template <int G, int D, class T>
  void run() const { decode_rows<G, D, T>(rows, n, kvh, keys, shared, scratch); }
};

}  // namespace

bool decode_attention_avx512(const DecodeAttention& a, int64_t b, int64_t kvh, const DecodeKeys& keys,
                             float* scratch) {
  return with_shape(a, OneRow{a, b, kvh, keys, scratch});
}

bool decode_rows_avx512(const DecodeAttention* rows, int64_t n, int64_t kvh, const DecodeKeys* keys,
                        int64_t shared, float* scratch) {
  return with_shape(rows[0], SharedRows{rows, n, kvh, keys, shared, scratch});
}

}  // namespace pds_cpu
