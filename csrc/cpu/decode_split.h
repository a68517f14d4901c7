// The decode rows of one attention call as units of work (attention.h: decode_parts): per row,
// kv_heads x parts units; the unit that finishes a (row, KV head) last merges its parts. Rows
// whose first blocks are the same (sequences that share a cached prefix) share a unit for the
// parts that hold those blocks, so each of those keys is loaded once for all of them
// (decode_rows_avx512; only on AVX-512, where the kernel covers the shape). Used by the two C
// entries that run decode rows (dispatch.cpp, extend_attention.cpp), both compiled with baseline
// flags, so this inline code is never built with another instruction set.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "attention.h"

namespace pds_cpu {

class DecodeSplit {
 public:
  // Sequences b < B of a call whose context lengths are `a.lens`; `is_row(b)`: whether b is a
  // decode row (an extend call also holds prompt chunks, which have no units here). `share`:
  // rows that share their first blocks may share units (the caller runs AVX-512 on a shape
  // decode_avx512_covers); `threads`: how many threads will run the units.
  template <class IsRow>
  DecodeSplit(const DecodeAttention& a, int64_t B, const IsRow& is_row, bool share, int64_t threads)
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
    plan_units(a, B, is_row, share, threads);
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

  // Rows members_[first, first + count), KV head kvh, part `part` of each; with count > 1 the
  // rows' keys [part's start, shared) are the same blocks.
  struct Unit {
    int64_t first, count, kvh, part, shared;
  };

  int64_t units() const { return static_cast<int64_t>(units_.size()); }
  const Unit& unit(int64_t u) const { return units_[u]; }

  // Unit u (< units()). `view(b)`: row b as a batch of one (its q, output, table and length).
  template <class View>
  void run(int64_t u, const View& view, float* scratch, bool avx512) {
    const Unit& w = units_[u];
    const int64_t* rows = members_.data() + w.first;
    if (w.count == 1) {
      decode_attention_unit(view(rows[0]), 0, w.kvh, keys(rows[0], w.kvh, w.part), scratch, avx512);
    } else {
      DecodeAttention views[kSharedRowsMax];
      DecodeKeys part_keys[kSharedRowsMax];
      for (int64_t r = 0; r < w.count; ++r) {
        views[r] = view(rows[r]);
        part_keys[r] = keys(rows[r], w.kvh, w.part);
      }
      decode_rows_avx512(views, w.count, w.kvh, part_keys, w.shared, scratch);
    }
    // the last part of a (row, KV head) to finish merges; acq_rel: every other part's state is visible to it
    for (int64_t r = 0; r < w.count; ++r) {
      const int64_t b = rows[r], parts = decode_parts(lens_[b]);
      if (parts > 1 && pending_[first_counter_[b] + w.kvh].fetch_sub(1, std::memory_order_acq_rel) == 1)
        decode_attention_merge(view(b), 0, w.kvh, states_ + (first_state_[b] + w.kvh * parts) * stride_, parts);
    }
  }

 private:
  DecodeKeys keys(int64_t b, int64_t kvh, int64_t p) const {
    const int64_t len = lens_[b], parts = decode_parts(len);
    float* state = parts == 1 ? nullptr : states_ + ((first_state_[b] + kvh * parts) + p) * stride_;
    return {p * kDecodeKeysPerPart, std::min(len, (p + 1) * kDecodeKeysPerPart), state};
  }

  void add_row_units(int64_t b, int64_t from_part) {
    if (from_part >= decode_parts(lens_[b])) return;
    members_.push_back(b);
    const int64_t first = static_cast<int64_t>(members_.size()) - 1;
    for (int64_t h = 0; h < kv_heads_; ++h)
      for (int64_t p = from_part; p < decode_parts(lens_[b]); ++p) units_.push_back({first, 1, h, p, 0});
  }

  // Rows that share their first block are split, in row order, into as few sets of at most
  // kSharedRowsMax as leave about two units per thread (sharing saves loads but makes fewer,
  // larger units; a row's bits are the same either way). A set shares units for the parts that
  // hold the keys all of its rows share (whole blocks), and each row has its own units for the
  // parts after those. Every other row has its own units.
  template <class IsRow>
  void plan_units(const DecodeAttention& a, int64_t B, const IsRow& is_row, bool share, int64_t threads) {
    std::vector<std::vector<int64_t>> sets;
    if (share) {
      std::unordered_map<int64_t, size_t> set_of;  // first block -> set
      for (int64_t b = 0; b < B; ++b) {
        if (!is_row(b) || lens_[b] < kSharedKeysMin) continue;
        const auto [it, added] = set_of.try_emplace(a.tables[b * a.table_stride], sets.size());
        if (added) sets.emplace_back();
        sets[it->second].push_back(b);
      }
    }
    std::vector<bool> placed(B, false);
    for (const std::vector<int64_t>& set : sets) {
      const int64_t rows = static_cast<int64_t>(set.size());
      int64_t shortest = lens_[set[0]];
      for (int64_t b : set) shortest = std::min(shortest, lens_[b]);
      const int64_t units_each = kv_heads_ * decode_parts(shortest);  // at most, per shared set
      const int64_t splits = std::min(rows, std::max((rows + kSharedRowsMax - 1) / kSharedRowsMax,
                                                     (2 * threads + units_each - 1) / units_each));
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t begin = s * rows / splits, n = (s + 1) * rows / splits - begin;
        if (n > 1) share_units(a, set.data() + begin, n, placed);
      }
    }
    for (int64_t b = 0; b < B; ++b)
      if (is_row(b) && !placed[b]) add_row_units(b, 0);
  }

  // Units for rows[0, n) over the whole blocks they all hold alike, if those are enough keys.
  void share_units(const DecodeAttention& a, const int64_t* rows, int64_t n, std::vector<bool>& placed) {
    const int64_t* first_table = a.tables + rows[0] * a.table_stride;
    int64_t full = lens_[rows[0]] / a.block_size;  // blocks every row holds whole
    for (int64_t r = 1; r < n; ++r) full = std::min(full, lens_[rows[r]] / a.block_size);
    int64_t same = 0;  // leading blocks every row's table names alike
    for (; same < full; ++same) {
      int64_t r = 1;
      while (r < n && a.tables[rows[r] * a.table_stride + same] == first_table[same]) ++r;
      if (r < n) break;
    }
    const int64_t shared = same * a.block_size;
    if (shared < kSharedKeysMin) return;
    const int64_t first = static_cast<int64_t>(members_.size()), shared_parts = decode_parts(shared);
    members_.insert(members_.end(), rows, rows + n);
    for (int64_t h = 0; h < kv_heads_; ++h)
      for (int64_t p = 0; p < shared_parts; ++p)
        units_.push_back({first, n, h, p, std::min(shared, (p + 1) * kDecodeKeysPerPart)});
    for (int64_t r = 0; r < n; ++r) {
      placed[rows[r]] = true;
      add_row_units(rows[r], shared_parts);
    }
  }

  const int64_t* lens_;
  int64_t kv_heads_, stride_;
  std::vector<int64_t> first_state_;    // per row: its first part's state (-1: one part, or not a decode row)
  std::vector<int64_t> first_counter_;  // per split row: its KV heads' first counter in pending_
  std::vector<int64_t> members_;        // the rows of the units, in runs (Unit::first, count)
  std::vector<Unit> units_;
  float* states_ = nullptr;                  // [split rows' parts][decode_state_floats]
  std::atomic<int64_t>* pending_ = nullptr;  // per (split row, KV head): parts not finished
};

}  // namespace pds_cpu
