// The decode rows of one attention call as units of work (attention.h: decode_parts): per row,
// kv_heads x parts units; the unit that finishes a (row, KV head) last merges its parts. Used by
// the two C entries that run decode rows (dispatch.cpp, extend_attention.cpp), both compiled
// with baseline flags, so this inline code is never built with another instruction set.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "attention.h"

namespace pds_cpu {

class DecodeSplit {
 public:
  // Sequences b < B of a call whose context lengths are `a.lens`; `is_row(b)`: whether b is a
  // decode row (an extend call also holds prompt chunks, which have no units here).
  template <class IsRow>
  DecodeSplit(const DecodeAttention& a, int64_t B, const IsRow& is_row)
      : lens_(a.lens), kv_heads_(a.kv_heads), stride_(decode_state_floats(a)), first_state_(B, -1),
        first_counter_(B, -1) {
    int64_t states = 0, counters = 0;
    for (int64_t b = 0; b < B; ++b) {
      if (!is_row(b) || decode_parts(lens_[b]) == 1) continue;
      first_state_[b] = states;
      first_counter_[b] = counters;
      states += kv_heads_ * decode_parts(lens_[b]);
      counters += kv_heads_;
    }
    if (states == 0) return;
    // the calling thread's buffers, kept between calls: a step calls this once a layer
    thread_local std::vector<float> state_buffer;
    thread_local std::unique_ptr<std::atomic<int64_t>[]> counter_buffer;
    thread_local int64_t counter_capacity = 0;
    if (static_cast<int64_t>(state_buffer.size()) < states * stride_) state_buffer.resize(states * stride_);
    if (counter_capacity < counters) {
      counter_buffer.reset(new std::atomic<int64_t>[counters]);
      counter_capacity = counters;
    }
    states_ = state_buffer.data();
    pending_ = counter_buffer.get();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; first_counter_[b] >= 0 && h < kv_heads_; ++h)
        pending_[first_counter_[b] + h].store(decode_parts(lens_[b]), std::memory_order_relaxed);
  }

  // Units of row b: kv_heads x its parts.
  int64_t units(int64_t b) const { return kv_heads_ * decode_parts(lens_[b]); }

  // Unit u (< units(b)) of row b: KV head u / parts, part u % parts. The kernel sees the row as
  // sequence `vb` of `view` (the call's own batch, or a one-sequence view of it).
  void run(int64_t b, int64_t u, const DecodeAttention& view, int64_t vb, float* scratch, bool avx512) {
    const int64_t len = lens_[b], parts = decode_parts(len), kvh = u / parts, p = u % parts;
    if (parts == 1) {
      decode_attention_unit(view, vb, kvh, DecodeKeys{0, len, nullptr}, scratch, avx512);
      return;
    }
    float* states = states_ + (first_state_[b] + kvh * parts) * stride_;
    const DecodeKeys keys{p * kDecodeKeysPerPart, std::min(len, (p + 1) * kDecodeKeysPerPart), states + p * stride_};
    decode_attention_unit(view, vb, kvh, keys, scratch, avx512);
    // the last part to finish merges; acq_rel: every other part's state is visible to it
    if (pending_[first_counter_[b] + kvh].fetch_sub(1, std::memory_order_acq_rel) == 1)
      decode_attention_merge(view, vb, kvh, states, parts);
  }

 private:
  const int64_t* lens_;
  int64_t kv_heads_, stride_;
  std::vector<int64_t> first_state_;    // per row: its first part's state (-1: one part, or not a decode row)
  std::vector<int64_t> first_counter_;  // per split row: its KV heads' first counter in pending_
  float* states_ = nullptr;                 // [split rows' parts][decode_state_floats]
  std::atomic<int64_t>* pending_ = nullptr;  // per (split row, KV head): parts not finished
};

}  // namespace pds_cpu
