// fp16 -> fp32 of every half as a 256 KB table (qgemm.h). Compiled with F16C: the entries are the
// hardware conversion's, exact, so a lookup equals `_cvtsh_ss`. Only called after the caller's
// instruction set was picked (every path here has F16C).
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "qgemm.h"

namespace pds_cpu {

const float* f16_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(1 << 16);
    for (uint32_t h = 0; h < t.size(); ++h) t[h] = _cvtsh_ss(static_cast<uint16_t>(h));
    return t;
  }();  // C++11: built once, thread-safe
  return table.data();
}

}  // namespace pds_cpu
