"""The GGUF block formats pdserve keeps quantized: 32 weights a block, an fp16 scale first.

* Q4_0 (18 bytes): d, then 16 bytes of nibbles; w = d * (q - 8).
* Q4_1 (20 bytes): d, m, then 16 bytes of nibbles; w = d * q + m.
* Q8_0 (34 bytes): d, then 32 int8; w = d * q.

Nibble order (llama.cpp's): byte j holds weight j in its low nibble and weight j + 16 in its
high nibble. A weight matrix [N, K] is stored as N rows of K / 32 blocks, uint8 [N, K/32 * bytes].
"""
from __future__ import annotations

from dataclasses import dataclass

BLOCK = 32  # weights per block


@dataclass(frozen=True)
class BlockFormat:
    name: str          # the GGUF type name
    code: int          # the format code of the native library (csrc/cpu/qgemm.h)
    block_bytes: int

    @property
    def bits(self) -> float:
        """Bits per weight, the fp16 scale (and minimum) included."""
        return self.block_bytes * 8 / BLOCK

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of `k` weights (`k` a multiple of BLOCK)."""
        if k % BLOCK:
            raise ValueError(f"{self.name}: {k} input features are not a multiple of the block ({BLOCK})")
        return k // BLOCK * self.block_bytes

    def columns(self, row_bytes: int) -> int:
        """Weights in a row of `row_bytes` bytes."""
        return row_bytes // self.block_bytes * BLOCK


Q4_0 = BlockFormat("Q4_0", 0, 18)
Q4_1 = BlockFormat("Q4_1", 1, 20)
Q8_0 = BlockFormat("Q8_0", 2, 34)
FORMATS: dict[str, BlockFormat] = {f.name: f for f in (Q4_0, Q4_1, Q8_0)}


def block_format(name: str) -> BlockFormat:
    """The format called `name` (Q4_0 | Q4_1 | Q8_0); a clear error for any other."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"block format {name!r} is not supported; pdserve keeps "
                         f"{', '.join(FORMATS)} quantized") from None
