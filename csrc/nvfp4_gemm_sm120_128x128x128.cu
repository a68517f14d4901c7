// NVFP4 x NVFP4 -> bf16 block-scaled GEMM for SM120 (CUTLASS 4.2), tile 128x128x128,
// cooperative schedule. One configuration per file: each costs minutes and ~6 GB to compile.
// Must be built for sm_120a: for plain sm_120 the MMA body is compiled out without error.
#include "common.cuh"

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/sm100_blockscaled_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace {

using namespace cute;

using ElementAB = cutlass::nv_float4_t<cutlass::float_e2m1_t>;
using ElementD = cutlass::bfloat16_t;
using ElementAcc = float;
constexpr int kAlignAB = 32;                        // elements: 16 bytes of E2M1
constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
using TileShape = Shape<_128, _128, _128>;
using ClusterShape = Shape<_1, _1, _1>;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm120, cutlass::arch::OpClassBlockScaledTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementAcc,
    void, cutlass::layout::RowMajor, kAlignD,       // no C operand (beta = 0)
    ElementD, cutlass::layout::RowMajor, kAlignD,
    cutlass::epilogue::collective::EpilogueScheduleAuto>::CollectiveOp;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm120, cutlass::arch::OpClassBlockScaledTensorOp,
    ElementAB, cutlass::layout::RowMajor, kAlignAB,       // A [m,k] K-major
    ElementAB, cutlass::layout::ColumnMajor, kAlignAB,    // B [n,k] K-major (weight as stored)
    ElementAcc, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::collective::KernelScheduleAuto>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                    void>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
using SfConfig = typename Mainloop::Sm1xxBlkScaledConfig;

typename Gemm::Arguments make_args(void* d, const void* a, const void* b, const void* sfa,
                                   const void* sfb, const float* alpha_dev, float alpha, int m,
                                   int n, int k) {
  using DataT = typename ElementAB::DataType;
  using SfT = typename ElementAB::ScaleFactorType;
  auto stride_a = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, {m, k, 1});
  auto stride_b = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, {n, k, 1});
  auto stride_d = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, {m, n, 1});
  auto layout_sfa = SfConfig::tile_atom_to_shape_SFA(make_shape(m, n, k, 1));
  auto layout_sfb = SfConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1));
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const DataT*>(a), stride_a, static_cast<const DataT*>(b), stride_b,
       static_cast<const SfT*>(sfa), layout_sfa, static_cast<const SfT*>(sfb), layout_sfb},
      {{}, nullptr, stride_d, static_cast<ElementD*>(d), stride_d}};
  args.epilogue.thread.alpha = alpha;
  args.epilogue.thread.alpha_ptr = alpha_dev;
  args.epilogue.thread.beta = 0.0f;
  return args;
}

bool shape_ok(int m, int n, int k) {
  return m > 0 && n > 0 && k > 0 && k % kAlignAB == 0 && n % kAlignD == 0;
}

}  // namespace

extern "C" {

PDS_API int64_t pds_nvfp4_sf_offset(int64_t rows, int64_t k, int64_t row, int64_t kblock) {
  if (rows <= 0 || k <= 0 || k % 16 != 0 || row < 0 || row >= rows || kblock < 0 ||
      kblock >= k / 16)
    return -1;
  auto layout = SfConfig::tile_atom_to_shape_SFA(
      make_shape(static_cast<int>(rows), 1, static_cast<int>(k), 1));
  return layout(make_coord(static_cast<int>(row), static_cast<int>(kblock * 16), 0));
}

PDS_API int64_t pds_nvfp4_gemm_workspace_bytes(int m, int n, int k) {
  if (!shape_ok(m, n, k)) return -1;
  auto args = make_args(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 1.0f, m, n, k);
  return static_cast<int64_t>(Gemm::get_workspace_size(args));
}

PDS_API int pds_nvfp4_gemm_bf16(void* d, const void* a, const void* b, const void* sfa,
                                const void* sfb, const float* alpha_dev, float alpha, int m,
                                int n, int k, void* workspace, size_t workspace_bytes,
                                void* stream) {
  if (!d || !a || !b || !sfa || !sfb || !shape_ok(m, n, k)) return PDS_INVALID_ARGUMENT;
  if (!pds::aligned16(d) || !pds::aligned16(a) || !pds::aligned16(b)) return PDS_INVALID_ARGUMENT;
  int status = pds::check_device(pds::ArchSet::Sm120Only);
  if (status != PDS_OK) return status;
  auto args = make_args(d, a, b, sfa, sfb, alpha_dev, alpha, m, n, k);
  if (Gemm::get_workspace_size(args) > workspace_bytes) return PDS_WORKSPACE_TOO_SMALL;
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return PDS_CANNOT_IMPLEMENT;
  auto cu_stream = static_cast<cudaStream_t>(stream);
  if (gemm.initialize(args, workspace, cu_stream) != cutlass::Status::kSuccess)
    return PDS_LAUNCH_FAILED;
  if (gemm.run(cu_stream) != cutlass::Status::kSuccess) return PDS_LAUNCH_FAILED;
  return pds::launch_status();
}

}  // extern "C"
