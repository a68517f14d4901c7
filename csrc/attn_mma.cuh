// Warp-level pieces of the FA2-style attention kernels on mma.sync m16n8k16 (bf16 in, fp32
// accumulate), shared by prefill and decode. Portable to sm_80, sm_90a and sm_120a.
//
// Fragment ownership (PTX ISA, m16n8k16): in an accumulator tile, lane l holds row l/4 in
// elements 0,1 and row l/4+8 in elements 2,3, at columns 2*(l%4) and 2*(l%4)+1. A warp owns
// 16 query rows: Q in A-fragments, S = QK^T and O in accumulators, running max m and sum l
// per owned row. Shared-memory tiles are row-major with a row stride of D+8 elements so that
// ldmatrix rows fall in different banks.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

namespace pds::attn {

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; copies zeros instead when !valid.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Async copy of `rows` rows x D elements (source row stride `stride`) into a shared tile
// with row stride D+8; rows >= valid are zero-filled. All kThreads threads take part.
template <int D, int kThreads>
__device__ __forceinline__ void load_rows(__nv_bfloat16* dst, const __nv_bfloat16* src,
                                          int64_t stride, int rows, int valid) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < rows * kChunks; i += kThreads) {
    int r = i / kChunks, c = i % kChunks;
    bool ok = r < valid;
    cp_async16(dst + r * (D + 8) + c * 8, src + (ok ? r * stride : 0) + c * 8, ok);
  }
}

// Q A-fragments for 16 rows starting at `q` (row stride `ld` elements), all D columns.
template <int D>
__device__ __forceinline__ void load_q_frags(uint32_t (&qf)[D / 16][4], const __nv_bfloat16* q,
                                             int ld) {
  int lane = threadIdx.x % 32;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    ldmatrix_x4(qf[kk], q + (lane % 16) * ld + kk * 16 + (lane / 16) * 8);
}

// S[NT n-tiles of 8 keys] = Q K^T for the keys at `k` (row stride ld).
template <int D, int NT>
__device__ __forceinline__ void qk_tile(float (&s)[NT][4], const uint32_t (&qf)[D / 16][4],
                                        const __nv_bfloat16* k, int ld) {
  int lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int j = 0; j < NT; j += 2) {
      uint32_t b[4];
      ldmatrix_x4(b, k + (8 * j + lane % 8 + (lane / 16) * 8) * ld + kk * 16 + ((lane / 8) % 2) * 8);
      mma16816(s[j], qf[kk], b[0], b[1]);
      mma16816(s[j + 1], qf[kk], b[2], b[3]);
    }
}

// Online softmax over one tile of scaled, masked scores (log2 domain; -inf = masked).
// Rescales o, updates the running max m and the lane-partial sum l, leaves P in s.
template <int D, int NT>
__device__ __forceinline__ void softmax_tile(float (&s)[NT][4], float (&o)[D / 8][4],
                                             float (&m)[2], float (&l)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = m[h];
#pragma unroll
    for (int j = 0; j < NT; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    float base = mx == -INFINITY ? 0.0f : mx;  // a fully masked row stays all-zero, not NaN
    float corr = exp2f(m[h] - base);
    m[h] = mx;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      s[j][2 * h] = exp2f(s[j][2 * h] - base);
      s[j][2 * h + 1] = exp2f(s[j][2 * h + 1] - base);
      sum += s[j][2 * h] + s[j][2 * h + 1];
    }
    l[h] = l[h] * corr + sum;
#pragma unroll
    for (int d = 0; d < D / 8; ++d) {
      o[d][2 * h] *= corr;
      o[d][2 * h + 1] *= corr;
    }
  }
}

// O += P V for the NT*8 keys at `v` (row stride ld); P comes from the accumulators in s.
template <int D, int NT>
__device__ __forceinline__ void pv_tile(float (&o)[D / 8][4], const float (&s)[NT][4],
                                        const __nv_bfloat16* v, int ld) {
  int lane = threadIdx.x % 32;
#pragma unroll
  for (int kc = 0; kc < NT / 2; ++kc) {
    uint32_t p[4] = {pack_bf16x2(s[2 * kc][0], s[2 * kc][1]),
                     pack_bf16x2(s[2 * kc][2], s[2 * kc][3]),
                     pack_bf16x2(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                     pack_bf16x2(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
    for (int dt = 0; dt < D / 8; dt += 2) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, v + (16 * kc + lane % 8 + ((lane / 8) % 2) * 8) * ld + 8 * dt + (lane / 16) * 8);
      mma16816(o[dt], p, b[0], b[1]);
      mma16816(o[dt + 1], p, b[2], b[3]);
    }
  }
}

// Sum of the quad's lane-partial row sums.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace pds::attn
