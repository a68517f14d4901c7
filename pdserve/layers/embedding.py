"""Token embedding (replicated) and the LM head (vocab-parallel), plain or in GGUF blocks.

The embedding is a lookup, cheap to replicate, and replicating it avoids a collective per step.
The LM head is a large matmul: each rank computes logits for its slice of the vocabulary and
one all_gather assembles them. With tied weights the head is a view of the embedding rows.

With a block-quantized checkpoint (`use_blocks`) the weight is uint8 rows of GGUF blocks: the
lookup dequantizes only the rows it gathers, and the head multiplies the blocks directly
(`pdserve_kernels.qmatmul`), so neither ever holds the fp32 matrix. A Q8_0 head on a CPU with
the int16-activation kernel (AVX-512 VNNI) also keeps a packed copy and multiplies through it
(`finish`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import pdserve_kernels as ops
from pdserve.distributed import TPGroup
from pdserve_kernels import cpu_lib
from pdserve_kernels.quant import Q8_0, BlockFormat, Packed, dequantize, pack, quantize


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim), requires_grad=False)
        self.fmt: BlockFormat | None = None  # set by use_blocks
        self.on_load = False
        self.dtype = self.weight.dtype       # of the looked-up rows (the model's)

    def use_blocks(self, fmt: BlockFormat, on_load: bool) -> None:
        """Store the table as `fmt` blocks (`on_load`: quantize the float checkpoint on load)."""
        self.weight = _blocks_param(self.weight, fmt)
        self.fmt, self.on_load = fmt, on_load

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.fmt is not None:
            return dequantize(self.weight[ids], self.fmt).to(self.dtype)
        return F.embedding(ids, self.weight)

    def load(self, param: str, source, name: str, shard_id: object = None) -> None:
        rows = self.weight.shape[0]
        if self.fmt is None:
            self.weight.data.copy_(source.get_slice(name, 0, 0, rows, self.weight.dtype))
        else:
            self.weight.data.copy_(_read_blocks(source, name, 0, rows, self.fmt, self.on_load))


class LMHead(nn.Module):
    """Hidden states → logits over the full vocabulary, computed vocab-parallel."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup = TPGroup(),
                 tied_to: Embedding | None = None):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.start, self.stop = _vocab_range(vocab_size, tp)
        self.fmt: BlockFormat | None = None
        self.on_load = False
        if tied_to is not None:
            self.tied_to = [tied_to]  # a list so the embedding is not registered twice
            self.weight = None
        else:
            self.tied_to = []
            self.weight = nn.Parameter(torch.empty(self.stop - self.start, dim), requires_grad=False)
        self.packed: Packed | None = None  # set by finish

    def use_blocks(self, fmt: BlockFormat, on_load: bool) -> None:
        """An untied head stored as `fmt` blocks (a tied one follows its embedding)."""
        self.weight = _blocks_param(self.weight, fmt)
        self.fmt, self.on_load = fmt, on_load

    def block_format(self) -> BlockFormat | None:
        """The blocks the head multiplies (its own or its tied embedding's); None: float."""
        return self._weight()[1]

    def _weight(self) -> tuple[torch.Tensor, BlockFormat | None]:
        if self.tied_to:
            table = self.tied_to[0]
            return table.weight[self.start:self.stop], table.fmt
        return self.weight, self.fmt

    def finish(self) -> None:
        """Once loaded: a Q8_0 head on a CPU where the Q4 layers take int16 activations
        (`cpu_lib.int16_activations`) keeps a packed copy (≈ the blocks' size again) and
        multiplies activations rounded to int16 per block of 32 through the same kernel: ≈ 2× the
        fp32 path's speed at any row count, and a row's logits are the same bits in any batch."""
        weight, fmt = self._weight()
        if fmt is Q8_0 and weight.device.type == "cpu" and ops.is_native(ops.qmatmul_packed) \
                and cpu_lib.int16_activations():
            self.packed = pack(weight.data, fmt)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight, fmt = self._weight()
        if self.packed is not None:
            logits = ops.qmatmul_packed(hidden, weight, fmt, self.packed)
        else:
            logits = F.linear(hidden, weight) if fmt is None else ops.qmatmul(hidden, weight, fmt)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits, dim=-1)[..., :self.vocab_size]
        return logits

    def load(self, param: str, source, name: str, shard_id: object = None) -> None:
        if self.fmt is None:
            self.weight.data.copy_(source.get_slice(name, 0, self.start, self.stop, self.weight.dtype))
        else:
            self.weight.data.copy_(_read_blocks(source, name, self.start, self.stop, self.fmt, self.on_load))


def use_block_formats(model: nn.Module, quant: object) -> None:
    """Switch the embeddings and untied LM heads of `model` whose checkpoint tensor `quant` keeps
    in blocks (its `embedding_format(name)` gives (format, on_load) or None) before loading."""
    format_of = getattr(quant, "embedding_format", None)
    if format_of is None:
        return
    for name, module in model.named_modules():
        if isinstance(module, (Embedding, LMHead)) and module.weight is not None:
            spec = format_of(f"{name}.weight")
            if spec is not None:
                module.use_blocks(*spec)


def finish_heads(model: nn.Module) -> None:
    """Once `model` is loaded: each LM head's `finish` (the packed copy of a Q8_0 head)."""
    for module in model.modules():
        if isinstance(module, LMHead):
            module.finish()


def _blocks_param(weight: nn.Parameter, fmt: BlockFormat) -> nn.Parameter:
    rows, dim = weight.shape
    return nn.Parameter(torch.empty(rows, fmt.row_bytes(dim), dtype=torch.uint8, device=weight.device),
                        requires_grad=False)


def _read_blocks(source, name: str, start: int, stop: int, fmt: BlockFormat, on_load: bool) -> torch.Tensor:
    tensor = source.get_slice(name, 0, start, stop)
    if on_load:
        return quantize(tensor, fmt)
    if tensor.dtype != torch.uint8:
        raise ValueError(f"checkpoint tensor {name} is {tensor.dtype}, not {fmt.name} blocks (uint8)")
    return tensor


def _vocab_range(vocab: int, tp: TPGroup) -> tuple[int, int]:
    """Equal slices (the last may be short), so all_gather sees same-sized parts after padding."""
    part = -(-vocab // tp.size)
    return min(tp.rank * part, vocab), min((tp.rank + 1) * part, vocab)
