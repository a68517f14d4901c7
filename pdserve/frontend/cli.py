"""`pdserve router` and `pdserve serve`: their flags and entry points.

``pdserve.cli`` registers both with ``add_router_parser(sub)`` and ``add_serve_parser(sub)``.
"""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from pdserve.frontend.config import RouterConfig
from pdserve.logs import setup_logging
from pdserve.model_name import served_name

logger = logging.getLogger(__name__)


def add_router_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("router", help="the OpenAI-compatible router in front of running workers",
                              description="Serve the OpenAI API, routing each request to a prefill and "
                                          "a decode worker (or a colocated one).")
    _model_flags(p)
    p.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                   help="prefill worker URL(s), e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL",
                   help="decode worker URL(s)")
    p.add_argument("--worker", nargs="+", action="extend", default=[], metavar="URL",
                   help="colocated worker URL(s) (role both: prefill and decode in one)")
    d = p.add_argument_group("discovery (instead of, or besides, worker URLs)")
    for flag, what in (("prefill", "prefill workers"), ("decode", "decode workers"),
                       ("worker", "colocated workers")):
        d.add_argument(f"--discover-{flag}", action="append", default=[], metavar="NAME:PORT", type=_name_port,
                       help=f"the {what} are the DNS A records of NAME (a headless Service), at "
                            "PORT; re-resolved every --discover-interval seconds (repeatable)")
    d.add_argument("--discover-interval", type=float, default=5.0, metavar="S",
                   help="seconds between two resolutions of the --discover-* names")
    _http_flags(p)
    p.set_defaults(func=cmd_router)
    return p


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="router + one prefill and one decode worker on this machine",
                              description="Start the workers as child processes, wait until they are "
                                          "ready, then serve the OpenAI API.")
    _model_flags(p)
    _http_flags(p)
    p.add_argument("--mode", choices=("pd", "colocated"), default="pd",
                   help="pd: a prefill and a decode worker with KV transfer; colocated: one worker")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks per worker")
    e = p.add_argument_group("engine flags (passed on to the workers)")
    e.add_argument("--dtype", default=None, help="auto | float32 | bfloat16 | float16")
    e.add_argument("--device", default=None, help="cpu or cuda[:N]")
    e.add_argument("--block-size", type=int, default=None, help="tokens per KV block")
    e.add_argument("--kv-cache-memory", default=None, help="KV pool size per worker, e.g. 256MiB")
    e.add_argument("--max-num-seqs", type=int, default=None, help="most requests running at once")
    e.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    e.add_argument("--threads", type=int, default=1, help="torch CPU threads per worker")
    e.add_argument("--index-cache-dtype", default=None, choices=["bfloat16", "fp8", "float32"],
                   help="DSA index keys in the KV cache (DeepSeek-V3.2/GLM-5; default bfloat16)")
    e.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every worker command line (repeatable), "
                        "e.g. --worker-arg=--health-stall-timeout=30")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds to wait for the workers to be ready")
    for flag in MULTI_NODE_FLAGS:
        p.add_argument(flag, action=_WorkersOnly, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_serve)
    return p


MULTI_NODE_FLAGS = ("--nnodes", "--node-rank", "--dist-init-addr")


class _WorkersOnly(argparse.Action):
    """A multi-node flag given to `serve`: refused with a message that says where it belongs."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is a flag of `pdserve prefill | decode | worker`: `pdserve serve` runs "
                     "every worker on this machine; start each node of a multi-node TP group with those "
                     "commands (README: Tensor parallelism, Several machines)")


def _model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model directory or .gguf file (default: SmolLM2-135M-Instruct); the router "
                        "reads its tokenizer and chat template")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: SmolLM2-135M-Instruct for the default "
                        "model, else the --model value)")


def _http_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port of the OpenAI API")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $PDSERVE_API_KEY)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="read the API key from FILE (e.g. a mounted Secret) instead")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM: refuse new requests (503), give those in flight S seconds to "
                        "finish, then stop the rest with an error and exit")
    p.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    p.add_argument("--stream-batch", type=_positive, default=1, metavar="N",
                   help="send up to N tokens per SSE event (the first token always goes alone)")
    p.add_argument("--max-request-bytes", type=int, default=8 << 20, help="larger bodies get 413")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the smallest the workers report)")


def _name_port(text: str) -> str:
    from pdserve.frontend.discovery import parse_target
    from pdserve.frontend.workers import Role

    try:
        return parse_target(Role.BOTH, text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def router_config(args: argparse.Namespace, model_dir: Path, prefill: list[str], decode: list[str],
                  both: list[str]) -> RouterConfig:
    name, aliases = served_name(args.model, args.served_model_name)
    return RouterConfig(model_dir=model_dir, served_model_name=name, aliases=aliases,
                        prefill_urls=prefill, decode_urls=decode, worker_urls=both,
                        discover_prefill=getattr(args, "discover_prefill", []),
                        discover_decode=getattr(args, "discover_decode", []),
                        discover_worker=getattr(args, "discover_worker", []),
                        discover_interval_s=getattr(args, "discover_interval", 5.0),
                        api_key=api_key(args), stream_batch=args.stream_batch,
                        max_request_bytes=args.max_request_bytes, max_model_len=args.max_model_len,
                        drain_timeout_s=args.drain_timeout)


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else the first line of --api-key-file, else $PDSERVE_API_KEY; None: no key."""
    if args.api_key:
        return str(args.api_key)
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise SystemExit(f"--api-key-file: cannot read {args.api_key_file}: {e.strerror}") from None
        if not key:
            raise SystemExit(f"--api-key-file: {args.api_key_file} is empty")
        return key
    return os.environ.get("PDSERVE_API_KEY", "").strip() or None


def resolve_model_dir(model: str | None) -> Path:
    """A model directory as is; the default model or a .gguf through the converter (once)."""
    if model and Path(model).is_dir():
        return Path(model)
    from pdserve.weights import resolve_model_path  # converts on first use (imports torch)

    return resolve_model_path(model)


def quiet_http_logs() -> None:
    """httpx logs every request at INFO: one line per health probe, twice a second per worker."""
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def run_router(config: RouterConfig, host: str, port: int) -> int:
    quiet_http_logs()

    from pdserve.frontend.app import create_app
    from pdserve.frontend.server import RouterServer

    from pdserve.parsers import ProfileError

    try:
        app = create_app(config)
    except ProfileError as e:  # the tokenizer cannot carry the model's output grammar
        raise SystemExit(f"pdserve: {e}") from None
    RouterServer(app, host, port).run()
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    setup_logging(args.log_json, "router")
    if not (args.worker or args.discover_worker) and not (
            (args.prefill or args.discover_prefill) and (args.decode or args.discover_decode)):
        raise SystemExit("give prefill and decode workers (--prefill/--decode URL or --discover-prefill/"
                         "--discover-decode NAME:PORT), or colocated ones (--worker, --discover-worker)")
    config = router_config(args, resolve_model_dir(args.model), args.prefill, args.decode, args.worker)
    logger.info("router on http://%s:%d/v1 for %s", args.host, args.port, config.served_model_name)
    return run_router(config, args.host, args.port)


def cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.launcher import serve

    return serve(args)
