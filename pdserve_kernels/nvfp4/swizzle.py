"""The SM120 block-scale layout (CUTLASS `Sm1xxBlockScaledConfig<16>`) and its inverse.

The GEMM reads scales in 512-byte atoms of 128 rows x 4 scale columns; rows are padded to 128
and scale columns to 4. Checkpoints store scales row-major, so they are swizzled once at load.
Padding bytes are zero: a NaN there would poison the MMA through 0 * NaN.
"""
from __future__ import annotations

import torch

ROWS_PER_ATOM = 128
COLS_PER_ATOM = 4
ATOM_BYTES = 512


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def swizzled_size(rows: int, k_blocks: int) -> int:
    """Bytes of the swizzled layout for a [rows, k_blocks] scale matrix."""
    return _round_up(rows, ROWS_PER_ATOM) * _round_up(k_blocks, COLS_PER_ATOM)


def swizzle_offset(r: int, k: int, k_blocks: int) -> int:
    """Byte offset of scale (row r, scale column k), the spec's formula."""
    col_tiles = -(-k_blocks // COLS_PER_ATOM)
    return (
        ((r // 128) * col_tiles + k // 4) * ATOM_BYTES
        + (r % 32) * 16
        + ((r % 128) // 32) * 4
        + k % 4
    )


def _as_bytes(sf: torch.Tensor) -> torch.Tensor:
    return sf.view(torch.uint8) if sf.dtype == torch.float8_e4m3fn else sf


def swizzle_scales(sf: torch.Tensor) -> torch.Tensor:
    """[rows, k_blocks] scales (e4m3 or uint8) -> flat swizzled buffer of the same dtype."""
    rows, k_blocks = sf.shape
    rows_p, cols_p = _round_up(rows, ROWS_PER_ATOM), _round_up(k_blocks, COLS_PER_ATOM)
    padded = torch.zeros((rows_p, cols_p), dtype=torch.uint8, device=sf.device)
    padded[:rows, :k_blocks] = _as_bytes(sf)
    # (row tile, r%128 // 32, r%32, col tile, k%4) -> (row tile, col tile, r%32, r%128 // 32, k%4)
    tiled = padded.view(rows_p // 128, 4, 32, cols_p // 4, 4).permute(0, 3, 2, 1, 4)
    out = tiled.contiguous().flatten()
    return out.view(sf.dtype) if sf.dtype == torch.float8_e4m3fn else out


def unswizzle_scales(buf: torch.Tensor, rows: int, k_blocks: int) -> torch.Tensor:
    """Inverse of swizzle_scales: flat buffer -> [rows, k_blocks]."""
    rows_p, cols_p = _round_up(rows, ROWS_PER_ATOM), _round_up(k_blocks, COLS_PER_ATOM)
    if buf.numel() != rows_p * cols_p:
        raise ValueError(f"buffer has {buf.numel()} bytes, layout needs {rows_p * cols_p}")
    tiled = _as_bytes(buf).view(rows_p // 128, cols_p // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    out = tiled.reshape(rows_p, cols_p)[:rows, :k_blocks].contiguous()
    return out.view(buf.dtype) if buf.dtype == torch.float8_e4m3fn else out
