"""NVFP4 linear layers (ModelOpt checkpoints) on three backends, chosen once per layer at load.

* `sm120`: the CUTLASS block-scaled GEMM (W4A4; activations quantized by the CUDA kernel with
  the static input_scale) and, for decode batches of at most 16 rows, the CUDA-core GEMV (W4A16).
  Weight scales are swizzled once, in `finish`. Needs an SM120 GPU and the built library.
* `w4a16`: weights dequantized once at load, then a dense matmul: on a CPU in fp32, exactly
  `pdserve_kernels.nvfp4.nvfp4_linear_w4a16`; on other GPUs in the model dtype (the Hopper
  fallback of the spec).
* `w4a4`: the exact emulation of the SM120 GEMM (`nvfp4_linear_w4a4`): activations quantized
  to NVFP4 with input_scale, products of dequantized operands summed in fp32, times alpha.

Mode "auto" picks `sm120` when it can run, else `w4a16`; "w4a16" and "w4a4" force the reference.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

import pdserve_kernels.nvfp4 as fp4
from pdserve.layers.quant import LinearMethod, QuantConfigError, Shard, place, read_shard

logger = logging.getLogger(__name__)

GEMV_MAX_ROWS = 16     # the CUDA-core kernel serves decode batches up to this many tokens
GEMM_K_ALIGN = 32      # CUTLASS operand alignment (elements) and the GEMV's K step
GEMM_N_ALIGN = 8       # bf16 output alignment of the CUTLASS epilogue
_announced: set[str] = set()


def choose_backend(mode: str, device: torch.device, static_activations: bool) -> str:
    """sm120 | w4a16 | w4a4 for a layer on `device` (see the module docstring)."""
    if mode == "w4a4" and not static_activations:
        raise QuantConfigError("W4A4 needs input_scale; this checkpoint is weight-only (W4A16_NVFP4)")
    if mode != "auto":
        return mode
    if device.type == "cuda" and static_activations:
        from pdserve_kernels import cuda_lib

        if cuda_lib.available(need_sm120=True):
            return "sm120"
    return "w4a16"


def _announce(backend: str, device: torch.device) -> None:
    """Say once per process which path NVFP4 layers take (the startup log)."""
    key = f"{backend}@{device.type}"
    if key not in _announced:
        _announced.add(key)
        text = {"sm120": "CUTLASS SM120 block-scaled GEMM + CUDA GEMV (csrc/)",
                "w4a16": "weights dequantized once at load (torch)",
                "w4a4": "W4A4 emulated exactly in torch (reference)"}[backend]
        logger.info("NVFP4 linear layers on %s: %s", device, text)


class NVFP4LinearMethod(LinearMethod):
    """One NVFP4 linear layer, made of checkpoint modules `names` (q/k/v or gate/up when fused)."""

    def __init__(self, names: tuple[str, ...], static_activations: bool, mode: str = "auto"):
        self.names = names
        self.static_activations = static_activations
        self.mode = mode
        self.backend = ""
        self.part_rows: dict[int, tuple[int, int]] = {}  # part -> (first row, rows) in the layer
        self.loaded: set[tuple[str, int]] = set()          # (parameter, part) read so far

    # ---- parameters as the checkpoint stores them -------------------------------------
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        if in_features % fp4.BLOCK:
            raise QuantConfigError(f"{self.names[0]}: {in_features} input features are not a multiple "
                                   f"of {fp4.BLOCK} (the NVFP4 block); list the module in exclude_modules")
        frozen = dict(requires_grad=False)
        layer.weight = nn.Parameter(torch.empty(out_features, in_features // 2, dtype=torch.uint8), **frozen)
        layer.weight_scale = nn.Parameter(
            torch.empty(out_features, in_features // fp4.BLOCK, dtype=torch.float8_e4m3fn), **frozen)
        # one value per fused part until `finish` unifies them
        parts = len(self.names)
        layer.weight_scale_2 = nn.Parameter(torch.zeros(parts, dtype=torch.float32), **frozen)
        if self.static_activations:
            layer.input_scale = nn.Parameter(torch.zeros(parts, dtype=torch.float32), **frozen)

    def load(self, layer: nn.Module, param: str, source, name: str, shard: Shard) -> None:
        if param == "weight":
            tensor = self._checked(read_shard(source, name, shard, 2), torch.uint8, name, "packed E2M1")
            place(layer.weight, tensor, shard, name)
            self.part_rows[shard.part] = (shard.offset, tensor.shape[0])
        elif param == "weight_scale":
            tensor = self._checked(read_shard(source, name, shard, fp4.BLOCK), torch.float8_e4m3fn,
                                   name, "E4M3 block scales")
            place(layer.weight_scale, tensor, shard, name)
        elif param in ("weight_scale_2", "input_scale") and hasattr(layer, param):
            value = source.get(name)
            if value.numel() != 1 or not value.is_floating_point():
                raise QuantConfigError(f"checkpoint tensor {name}: expected one float (a per-tensor "
                                       f"scale), found {value.dtype} {tuple(value.shape)}")
            scale = value.to(torch.float32).reshape(())
            if not torch.isfinite(scale) or scale <= 0:
                raise QuantConfigError(f"checkpoint tensor {name} = {scale.item()}: a scale must be "
                                       "finite and positive")
            getattr(layer, param).data[shard.part] = scale
        else:
            raise QuantConfigError(f"checkpoint tensor {name}: unexpected in an NVFP4 layer "
                                   f"({self.names[0]} takes {', '.join(self.params)})")
        self.loaded.add((param, shard.part))

    @property
    def params(self) -> tuple[str, ...]:
        """The checkpoint tensors of each part."""
        scales = ("weight_scale_2", "input_scale") if self.static_activations else ("weight_scale_2",)
        return ("weight", "weight_scale", *scales)

    @staticmethod
    def _checked(tensor: torch.Tensor, dtype: torch.dtype, name: str, what: str) -> torch.Tensor:
        if tensor.dtype != dtype:
            raise QuantConfigError(f"checkpoint tensor {name} is {tensor.dtype}; an NVFP4 layer expects "
                                   f"{dtype} ({what}). Is the module missing from the exclude/ignore list?")
        return tensor

    # ---- after loading ----------------------------------------------------------------
    def finish(self, layer: nn.Module, dtype: torch.dtype) -> None:
        missing = [f"{name}.{param}" for part, name in enumerate(self.names) for param in self.params
                   if (param, part) not in self.loaded]
        if missing:
            raise QuantConfigError(f"checkpoint is missing {', '.join(missing)} (NVFP4 layer)")
        rows = [self.part_rows[part] for part in range(len(self.names))]
        weight_scale, scale_2 = unify_fused_scales(layer.weight_scale.data, rows, layer.weight_scale_2.data)
        if not torch.equal(weight_scale.view(torch.uint8), layer.weight_scale.data.view(torch.uint8)):
            logger.info("%s: parts had different weight_scale_2; block scales rescaled to the max",
                        ", ".join(self.names))
        layer.weight_scale.data = weight_scale
        layer.weight_scale_2 = nn.Parameter(scale_2, requires_grad=False)
        if self.static_activations:
            # every part sees the same input, so calibration gave (nearly) the same amax; the
            # max never clips any part's range
            layer.input_scale = nn.Parameter(layer.input_scale.data.max(), requires_grad=False)
        device = layer.weight.device
        self.backend = choose_backend(self.mode, device, self.static_activations)
        n, k = layer.weight.shape[0], layer.weight.shape[1] * 2
        if self.backend == "sm120" and (k % GEMM_K_ALIGN or n % GEMM_N_ALIGN):
            logger.info("%s: [%d, %d] does not fit the SM120 kernels' alignment; dequantized instead",
                        self.names[0], n, k)
            self.backend = "w4a16"
        _announce(self.backend, device)
        getattr(self, f"_prepare_{self.backend}")(layer, dtype)

    def _prepare_w4a16(self, layer: nn.Module, dtype: torch.dtype) -> None:
        w = fp4.dequantize(layer.weight, layer.weight_scale, layer.weight_scale_2)
        # fp32 on a CPU (the reference's arithmetic); the model dtype on a GPU (speed)
        compute = torch.float32 if layer.weight.device.type == "cpu" else dtype
        layer.register_buffer("dequantized", w.to(compute), persistent=False)

    def _prepare_w4a4(self, layer: nn.Module, dtype: torch.dtype) -> None:
        # codes x block scales, exact in fp32; the tensor scale goes into alpha, as in the GEMM
        layer.register_buffer("dequantized_blocks", fp4.dequantize(layer.weight, layer.weight_scale),
                              persistent=False)
        self.alpha = layer.input_scale * layer.weight_scale_2

    def _prepare_sm120(self, layer: nn.Module, dtype: torch.dtype) -> None:
        layer.register_buffer("weight_scale_swizzled", fp4.swizzle_scales(layer.weight_scale.data),
                              persistent=False)
        self.alpha = (layer.input_scale * layer.weight_scale_2).reshape(1).contiguous()
        self.gs = (1.0 / layer.input_scale).reshape(1).contiguous()
        self.scale_2 = float(layer.weight_scale_2)

    # ---- forward ----------------------------------------------------------------------
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.backend == "w4a16":
            y = F.linear(x.to(layer.dequantized.dtype), layer.dequantized).to(x.dtype)
        elif self.backend == "w4a4":
            y = self._w4a4(layer, x)
        elif self.backend == "sm120":
            y = self._sm120(layer, x)
        else:
            raise RuntimeError(f"{self.names[0]}: NVFP4 layer used before finish()")
        return y + bias if bias is not None else y

    def _w4a4(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`nvfp4_linear_w4a4` with the weight's dequantization hoisted out of the call."""
        x2 = x.reshape(-1, x.shape[-1])
        xq = fp4.quantize_activation(x2, layer.input_scale)
        acc = fp4.dequantize(xq.data, xq.scale) @ layer.dequantized_blocks.T
        return (acc * self.alpha).to(x.dtype).reshape(*x.shape[:-1], -1)

    def _sm120(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from pdserve_kernels import cuda_lib

        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
        if x2.shape[0] <= GEMV_MAX_ROWS:
            y = cuda_lib.nvfp4_gemv(x2, layer.weight, layer.weight_scale_swizzled, self.scale_2,
                                    swizzled=True)
        else:
            xq, sfa = cuda_lib.nvfp4_quantize(x2, self.gs)
            y = cuda_lib.nvfp4_gemm(xq, layer.weight, sfa, layer.weight_scale_swizzled, self.alpha)
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def unify_fused_scales(weight_scale: torch.Tensor, rows: list[tuple[int, int]],
                       scale_2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One weight_scale_2 for a fused matrix whose parts (row ranges) came with their own.

    The fused matmul has one tensor scale, so it takes the largest part's, `S = max(s_i)`, as
    vLLM does. A part quantized with `s_i < S` keeps its E2M1 codes and gets block scales
    `e4m3(weight_scale * s_i / S)`: its dequantized values `code * weight_scale * s_i` are kept
    up to one E4M3 rounding of each block scale (relative 2^-4 at most, the same step ModelOpt
    takes when it quantizes with the shared scale; blocks whose scale falls below E4M3's
    smallest subnormal round to zero, values under `amax * 2^-10 / 448`). Re-encoding the codes
    from the dequantized values instead would round every element a second time on the coarse
    E2M1 grid, for no gain. Using the largest scale means no block scale grows, so none
    saturates at 448. ModelOpt's exports share one scale per fused group already (it takes the
    max amax before quantizing), and then this is the identity.
    """
    target = scale_2.max()
    out = weight_scale.clone()
    for (start, count), s in zip(rows, scale_2, strict=True):
        if s != target:
            part = weight_scale[start:start + count].to(torch.float32) * (s / target)
            out[start:start + count] = fp4.to_e4m3(part)
    return out, target
