"""The fused forms a step runs (rotary table and q+k in one pass, RMSNorm with the residual add
in place, SwiGLU in place) equal the plain formulas they replace, bit for bit in fp32."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve_kernels.layer_ops import silu_and_mul
from pdserve.layers.norm import RMSNorm
from pdserve.layers.rotary import RotaryEmbedding


def _rope_plain(positions, x, inv_freq):
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)[:, None, :]
    sin = torch.cat((freqs.sin(), freqs.sin()), dim=-1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def test_rotary_on_q_and_k_together_equals_the_plain_formula_bit_for_bit():
    torch.manual_seed(0)
    rope = RotaryEmbedding(64, 100000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    for positions in (torch.tensor([0, 5, 17]), torch.tensor([300, 301]), torch.arange(1000, 1100)):
        qkv = torch.randn(len(positions), 9 + 2 * 3, 64)
        qk = rope.rotate(positions, qkv[:, :12])   # the table grows past its first size here
        assert torch.equal(qk, _rope_plain(positions, qkv[:, :12], rope.inv_freq))
        q, k = rope(positions, qkv[:, :9], qkv[:, 9:12])
        assert torch.equal(torch.cat((q, k), dim=1), qk)


def test_a_step_reads_cos_sin_once_for_all_layers():
    rope = RotaryEmbedding(64, 10000.0)
    positions = torch.tensor([3, 4])
    first = rope.cos_sin(positions)
    assert rope.cos_sin(positions)[0] is first[0]             # same step: the same rows
    assert rope.cos_sin(positions.clone())[0] is not first[0]  # a new step's tensor: read again


def test_rmsnorm_with_residual_equals_add_then_norm():
    torch.manual_seed(1)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data.normal_()
    x, res = torch.randn(7, 576), torch.randn(7, 576)
    s = x + res
    want = norm.weight * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5))
    out, new_res = norm(x.clone(), res)
    assert torch.equal(new_res, s)
    assert torch.allclose(out, want, atol=1e-6, rtol=0)


def test_silu_and_mul_equals_the_two_step_form():
    x = torch.randn(5, 2 * 96)
    assert torch.equal(silu_and_mul(x), F.silu(x[:, :96]) * x[:, 96:])
