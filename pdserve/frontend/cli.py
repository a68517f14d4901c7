"""`pdserve router`: its flags and entry point, and the flags `pdserve serve` shares with it.

``pdserve.cli`` registers it with ``add_router_parser(sub)``; `pdserve serve` is
``pdserve.launcher`` (which imports this module; nothing here imports the launcher).
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
    add_model_flags(p)
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
    add_http_flags(p)
    p.set_defaults(func=cmd_router)
    return p


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model directory or .gguf file (default: SmolLM2-135M-Instruct); the router "
                        "reads its tokenizer and chat template")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: SmolLM2-135M-Instruct for the default "
                        "model, else the --model value)")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME", type=_parser_name,
                   help="the output grammar (tool calls, reasoning) to parse instead of the one the "
                        "tokenizer, chat template and config.json imply: deepseek_v3 (deepseek_r1), "
                        "deepseek_v31, deepseek_v32, deepseek_v4, glm, hermes (qwen), plain")


def add_http_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port of the OpenAI API")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1/* "
                        "(default: $PDSERVE_API_KEY)")
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
    p.add_argument("--responses-store", type=_non_negative, default=1024, metavar="N",
                   help="keep the last N Responses API responses in memory, for previous_response_id and "
                        "GET /v1/responses/{id} (0: keep none; each router keeps its own)")
    add_admission_flags(p)


def add_admission_flags(p: argparse.ArgumentParser) -> None:
    """Liveness, admission and internal auth (docs/liveness.md)."""
    a = p.add_argument_group("liveness and admission (docs/liveness.md)")
    a.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="requests that may wait for room; one more gets 429 at once")
    a.add_argument("--queue-timeout", type=float, default=30.0, metavar="S",
                   help="how long a request waits for room before it gets 429 with Retry-After")
    a.add_argument("--worker-capacity", type=_positive, default=None, metavar="N",
                   help="requests (choices) queued + running per worker (default: 2 × its max_num_seqs)")
    a.add_argument("--max-running", type=_positive, default=None, metavar="N",
                   help="requests (choices) running router-wide (default: no bound beyond the workers')")
    a.add_argument("--routing", choices=("cache-aware", "least-loaded"), default="cache-aware",
                   help="which worker gets a request: cache-aware (default: the one most likely to hold "
                        "its prompt's prefix in its KV cache, unless it is much busier than another), or "
                        "least-loaded (docs/prefix-cache.md)")
    a.add_argument("--no-ask-caches", dest="ask_caches", action="store_false",
                   help="cache-aware routing without asking the workers what they hold of each prompt "
                        "(POST /cached_prefix, done where a role has two workers or more): only this "
                        "router's own record of what it sent where counts (docs/prefix-cache.md)")
    a.add_argument("--local-prefill-tokens", type=_non_negative, default=0, metavar="N",
                   help="PD: a request whose prompt the chosen decode worker holds but for at most N tokens "
                        "(as it answers POST /cached_prefix) goes to that decode worker alone, which computes the rest itself instead "
                        "of a prefill worker computing it and sending the KV (a later turn of a "
                        "conversation); 0 (default): every request goes through a prefill worker")
    a.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="fcfs (default: requests wait for room in arrival order, and a request's priority "
                        "other than 0 is a 400) or priority (vLLM's: lower priority values go first, in "
                        "the router's queue and on the workers)")
    a.add_argument("--slow-after", type=float, default=3.0, metavar="S",
                   help="a worker silent this long gets no new requests; those on it go on")
    a.add_argument("--dead-after", type=float, default=30.0, metavar="S",
                   help="a worker silent this long is dead: its requests fail (a refused port fails them at once)")
    a.add_argument("--retries", type=int, default=1, metavar="N",
                   help="run a request again on another worker (or the restarted one) when its worker "
                        "dies or refuses it: from the start, or from its last token when its sampling "
                        "allows; up to N times (0: never)")
    a.add_argument("--internal-token", default=None, metavar="TOKEN",
                   help="shared secret of the workers' internal API, sent on every call to them "
                        "(default: $PDSERVE_INTERNAL_TOKEN)")


def _name_port(text: str) -> str:
    from pdserve.frontend.discovery import parse_target
    from pdserve.worker_api import Role

    try:
        return parse_target(Role.BOTH, text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parser_names() -> list[str]:
    from pdserve.parsers import PARSER_NAMES

    return sorted(PARSER_NAMES)


def _parser_name(text: str) -> str:
    """A --tool-call-parser name as resolve_profile reads it (case, `-` and `.` are forgiven)."""
    from pdserve.parsers import PARSER_NAMES

    if text.strip().lower().replace("-", "_").replace(".", "") not in PARSER_NAMES:
        raise argparse.ArgumentTypeError(f"unknown tool-call parser {text!r}; one of {', '.join(_parser_names())}")
    return text


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


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
                        drain_timeout_s=args.drain_timeout,
                        tool_call_parser=getattr(args, "tool_call_parser", None),
                        max_queue=args.max_queue, queue_timeout_s=args.queue_timeout,
                        worker_capacity=args.worker_capacity, max_running=args.max_running,
                        routing=getattr(args, "routing", "cache-aware"), ask_caches=getattr(args, "ask_caches", True),
                        local_prefill_tokens=getattr(args, "local_prefill_tokens", 0),
                        scheduling_policy=args.scheduling_policy,
                        slow_after_s=args.slow_after, dead_after_s=args.dead_after,
                        retries=args.retries, internal_token=internal_token(args),
                        responses_store=args.responses_store)


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


def internal_token(args: argparse.Namespace) -> str | None:
    """--internal-token, else $PDSERVE_INTERNAL_TOKEN; None: the workers' API is open."""
    return getattr(args, "internal_token", None) or os.environ.get("PDSERVE_INTERNAL_TOKEN", "").strip() or None


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
