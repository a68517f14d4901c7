"""WeightSource over single-file and sharded safetensors directories."""
from __future__ import annotations

import json

import pytest
import torch

from pdserve.weights import MissingWeightError, WeightSource, save_safetensors_dir


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(50, 8),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(12, 8),
        "model.layers.0.mlp.down_proj.weight": torch.randn(8, 16),
        "model.norm.weight": torch.randn(8),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(6, 8).to(torch.bfloat16),
    }


@pytest.fixture(params=["single", "sharded"])
def model_dir(request, tmp_path):
    max_shard = None if request.param == "single" else 600  # bytes: forces several shards
    files = save_safetensors_dir(_tensors(), tmp_path, max_shard_bytes=max_shard)
    assert (len(files) == 1) == (request.param == "single")
    return tmp_path


def test_sharded_directory_has_an_index_listing_every_tensor(tmp_path):
    files = save_safetensors_dir(_tensors(), tmp_path, max_shard_bytes=600)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(files) > 2
    assert set(index["weight_map"]) == set(_tensors())
    assert not (tmp_path / "model.safetensors").exists()


def test_names_and_get_return_every_tensor(model_dir):
    source = WeightSource(model_dir)
    assert source.names() == sorted(_tensors())
    for name, expected in _tensors().items():
        got = source.get(name)
        assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_get_converts_dtype(model_dir):
    got = WeightSource(model_dir).get("model.layers.0.self_attn.k_proj.weight", dtype=torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, _tensors()["model.layers.0.self_attn.k_proj.weight"].float())


@pytest.mark.parametrize(
    ("name", "dim", "start", "stop"),
    [
        ("model.embed_tokens.weight", 0, 10, 35),
        ("model.layers.0.self_attn.q_proj.weight", 0, 4, 8),
        ("model.layers.0.mlp.down_proj.weight", 1, 8, 16),
        ("model.layers.0.mlp.down_proj.weight", -1, 0, 8),
        ("model.norm.weight", 0, 2, 6),
    ],
)
def test_get_slice_equals_slicing_the_full_tensor(model_dir, name, dim, start, stop):
    full = _tensors()[name]
    got = WeightSource(model_dir).get_slice(name, dim, start, stop)
    assert torch.equal(got, full.narrow(dim, start, stop - start))


def test_get_slice_converts_dtype(model_dir):
    name = "model.layers.0.self_attn.k_proj.weight"
    got = WeightSource(model_dir).get_slice(name, 0, 2, 4, dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, _tensors()[name][2:4].float())


def test_iteration_yields_name_tensor_pairs(model_dir):
    pairs = dict(iter(WeightSource(model_dir)))
    assert pairs.keys() == _tensors().keys()


def test_missing_tensor_error_names_the_file(model_dir):
    source = WeightSource(model_dir)
    index = model_dir / "model.safetensors.index.json"
    expected_file = index.name if index.exists() else "model.safetensors"
    with pytest.raises(MissingWeightError, match=expected_file) as info:
        source.get("model.layers.7.mlp.up_proj.weight")
    assert "model.layers.7.mlp.up_proj.weight" in str(info.value)
    with pytest.raises(KeyError):  # MissingWeightError is a KeyError for `in`-style callers
        source.get_slice("nope", 0, 0, 1)


def test_directory_without_weights_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        WeightSource(tmp_path)


def test_index_pointing_at_a_missing_shard_is_a_clear_error(tmp_path):
    save_safetensors_dir(_tensors(), tmp_path, max_shard_bytes=600)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        WeightSource(tmp_path)
