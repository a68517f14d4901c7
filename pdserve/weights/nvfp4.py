"""NVIDIA ModelOpt NVFP4 checkpoints: finding and checking the quantization config, exclude
patterns, the fused-projection scale rule, and quantizing one weight the way ModelOpt does.

A ModelOpt checkpoint says it is quantized in one or both of two places:

* `hf_quant_config.json` (older form):
  `{"producer": {...}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
  "kv_cache_quant_algo": null, "exclude_modules": ["lm_head", ...]}}`
* `config.json` `quantization_config` (newer form, written next to the older one):
  `{"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": [...], "config_groups":
  {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}, ...}}}`

Each quantized linear stores `weight` (uint8 [out, in/2], two E2M1 codes a byte, even element in
the low nibble), `weight_scale` (float8_e4m3fn [out, in/16], row-major), `weight_scale_2` (fp32
scalar) and, for NVFP4 (not the weight-only W4A16_NVFP4), `input_scale` (fp32 scalar).
Facts: docs/nvfp4.md.
"""
from __future__ import annotations

import fnmatch
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.layers.quant import QuantConfigError
from pdserve.layers.quant.nvfp4 import NVFP4LinearMethod, unify_fused_scales
from pdserve_kernels.nvfp4 import BLOCK, QuantizedWeight, e2m1_encode, pack_nibbles
from pdserve_kernels.nvfp4.scales import FP4_E4M3_RANGE, weight_block_scales

logger = logging.getLogger(__name__)

# QuantConfigError and unify_fused_scales live in pdserve.layers.quant (layers never import
# weights); they are re-exported here for the checkpoint code and its tests.
__all__ = ["NVFP4Config", "QuantConfigError", "detect", "quantize_with_scale_2", "unify_fused_scales",
           "weight_scale_2_from_amax"]

HF_QUANT_CONFIG = "hf_quant_config.json"
# quant_algo -> whether activations are quantized too (then every layer has an input_scale)
SUPPORTED_ALGOS = {"NVFP4": True, "W4A16_NVFP4": False}
MODES = ("auto", "w4a16", "w4a4")
# Tensors of a quantized KV cache (kv_cache_quant_algo); pdserve keeps the KV cache in the
# model's dtype, so they are read past.
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")


@dataclass(frozen=True)
class NVFP4Config:
    """A ModelOpt NVFP4 checkpoint's quantization settings, as pdserve uses them."""

    quant_algo: str                # "NVFP4" (W4A4, static input_scale) or "W4A16_NVFP4"
    exclude: tuple[str, ...]       # module patterns kept unquantized (fnmatch wildcards)
    kv_cache_quant_algo: str | None
    source: str                    # the file(s) the config came from, for messages
    mode: str = "auto"             # auto | w4a16 | w4a4: how layers compute (layers.quant.nvfp4)

    @property
    def static_activations(self) -> bool:
        return SUPPORTED_ALGOS[self.quant_algo]

    def excluding_pattern(self, module: str) -> str | None:
        """The exclude pattern that matches checkpoint module `module`, if any.

        A pattern matches the module itself (fnmatch: `*`, `?`, `[..]`) or a module above it
        (`model.layers.0.mlp` excludes `model.layers.0.mlp.down_proj`).
        """
        for pattern in self.exclude:
            if fnmatch.fnmatchcase(module, pattern) or module.startswith(pattern.rstrip(".") + "."):
                return pattern
        return None

    def is_excluded(self, module: str) -> bool:
        return self.excluding_pattern(module) is not None

    def linear_method(self, names: list[str]):
        """The NVFP4 method for the linear made of checkpoint modules `names`; None if excluded.

        pdserve fuses q/k/v and gate/up into one matmul, so their parts must agree.
        """
        excluded = [self.excluding_pattern(n) for n in names]
        if all(p is not None for p in excluded):
            return None
        if any(p is not None for p in excluded):
            which = ", ".join(f"{n} ({'excluded by ' + repr(p) if p else 'quantized'})"
                              for n, p in zip(names, excluded, strict=True))
            raise QuantConfigError(f"{self.source}: pdserve runs {', '.join(names)} as one fused "
                                   f"matmul, so they must all be quantized or all excluded: {which}")
        return NVFP4LinearMethod(tuple(names), self.static_activations, self.mode)

    def ignores_tensor(self, name: str) -> bool:
        """Checkpoint tensors pdserve reads past (KV-cache scales)."""
        return name.endswith(KV_SCALE_SUFFIXES)


# ---- finding and checking the config ----------------------------------------------------

def detect(model_dir: str | Path, hf_config: dict | None = None, mode: str = "auto"
           ) -> NVFP4Config | None:
    """The NVFP4 config of `model_dir`, None for an unquantized checkpoint.

    Raises QuantConfigError for any other quantization (another method or algorithm, a group
    size other than 16) and when the two config files disagree.
    """
    if mode not in MODES:
        raise ValueError(f"unknown NVFP4 mode {mode!r}; choose one of {MODES}")
    model_dir = Path(model_dir)
    if hf_config is None:
        hf_config = json.loads((model_dir / "config.json").read_text())
    found: list[NVFP4Config] = []
    path = model_dir / HF_QUANT_CONFIG
    if path.exists():
        found.append(parse_hf_quant_config(json.loads(path.read_text()), str(path), mode))
    if "quantization_config" in hf_config:
        where = f"{model_dir / 'config.json'} quantization_config"
        found.append(parse_quantization_config(hf_config["quantization_config"], where, mode))
    if not found:
        return None
    if any(c.kv_cache_quant_algo for c in found):
        logger.warning("%s: kv_cache_quant_algo %s is ignored; pdserve keeps the KV cache in the "
                       "model dtype and reads past the k/v scales", found[0].source,
                       next(c.kv_cache_quant_algo for c in found if c.kv_cache_quant_algo))
    if len(found) == 2:
        old, new = found
        if old.quant_algo != new.quant_algo or set(old.exclude) != set(new.exclude):
            raise QuantConfigError(
                f"{old.source} and {new.source} disagree: quant_algo {old.quant_algo} vs "
                f"{new.quant_algo}, exclude_modules {sorted(old.exclude)} vs ignore {sorted(new.exclude)}")
        return NVFP4Config(old.quant_algo, old.exclude, old.kv_cache_quant_algo or new.kv_cache_quant_algo,
                           f"{old.source} + {new.source}", mode)
    return found[0]


def parse_hf_quant_config(data: dict, where: str = HF_QUANT_CONFIG, mode: str = "auto") -> NVFP4Config:
    """The older form: {"quantization": {"quant_algo", "group_size", "exclude_modules", ...}}."""
    q = data.get("quantization")
    if not isinstance(q, dict):
        raise QuantConfigError(f"{where}: no \"quantization\" object")
    algo = _check_algo(q.get("quant_algo"), where)
    _check_group_size(q.get("group_size", BLOCK), where)
    exclude = _patterns(q.get("exclude_modules"), where)
    return NVFP4Config(algo, exclude, _kv_algo(q.get("kv_cache_quant_algo")), where, mode)


def parse_quantization_config(data: dict, where: str = "config.json quantization_config",
                              mode: str = "auto") -> NVFP4Config:
    """The newer form: {"quant_method": "modelopt", "quant_algo", "ignore", "config_groups"}."""
    method = data.get("quant_method")
    if method != "modelopt":
        raise QuantConfigError(f"{where}: quant_method {method!r} is not supported; pdserve loads "
                               "NVIDIA ModelOpt NVFP4 checkpoints (quant_method \"modelopt\")")
    algo = _check_algo(data.get("quant_algo"), where)
    for group_name, group in (data.get("config_groups") or {}).items():
        for role in ("weights", "input_activations"):
            spec = (group or {}).get(role)
            if not spec:
                continue
            if spec.get("num_bits", 4) != 4 or spec.get("type", "float") != "float":
                raise QuantConfigError(f"{where}: config_groups.{group_name}.{role} is "
                                       f"{spec.get('type')}{spec.get('num_bits')}, not NVFP4 (float4)")
            if spec.get("dynamic"):
                raise QuantConfigError(f"{where}: config_groups.{group_name}.{role} is dynamic; "
                                       "pdserve supports static NVFP4 scales only")
            _check_group_size(spec.get("group_size", BLOCK), f"{where} config_groups.{group_name}.{role}")
    kv = data.get("kv_cache_scheme")
    kv_algo = kv if isinstance(kv, str) else ("FP8" if isinstance(kv, dict) else None)
    return NVFP4Config(algo, _patterns(data.get("ignore"), where), _kv_algo(kv_algo), where, mode)


def _check_algo(algo: object, where: str) -> str:
    if algo not in SUPPORTED_ALGOS:
        raise QuantConfigError(f"{where}: quant_algo {algo!r} is not supported; pdserve loads "
                               f"{' and '.join(sorted(SUPPORTED_ALGOS))}")
    return str(algo)


def _check_group_size(size: object, where: str) -> None:
    if size != BLOCK:
        raise QuantConfigError(f"{where}: group_size {size!r}; NVFP4 scales blocks of {BLOCK}")


def _patterns(value: object, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise QuantConfigError(f"{where}: the exclude/ignore list must be a list of strings, got {value!r}")
    return tuple(value)


def _kv_algo(algo: object) -> str | None:
    return str(algo) if algo else None


# ---- producing checkpoints --------------------------------------------------------------

def weight_scale_2_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """`amax / (6 * 448)`; 1.0 for an all-zero tensor (any value works there)."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    return torch.where(amax > 0, amax / FP4_E4M3_RANGE, torch.ones_like(amax))


def quantize_with_scale_2(w: torch.Tensor, scale_2: torch.Tensor) -> QuantizedWeight:
    """ModelOpt's NVFP4 weight quantization with a given tensor scale (shared by fused parts).

    With `scale_2 = amax(w) / (6 * 448)` this is `pdserve_kernels.nvfp4.quantize_weight`.
    """
    if w.dim() != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"weight must be [out, in] with in % {BLOCK} == 0, got {tuple(w.shape)}")
    if not torch.isfinite(w).all():
        raise ValueError("weight contains NaN or inf")
    w32 = w.to(torch.float32)
    scale_2 = torch.as_tensor(scale_2, dtype=torch.float32).reshape(())
    scale = weight_block_scales(w32, scale_2)
    denom = (scale.to(torch.float32) * scale_2).repeat_interleave(BLOCK, dim=-1)
    return QuantizedWeight(pack_nibbles(e2m1_encode(w32 / denom)), scale, scale_2)
