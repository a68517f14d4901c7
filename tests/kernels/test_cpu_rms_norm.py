"""The native fused residual add + RMSNorm (csrc/cpu/norm_avx2.cpp) against the torch reference.

Bound, and why: both compute in fp32. The sum of squares of `dim` terms may round differently
(another order): relative error at most about dim * 2^-24; the reciprocal square root halves
it; the two products add 2 roundings. So |got - want| <= (dim / 2 + 4) * 2^-24 * |want| (plus
1e-30 for exact zeros). The sum written back into x is one fp32 add on both sides: bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from pdserve_kernels import norm



@pytest.mark.parametrize("rows,dim", [(1, 576), (3, 64), (8, 577), (17, 2048), (5, 7)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_native_add_rms_norm_equals_the_reference(rows, dim, with_residual):
    g = torch.Generator().manual_seed(rows * dim)
    x = torch.randn(rows, dim, generator=g) * 3
    res = torch.randn(rows, dim, generator=g) if with_residual else None
    w = torch.randn(dim, generator=g)
    x_ref, x_nat = x.clone(), x.clone()
    want = norm.rms_norm(x_ref, res, w, 1e-5)
    got = norm.rms_norm_cpu(x_nat, res, w, 1e-5)
    assert torch.equal(x_nat, x_ref)  # the sum (or x untouched) is what the reference leaves
    bound = (dim / 2 + 4) * 2.0 ** -24 * want.abs() + 1e-30
    assert ((got - want).abs() <= bound).all(), ((got - want).abs() / want.abs().clamp_min(1e-30)).max()


def test_views_and_other_dtypes_run_the_reference():
    x = torch.randn(4, 2, 64)
    w = torch.randn(64)
    view = x[:, 0]  # not contiguous: the q/k norm of Qwen3 passes such views
    assert torch.equal(norm.rms_norm_cpu(view, None, w, 1e-6), norm.rms_norm(view, None, w, 1e-6))
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    assert torch.equal(norm.rms_norm_cpu(xb, None, wb, 1e-6), norm.rms_norm(xb, None, wb, 1e-6))
