"""`pdserve quantize --nvfp4 MODEL OUT`: write a ModelOpt-format NVFP4 checkpoint.

The model (a Hugging Face directory in bf16/fp32, a .gguf, or "default") is loaded into
pdserve's own model, a small calibration text runs through it, and each linear layer's largest
|input| becomes its static `input_scale = amax / (6 * 448)`. Weights are quantized with
ModelOpt's formulas; the parts of a layer pdserve fuses (q/k/v, gate/up) share one
`weight_scale_2` and one `input_scale` (the max over the parts, as ModelOpt's export does), so
any ModelOpt loader reads them without rescaling. The embeddings and the LM head stay as they
are. The output has `config.json` with `quantization_config`, `hf_quant_config.json`, the
safetensors, and the source's other files (tokenizer, generation config) copied.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from pdserve_kernels.nvfp4 import input_scale_from_amax

logger = logging.getLogger(__name__)

ALWAYS_EXCLUDED = ("lm_head", "model.embed_tokens")
MAX_SHARD_BYTES = 4 << 30
# written by this step; everything else in the source directory is copied
_REWRITTEN = {"config.json", "hf_quant_config.json", "model.safetensors", "model.safetensors.index.json"}


def quantize_nvfp4(model: str | Path | None, out: str | Path,
                   texts: Sequence[str | list[int]] | None = None, exclude: Sequence[str] = (),
                   weights_only: bool = False) -> Path:
    """Quantize `model` into the new directory `out`; returns `out`.

    `texts`: calibration sequences, as text or token ids (default: pdserve.weights.calibration).
    `exclude`: more module patterns to keep unquantized. `weights_only`: W4A16_NVFP4, no
    activation scales.
    """
    from pdserve.models import load_model, read_config
    from pdserve.weights import WeightSource, resolve_model_path, save_safetensors_dir
    from pdserve.weights.nvfp4 import NVFP4Config, detect

    model_dir = resolve_model_path(model)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    hf_config = read_config(model_dir)
    if detect(model_dir, hf_config) is not None:
        raise ValueError(f"{model_dir} is already quantized")
    algo = "W4A16_NVFP4" if weights_only else "NVFP4"
    patterns = NVFP4Config(algo, (*ALWAYS_EXCLUDED, *exclude), None, "pdserve quantize")
    net = load_model(model_dir, torch.float32, "cpu")
    source = WeightSource(model_dir)
    groups, excluded = _linear_groups(net, source, patterns)
    amax = {} if weights_only else calibrate(net, model_dir, texts)

    tensors: dict[str, torch.Tensor] = {}
    quantized = {part: module for module, parts in groups.items() for part in parts}
    for name in source.names():
        base = name.removesuffix(".weight")
        if base not in quantized:
            tensors[name] = source.get(name)
    for module, parts in groups.items():
        tensors.update(_quantize_group(source, parts, amax.get(module), module, weights_only))

    out.mkdir(parents=True, exist_ok=True)
    save_safetensors_dir(tensors, out, max_shard_bytes=MAX_SHARD_BYTES)
    exclude_list = [*ALWAYS_EXCLUDED, *exclude, *excluded]
    _write_configs(out, hf_config, algo, exclude_list)
    for path in model_dir.iterdir():
        if path.is_file() and path.name not in _REWRITTEN and path.suffix != ".safetensors":
            shutil.copy2(path, out / path.name)
    logger.info("wrote %s (%s): %d linear layers quantized, excluded %s", out, algo,
                len(quantized), exclude_list)
    return out


def _linear_groups(net, source, patterns) -> tuple[dict[str, list[str]], list[str]]:
    """Our linear module -> the checkpoint modules it is made of, for those to quantize; and
    the linear modules left out because their input size is not a multiple of 16."""
    from pdserve.layers.linear import ReplicatedLinear
    from pdserve_kernels.nvfp4 import BLOCK

    modules = dict(net.named_modules())
    groups: dict[str, list[str]] = {}
    kept: dict[str, list[str]] = {}
    odd: list[str] = []
    for name in source.names():
        module_name, param, _ = net.checkpoint_target(name)
        if param != "weight" or not isinstance(modules.get(module_name), ReplicatedLinear):
            continue
        part = name.removesuffix(".weight")
        if source.shape(name)[1] % BLOCK:
            logger.warning("%s: %d inputs, not a multiple of %d; left unquantized", part,
                           source.shape(name)[1], BLOCK)
            odd.append(part)
        target = kept if part in odd or patterns.is_excluded(part) else groups
        target.setdefault(module_name, []).append(part)
    mixed = sorted(groups.keys() & kept.keys())
    if mixed:
        m = mixed[0]
        raise ValueError(f"{m} is one fused matmul in pdserve: quantize all of "
                         f"{sorted(groups[m] + kept[m])} or none (excluded: {sorted(kept[m])})")
    return groups, odd


def _quantize_group(source, parts: list[str], amax: float | None, module: str, weights_only: bool
                    ) -> dict[str, torch.Tensor]:
    """ModelOpt tensors of the checkpoint modules `parts`, fused in pdserve as `module`."""
    from pdserve.weights.nvfp4 import quantize_with_scale_2, weight_scale_2_from_amax

    weights = {part: source.get(f"{part}.weight") for part in parts}
    # one tensor scale for the fused matrix: ModelOpt's preprocess_linear_fusion does the same
    scale_2 = weight_scale_2_from_amax(max(w.abs().amax().float() for w in weights.values()))
    if not weights_only:
        if not amax:
            raise ValueError(f"{module} saw no input (or only zeros) during calibration")
        input_scale = input_scale_from_amax(amax)
    out: dict[str, torch.Tensor] = {}
    for part, w in weights.items():
        q = quantize_with_scale_2(w, scale_2)
        out[f"{part}.weight"] = q.weight
        out[f"{part}.weight_scale"] = q.weight_scale
        out[f"{part}.weight_scale_2"] = q.weight_scale_2.clone()
        if not weights_only:
            out[f"{part}.input_scale"] = input_scale.clone()
    return out


# ---- calibration ------------------------------------------------------------------------

def calibrate(net: torch.nn.Module, model_dir: Path, texts: Sequence[str | list[int]] | None = None
              ) -> dict[str, float]:
    """Largest |input| of every linear layer over the calibration texts (one sequence each)."""
    from pdserve.layers.linear import ReplicatedLinear

    sequences = _token_sequences(model_dir, texts)
    amax: dict[str, float] = {}

    def recorder(name: str):
        def hook(_module, args) -> None:
            amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
        return hook

    hooks = [m.register_forward_pre_hook(recorder(name)) for name, m in net.named_modules()
             if isinstance(m, ReplicatedLinear)]
    try:
        for ids in sequences:
            forward_tokens(net, ids)
    finally:
        for h in hooks:
            h.remove()
    logger.info("calibrated %d linear layers on %d sequences, %d tokens", len(amax), len(sequences),
                sum(map(len, sequences)))
    return amax


def _token_sequences(model_dir: Path, texts: Sequence[str | list[int]] | None) -> list[list[int]]:
    """Calibration sequences as token ids (the tokenizer is read only when there is text)."""
    if texts is not None and not any(isinstance(t, str) for t in texts):
        return [list(t) for t in texts if len(t)]
    from pdserve.tokenizer import Tokenizer
    from pdserve.weights.calibration import calibration_sequences

    tokenizer = Tokenizer(model_dir)
    texts = calibration_sequences(tokenizer) if texts is None else texts
    encoded = [tokenizer.encode(t) if isinstance(t, str) else list(t) for t in texts]
    return [ids for ids in encoded if ids]


def forward_tokens(net: torch.nn.Module, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Hidden states of one sequence run from position 0 through a fresh paged cache."""
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.sequence import Sequence as Seq
    from pdserve.kvcache import KVPool

    n_blocks = -(-len(ids) // block_size)
    pool = KVPool(net.cache_spec(torch.float32), n_blocks, block_size)
    seq = Seq("calibration", list(ids), SamplingParams())
    seq.block_table = list(range(n_blocks))
    with torch.inference_mode():
        tok, pos, meta = ModelRunner(net, pool).metadata([(seq, 0, len(ids))])
        return net(tok, pos, meta)


# ---- configs ----------------------------------------------------------------------------

def _write_configs(out: Path, hf_config: dict, algo: str, exclude: list[str]) -> None:
    """Both ModelOpt config forms: hf_quant_config.json and config.json quantization_config."""
    try:
        version = importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        version = "dev"
    producer = {"name": "pdserve", "version": version}
    (out / "hf_quant_config.json").write_text(json.dumps({
        "producer": producer,
        "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16,
                         "exclude_modules": exclude},
    }, indent=4) + "\n")
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    group = {"weights": fp4, "targets": ["Linear"]}
    if algo == "NVFP4":
        group = {"input_activations": fp4, **group}
    config = dict(hf_config)
    config["quantization_config"] = {"config_groups": {"group_0": group}, "ignore": exclude,
                                     "quant_algo": algo, "producer": producer,
                                     "quant_method": "modelopt"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---- command line -----------------------------------------------------------------------

def add_quantize_parser(subparsers) -> argparse.ArgumentParser:
    """`pdserve quantize --nvfp4 MODEL OUT [--calib-file F] [--exclude P]... [--weights-only]`."""
    q = subparsers.add_parser("quantize", help="write a ModelOpt-format NVFP4 checkpoint of a model",
                              description=__doc__.split("\n")[0])
    q.add_argument("--nvfp4", action="store_true", required=True,
                   help="the output format: NVIDIA ModelOpt NVFP4 (the only one for now)")
    q.add_argument("model", help="model directory (bf16/fp32), a .gguf file, or 'default'")
    q.add_argument("output", help="the new checkpoint directory (must not exist or be empty)")
    q.add_argument("--calib-file", default=None,
                   help="calibration text file; paragraphs (blank-line separated) run as separate "
                        "sequences (default: pdserve's built-in text)")
    q.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="module pattern to keep unquantized, fnmatch wildcards, e.g. "
                        "'model.layers.0.*' (repeatable; lm_head and embeddings always are)")
    q.add_argument("--weights-only", action="store_true",
                   help="W4A16_NVFP4: quantize weights only, no calibration or input_scale")
    q.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    q.set_defaults(func=cmd_quantize)
    return q


def cmd_quantize(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    texts = None
    if args.calib_file:
        raw = Path(args.calib_file).read_text(encoding="utf-8")
        texts = [p.strip() for p in raw.split("\n\n") if p.strip()]
    out = quantize_nvfp4(args.model, args.output, texts, args.exclude, args.weights_only)
    print(out)
    return 0
