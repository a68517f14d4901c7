// Per-thread scratch reused across calls, handed out 64-byte aligned. The kernels read activation
// rows with 64-byte vector loads; from a buffer that starts off a cache line (malloc gives 16
// bytes) every such load is split in two, which measured 1.35x slower for the dot path at 8 rows.
#pragma once
#include <cstdint>
#include <vector>

namespace pds_cpu {

// At least n elements of `v` (grown as needed), starting on a 64-byte boundary.
template <typename T>
T* aligned_scratch(std::vector<T>& v, int64_t n) {
  constexpr int64_t pad = 64 / sizeof(T);
  if (static_cast<int64_t>(v.size()) < n + pad) v.resize(n + pad);
  const auto p = reinterpret_cast<uintptr_t>(v.data());
  return reinterpret_cast<T*>((p + 63) & ~static_cast<uintptr_t>(63));
}

}  // namespace pds_cpu
