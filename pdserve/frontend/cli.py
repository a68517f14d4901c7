"""`pdserve router` and `pdserve serve`: their flags and entry points.

``pdserve.cli`` registers both with ``add_router_parser(sub)`` and ``add_serve_parser(sub)``.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from pdserve.frontend.config import RouterConfig, served_name

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
    e.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every worker command line (repeatable), "
                        "e.g. --worker-arg=--health-stall-timeout=30")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds to wait for the workers to be ready")
    p.set_defaults(func=cmd_serve)
    return p


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
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--stream-batch", type=_positive, default=1, metavar="N",
                   help="send up to N tokens per SSE event (the first token always goes alone)")
    p.add_argument("--max-request-bytes", type=int, default=8 << 20, help="larger bodies get 413")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the smallest the workers report)")


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
                        api_key=args.api_key, stream_batch=args.stream_batch,
                        max_request_bytes=args.max_request_bytes, max_model_len=args.max_model_len)


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
    import uvicorn

    quiet_http_logs()

    from pdserve.frontend.app import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(config), host=host, port=port, access_log=False,
                                           log_level="warning", timeout_graceful_shutdown=5))
    server.run()
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    if not args.worker and not (args.prefill and args.decode):
        raise SystemExit("give --prefill URL and --decode URL, or --worker URL for colocated workers")
    config = router_config(args, resolve_model_dir(args.model), args.prefill, args.decode, args.worker)
    logger.info("router on http://%s:%d/v1 for %s", args.host, args.port, config.served_model_name)
    return run_router(config, args.host, args.port)


def cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.launcher import serve

    return serve(args)
