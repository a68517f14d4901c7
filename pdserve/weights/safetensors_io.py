"""Read and write Hugging Face safetensors model directories.

A model directory holds either one ``model.safetensors`` or several shards listed by
``model.safetensors.index.json``. ``WeightSource`` hides the difference and reads lazily, so a
tensor-parallel rank can read only the slice of a weight it owns (``get_slice``).
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class MissingWeightError(KeyError):
    """A tensor the model asked for is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class WeightSource:
    """Lazy, name-addressed access to the tensors of one model directory."""

    def __init__(self, model_dir: str | os.PathLike[str]) -> None:
        self.model_dir = Path(model_dir)
        self._file_of: dict[str, Path] = _index_tensors(self.model_dir)
        self._handles: dict[Path, object] = {}

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def __contains__(self, name: object) -> bool:
        return name in self._file_of

    def __len__(self) -> int:
        return len(self._file_of)

    def file_of(self, name: str) -> Path:
        """The shard that stores ``name`` (raises MissingWeightError naming the directory)."""
        try:
            return self._file_of[name]
        except KeyError:
            where = INDEX_FILE if (self.model_dir / INDEX_FILE).exists() else SINGLE_FILE
            raise MissingWeightError(
                f"tensor {name!r} not found in {self.model_dir / where} "
                f"({len(self._file_of)} tensors present)"
            ) from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.file_of(name)).get_slice(name).get_shape())

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        tensor = self._open(self.file_of(name)).get_tensor(name)
        return tensor if dtype is None else tensor.to(dtype)

    def get_slice(
        self,
        name: str,
        dim: int,
        start: int,
        stop: int,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Rows ``start:stop`` along ``dim``, reading only those bytes from disk."""
        view = self._open(self.file_of(name)).get_slice(name)
        ndim = len(view.get_shape())
        if not -ndim <= dim < ndim:
            raise IndexError(f"dim {dim} out of range for {name!r} of rank {ndim}")
        index = [slice(None)] * ndim
        index[dim % ndim] = slice(start, stop)
        tensor = view[tuple(index)]
        return tensor if dtype is None else tensor.to(dtype)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names():
            yield name, self.get(name)

    def _open(self, path: Path):  # -> safetensors safe_open handle
        handle = self._handles.get(path)
        if handle is None:
            handle = safe_open(str(path), framework="pt", device="cpu")
            self._handles[path] = handle
        return handle


def _index_tensors(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the file that holds it."""
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        missing = sorted({f for f in weight_map.values() if not (model_dir / f).exists()})
        if missing:
            raise FileNotFoundError(f"{index_path} lists shards that do not exist: {missing}")
        return {name: model_dir / shard for name, shard in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if single.exists():
        with safe_open(str(single), framework="pt", device="cpu") as f:
            return {name: single for name in f.keys()}
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")


def save_safetensors_dir(
    tensors: Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike[str],
    max_shard_bytes: int | None = None,
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Write ``tensors`` as one file, or as shards plus an index when over ``max_shard_bytes``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", **(metadata or {})}
    shards = _plan_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        path = out / SINGLE_FILE
        save_file(_contiguous(tensors, shards[0]), str(path), metadata=meta)
        return [path]
    paths: list[Path] = []
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(_contiguous(tensors, names), str(out / fname), metadata=meta)
        weight_map.update({name: fname for name in names})
        paths.append(out / fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    logger.info("wrote %d shards to %s", len(paths), out)
    return paths


def _plan_shards(tensors: Mapping[str, torch.Tensor], max_bytes: int | None) -> list[list[str]]:
    if max_bytes is None:
        return [list(tensors)]
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _contiguous(tensors: Mapping[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    return {name: tensors[name].contiguous() for name in names}
