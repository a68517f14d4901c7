// Paged decode attention on the CPU: one query token per sequence over its K/V read in place
// from the paged cache (`[blocks, block_size, kv_heads, head_dim]`, fp32) through its block
// table. GQA: the `heads / kv_heads` query heads of one KV head are one unit of work, so each
// key and value row is read once for all of them. Softmax is online (running max and sum, per
// chunk of keys), so no score row of the whole context is ever stored.
#pragma once
#include <cstdint>

namespace pds_cpu {

struct DecodeAttention {
  const float* q;            // [B][heads][head_dim], token row stride q_stride (floats)
  int64_t q_stride;
  const float* k_cache;      // [blocks][block_size][kv_heads][head_dim]
  const float* v_cache;
  const int64_t* tables;     // [B][table_stride] block ids
  int64_t table_stride;
  const int64_t* lens;       // [B] context lengths (the new token included)
  float* out;                // [B][heads][head_dim]
  int64_t heads, kv_heads, head_dim, block_size;
  float scale;
};

// Keys scored per pass of the online softmax (a whole block when block_size is smaller).
constexpr int64_t kKeysPerChunk = 32;

// Scratch floats one unit of work needs (the caller gives each thread its own).
inline int64_t decode_attention_scratch(const DecodeAttention& a) {
  const int64_t group = a.heads / a.kv_heads;
  return group * (a.head_dim + kKeysPerChunk + 2);
}

// Sequence `b`, KV head `kvh`: its group of query heads attended over the sequence's context.
void decode_attention_avx2(const DecodeAttention& a, int64_t b, int64_t kvh, float* scratch);

}  // namespace pds_cpu
