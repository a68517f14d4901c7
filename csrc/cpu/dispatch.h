// What dispatch.cpp shares with the other baseline-flag units (layer_block.cpp): the run-time
// choice of instruction set and the fp32-activation quantized matmul split over threads.
#pragma once
#include <cstdint>

#include "qgemm.h"
#include "qgemv_packed.h"

namespace pds_cpu {

// The kernels of instruction set `isa` (Isa; ISA_AUTO: the best this CPU runs), null if none.
const Kernels* pick(int isa);

// y[M][N] = x[M][K] . dequant(w)^T on fp32 activations (panels from k->panel_min_rows rows, the
// in-register dot path below), N split over the caller and `threads - 1` helpers (work_pool.h).
void qmatmul_f32(const Kernels* k, int fmt, const float* x, int64_t M, int64_t K, const uint8_t* w,
                 int64_t N, float* y, int threads);

// y[M][N] = x'[M][K] . dequant(W)^T for x' the rows rounded to int16 per block of 32
// (qgemv_packed.h) and W packed for that path; N and blocks of rows split over the caller and
// `threads - 1` helpers. Only after pick(ISA_AVX512) succeeded.
void qmatmul_int16(const Packed& w, const float* x, int64_t M, int64_t K, int64_t N, float* y, int threads);


}  // namespace pds_cpu
