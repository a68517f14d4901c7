// Paged attention on the CPU. Decode: one query token per sequence over its K/V read in place
// from the paged cache (`[blocks, block_size, kv_heads, head_dim]`, fp32 or IEEE fp16: `kv_half`;
// an fp16 element is widened to fp32 exactly on load, so the arithmetic is the same) through its
// block table. GQA: the `heads / kv_heads` query heads of one KV head are one unit of work, so each
// key and value row is read once for all of them. Softmax is online (running max and sum, per
// chunk of keys), so no score row of the whole context is ever stored.
#pragma once
#include <algorithm>
#include <cstdint>

namespace pds_cpu {

struct DecodeAttention {
  const float* q;            // [B][heads][head_dim], token row stride q_stride (floats)
  int64_t q_stride;
  const void* k_cache;       // [blocks][block_size][kv_heads][head_dim], float or uint16_t (fp16)
  const void* v_cache;
  bool kv_half;              // the caches hold fp16
  const int64_t* tables;     // [B][table_stride] block ids
  int64_t table_stride;
  const int64_t* lens;       // [B] context lengths (the new token included)
  float* out;                // [B][heads][head_dim]
  int64_t heads, kv_heads, head_dim, block_size;
  float scale;
};

// Keys scored per pass of the online softmax (a whole block when block_size is smaller).
constexpr int64_t kKeysPerChunk = 32;

// A decode row's keys are split into parts of this many (the last one shorter), each part of
// each KV head its own unit of work, merged in part order: so a lone long row keeps every thread
// busy (one unit per KV head left a thread idle a third of the time with 3 KV heads on 2; parts
// of 512 keys measured no better, docs/cpu-attention.md).
// The split depends on the row's context alone, never on its batch or the thread count, so a
// row's result is the same bits wherever it runs.
constexpr int64_t kDecodeKeysPerPart = 1024;
static inline int64_t decode_parts(int64_t len) { return (len + kDecodeKeysPerPart - 1) / kDecodeKeysPerPart; }

// Keys [begin, end) of one unit. `state` null: the unit covers the whole context and writes the
// normalized output; else it leaves its part's softmax state there (decode_state_floats):
// [group][head_dim] unnormalized sums of value rows, then the group's running maxima, then
// their sums of exponentials.
struct DecodeKeys {
  int64_t begin, end;
  float* state;
};

static inline int64_t decode_state_floats(const DecodeAttention& a) {
  return a.heads / a.kv_heads * (a.head_dim + 2);
}

// Scratch floats one unit of work needs (the caller gives each thread its own).
inline int64_t decode_attention_scratch(const DecodeAttention& a) {
  const int64_t group = a.heads / a.kv_heads;
  return group * (a.head_dim + kKeysPerChunk + 2);
}

// The chunk of a decode row's keys that starts at key t0, for KV head kvh: the cache offset
// (elements) of its first row, the others `kv_heads * head_dim` apart, and its length: at most
// `most` keys, never past its block or `end`.
struct KeyChunk {
  int64_t base, n;
};
inline KeyChunk key_chunk(const DecodeAttention& a, const int64_t* table, int64_t kvh, int64_t t0, int64_t end,
                          int64_t most) {
  const int64_t bs = a.block_size, off = t0 % bs;
  return {(table[t0 / bs] * bs + off) * a.kv_heads * a.head_dim + kvh * a.head_dim,
          std::min({most, bs - off, end - t0})};
}

// Asks for `n` rows of `d` cache elements, `row` elements apart, to be brought into L1. A decode
// unit asks for its chunk's value rows as it starts scoring the chunk, and for the next chunk's
// key rows: each chunk is a block that may sit anywhere in the cache, so the hardware
// prefetchers, which follow addresses, cannot run ahead of the block table
// (docs/cpu-attention.md).
template <class T>
inline void prefetch_rows(const T* first, int64_t n, int64_t row, int64_t d) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < d; i += 64 / static_cast<int64_t>(sizeof(T))) __builtin_prefetch(first + j * row + i, 0, 3);
}

// Sequence `b`, KV head `kvh`, `keys` of its context: its group of query heads attended.
void decode_attention_avx2(const DecodeAttention& a, int64_t b, int64_t kvh, const DecodeKeys& keys,
                           float* scratch);
// The same on AVX-512 (attention_avx512.cpp); false (nothing done) for shapes it does not cover.
bool decode_attention_avx512(const DecodeAttention& a, int64_t b, int64_t kvh, const DecodeKeys& keys,
                             float* scratch);
// Whether the AVX-512 kernel covers the shape (else the AVX2 one runs).
inline bool decode_avx512_covers(const DecodeAttention& a) {
  const int64_t group = a.heads / a.kv_heads;
  return (a.head_dim == 64 || a.head_dim == 128) && group >= 1 && group <= 8;
}

// Decode rows whose first blocks are the same (a prefix cache hit shared by several sequences)
// read the same K/V rows there. Up to this many such rows are one unit of work: each chunk of
// their shared keys is loaded once for all of them (decode_split.h).
constexpr int64_t kSharedRowsMax = 8;
// Rows share a unit only when they share at least this many keys.
constexpr int64_t kSharedKeysMin = 64;

// Scratch floats of a unit of shared rows: the chunk's scores and every row's parked state.
inline int64_t decode_rows_scratch(const DecodeAttention& a) {
  const int64_t group = a.heads / a.kv_heads;
  return group * 16 + kSharedRowsMax * group * (a.head_dim + 2);
}

// `n` (<= kSharedRowsMax) rows on AVX-512 (a shape decode_avx512_covers): rows[i] is row i as a
// batch of one (b = 0), keys[i] its keys; keys [keys[i].begin, shared) are the same blocks for
// every row (`shared` a multiple of the block size, at most every keys[i].end). Each row gets the
// bits decode_attention_avx512 gives it alone.
bool decode_rows_avx512(const DecodeAttention* rows, int64_t n, int64_t kvh, const DecodeKeys* keys,
                        int64_t shared, float* scratch);

// Sequence `b`, KV head `kvh`: the output from its `parts` states (`states`, one after another),
// combined in part order (attention_avx2.cpp: one definition, so every caller gets the same bits).
void decode_attention_merge(const DecodeAttention& a, int64_t b, int64_t kvh, const float* states, int64_t parts);

// One unit with the AVX-512 kernel where `avx512` (the caller's instruction set) and the shape
// allow, else the AVX2 one. Every caller goes through here, so a decode row gets the same
// arithmetic in a decode batch, in a mixed batch and op by op.
inline void decode_attention_unit(const DecodeAttention& a, int64_t b, int64_t kvh, const DecodeKeys& keys,
                                  float* scratch, bool avx512) {
  if (!avx512 || !decode_attention_avx512(a, b, kvh, keys, scratch)) decode_attention_avx2(a, b, kvh, keys, scratch);
}

// Extend (chunked prefill over a cached prefix): several new tokens per sequence, causal. The
// new tokens of sequence b are q rows [starts[b], starts[b+1]) and sit at the last n_b positions
// of its context (lens[b] tokens, their K/V already in the cache): new token j sees keys
// 0..lens[b] - n_b + j. A unit of work is (sequence, KV head, tile of query rows): the tile's
// rows times the group's heads are the rows of two small GEMMs per chunk of keys (scores, then
// values), with every key and value row loaded once for all of them (extend_attention_impl.h).
struct ExtendAttention {
  const float* q;            // [T][heads][head_dim], token row stride q_stride (floats)
  int64_t q_stride;
  const void* k_cache;       // [blocks][block_size][kv_heads][head_dim], float or uint16_t (fp16)
  const void* v_cache;
  bool kv_half;              // the caches hold fp16 (head_dim a multiple of 16)
  const int64_t* tables;     // [B][table_stride] block ids
  int64_t table_stride;
  const int64_t* lens;       // [B] context lengths (cached + new)
  const int64_t* starts;     // [B + 1] first q row of each sequence (query_start_loc)
  float* out;                // [T][heads][head_dim]
  int64_t heads, kv_heads, head_dim, block_size;
  float scale;
};

// Keys per chunk of the online softmax (any keys: a chunk may span blocks).
constexpr int64_t kExtendKeys = 64;
// Query rows (tokens x heads of one KV head) a tile aims at: 48 is 3 vectors of AVX-512, 6 of
// AVX2, and a multiple of the GQA groups 1, 2, 3, 4, 6, 8 used by models here.
constexpr int64_t kExtendTileRows = 48;

// New tokens per tile (fixed by the shapes, never by the thread count or the ISA). Static: units
// compiled with different ISA flags include it, and each keeps its own copy.
static inline int64_t extend_tokens_per_tile(const ExtendAttention& a) {
  const int64_t group = a.heads / a.kv_heads;
  return group >= kExtendTileRows ? 1 : kExtendTileRows / group;
}

// Scratch floats one unit needs (the caller gives each thread its own): query rows padded to 16.
static inline int64_t extend_attention_scratch(const ExtendAttention& a) {
  const int64_t rows = (extend_tokens_per_tile(a) * (a.heads / a.kv_heads) + 15) / 16 * 16;
  // + one chunk of keys (then values) widened to fp32 when the cache holds fp16
  return rows * (2 * a.head_dim + kExtendKeys + 3) + (a.kv_half ? kExtendKeys * a.head_dim : 0);
}

// Sequence `b`, KV head `kvh`, new tokens [tok0, tok0 + tokens per tile) (clipped): one unit.
void extend_attention_avx2(const ExtendAttention& a, int64_t b, int64_t kvh, int64_t tok0, float* scratch);
void extend_attention_avx512(const ExtendAttention& a, int64_t b, int64_t kvh, int64_t tok0, float* scratch);

}  // namespace pds_cpu
