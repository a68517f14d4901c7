"""Linear layers whose weights stay in GGUF blocks (Q4_0, Q4_1, Q8_0) and multiply as such.

The weight is one uint8 parameter [out, in/32 * block bytes]: N rows of blocks, exactly as a
GGUF file stores them, so a GGUF tensor loads by a copy. A safetensors model quantized on load
(`--quantization int8 | int4`) reads its float shard and quantizes it into the same layout.
The matmul is `pdserve_kernels.qmatmul`: the native CPU kernels or the torch reference.

Tensor parallelism: rows (output features) split anywhere; columns (input features, the
row-parallel layers) only on block boundaries, since a block's 32 weights share one scale.
"""
from __future__ import annotations

import torch
from torch import nn

import pdserve_kernels as ops
from pdserve_kernels import cpu_lib
from pdserve_kernels.quant import BLOCK, BlockFormat, pack_q4, packable, quantize

from . import LinearMethod, QuantConfigError, Shard, place, read_shard


class BlockQuantLinearMethod(LinearMethod):
    """One linear layer in `fmt` blocks; `on_load`: the checkpoint is float, quantize it here."""

    def __init__(self, fmt: BlockFormat, on_load: bool = False, name: str = "") -> None:
        self.fmt = fmt
        self.on_load = on_load
        self.name = name  # the checkpoint module (the first part when fused), for messages

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        if in_features % BLOCK:
            raise QuantConfigError(f"{self.name}: {in_features} input features (this rank's) are not "
                                   f"a multiple of the {self.fmt.name} block ({BLOCK})")
        layer.weight = nn.Parameter(torch.empty(out_features, self.fmt.row_bytes(in_features),
                                                dtype=torch.uint8), requires_grad=False)
        layer.packed = None  # the weight repacked for the fused layer blocks (set by finish)

    def load(self, layer: nn.Module, param: str, source, name: str, shard: Shard) -> None:
        if param != "weight":
            raise QuantConfigError(f"checkpoint tensor {name}: a {self.fmt.name} layer has only a weight")
        place(layer.weight, read_blocks(source, name, shard, self.fmt, self.on_load), shard, name)

    def finish(self, layer: nn.Module, dtype: torch.dtype) -> None:
        """Q4_0/Q4_1 on a CPU running the native kernels with AVX-512 VNNI (unless
        $PDSERVE_INT16_ACTIVATIONS=0, `cpu_lib.int16_activations`): also keep the weight packed
        for the int16-activation kernel (pdserve_kernels.quant.packed; ≈6 bits a weight more in
        memory). Then every row this layer multiplies, in any step, has its activations rounded
        to int16 per block of 32 and goes through that one kernel (`qmatmul_packed`): 1.5–4× the
        fp32 paths' speed, and a row's result is the same bits whatever its step's size."""
        if packable(self.fmt) and layer.weight.device.type == "cpu" and ops.is_native(ops.qmatmul_packed) \
                and cpu_lib.int16_activations():
            layer.packed = pack_q4(layer.weight.data, self.fmt)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.packed is not None:
            y = ops.qmatmul_packed(x, layer.weight, self.fmt, layer.packed)
        else:
            y = ops.qmatmul(x, layer.weight, self.fmt)
        return y + bias if bias is not None else y


def read_blocks(source, name: str, shard: Shard, fmt: BlockFormat, on_load: bool) -> torch.Tensor:
    """This rank's slice of checkpoint tensor `name` as rows of `fmt` blocks."""
    if shard.dim == 1 and (shard.start % BLOCK or shard.stop % BLOCK):
        raise QuantConfigError(
            f"checkpoint tensor {name}: this rank's input columns [{shard.start}, {shard.stop}) do not "
            f"fall on {fmt.name} block boundaries (every {BLOCK}); choose a TP size that splits the "
            "input features into multiples of 32, or load the model unquantized")
    if on_load:
        tensor = read_shard(source, name, shard)
        if not tensor.is_floating_point():
            raise QuantConfigError(f"checkpoint tensor {name} is {tensor.dtype}; on-load quantization "
                                   "needs a float checkpoint")
        return quantize(tensor, fmt)
    if shard.dim == 0:
        tensor = source.get_slice(name, 0, shard.start, shard.stop)
    else:
        per_block = fmt.block_bytes
        tensor = source.get_slice(name, 1, shard.start // BLOCK * per_block, shard.stop // BLOCK * per_block)
    if tensor.dtype != torch.uint8:
        raise QuantConfigError(f"checkpoint tensor {name} is {tensor.dtype}, not {fmt.name} blocks (uint8)")
    return tensor
