"""Linear layers, embeddings and the LM head on GGUF blocks: what each TP rank loads, that the
shards multiply to the whole, on-load quantization, and the errors for impossible splits."""
from __future__ import annotations

import pytest
import torch

from pdserve.distributed import TPGroup
from pdserve.layers.embedding import Embedding, LMHead, use_block_formats
from pdserve.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from pdserve.layers.quant import QuantConfigError
from pdserve.layers.quant.blocks import BlockQuantLinearMethod
from pdserve.weights import WeightSource, save_safetensors_dir
from pdserve.weights.quantization import BlockQuantConfig
from pdserve_kernels.quant import FORMATS, Q4_1, Q8_0, dequantize, qmatmul_torch, quantize


@pytest.fixture
def checkpoint(tmp_path):
    """Float weights, and the same weights as Q4_1 blocks (a converted GGUF's gguf/ folder)."""
    g = torch.Generator().manual_seed(0)
    dense = {"up.weight": torch.randn(40, 128, generator=g), "down.weight": torch.randn(24, 128, generator=g),
             "gate.weight": torch.randn(40, 128, generator=g)}
    save_safetensors_dir(dense, tmp_path / "float")
    save_safetensors_dir({k: quantize(v, Q4_1) for k, v in dense.items()}, tmp_path / "blocks")
    return dense, WeightSource(tmp_path / "float"), WeightSource(tmp_path / "blocks")


@pytest.mark.parametrize("rank", [0, 1])
def test_column_parallel_rank_loads_its_rows_of_blocks(checkpoint, rank):
    dense, _, blocks = checkpoint
    layer = ColumnParallelLinear(128, 40, tp=TPGroup(rank, 2), method=BlockQuantLinearMethod(Q4_1))
    layer.load("weight", blocks, "up.weight")
    whole = quantize(dense["up.weight"], Q4_1)
    assert torch.equal(layer.weight, whole[rank * 20:(rank + 1) * 20])
    x = torch.randn(3, 128)
    assert torch.allclose(layer(x), qmatmul_torch(x, whole, Q4_1)[:, rank * 20:(rank + 1) * 20], atol=1e-4)


def test_row_parallel_shards_sum_to_the_whole_product(checkpoint):
    dense, _, blocks = checkpoint
    whole = quantize(dense["down.weight"], Q4_1)
    x = torch.randn(5, 128)
    parts = []
    for rank in (0, 1):
        layer = RowParallelLinear(128, 24, tp=TPGroup(rank, 2), method=BlockQuantLinearMethod(Q4_1),
                                  reduce=False)  # the sum below stands for the all_reduce
        layer.load("weight", blocks, "down.weight")
        assert torch.equal(layer.weight, whole[:, rank * 2 * 20:(rank + 1) * 2 * 20])  # 2 blocks of 20 B
        parts.append(layer(x[:, rank * 64:(rank + 1) * 64]))
    assert torch.allclose(parts[0] + parts[1], qmatmul_torch(x, whole, Q4_1), atol=1e-4)


def test_row_split_off_block_boundaries_is_a_clear_error():
    with pytest.raises(QuantConfigError, match=r"48 input features .* not a multiple of the Q4_1 block \(32\)"):
        RowParallelLinear(96, 8, tp=TPGroup(0, 2), method=BlockQuantLinearMethod(Q4_1, name="down"))


def test_merged_gate_up_on_load_equals_quantizing_each_part(checkpoint):
    dense, floats, _ = checkpoint
    layer = MergedColumnParallelLinear(128, [40, 40], method=BlockQuantLinearMethod(Q8_0, on_load=True))
    layer.load("weight", floats, "gate.weight", 0)
    layer.load("weight", floats, "up.weight", 1)
    expected = torch.cat([quantize(dense["gate.weight"], Q8_0), quantize(dense["up.weight"], Q8_0)])
    assert torch.equal(layer.weight, expected)


def test_a_float_tensor_in_a_block_layer_is_named(checkpoint):
    _, floats, _ = checkpoint
    layer = ColumnParallelLinear(128, 40, method=BlockQuantLinearMethod(Q4_1))
    with pytest.raises(QuantConfigError, match=r"up.weight is torch.float32, not Q4_1 blocks"):
        layer.load("weight", floats, "up.weight")


def test_fused_parts_in_different_formats_are_a_clear_error():
    config = BlockQuantConfig("GGUF", "quant.json", {"a.q.weight": Q4_1, "a.k.weight": Q8_0})
    with pytest.raises(QuantConfigError, match="must share one block format"):
        config.linear_method(["a.q", "a.k"])
    assert config.linear_method(["a.norm"]) is None  # a float tensor stays a plain layer


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_embedding_dequantizes_only_the_rows_it_looks_up_and_tied_head_multiplies_blocks(tmp_path, fmt_name):
    fmt = FORMATS[fmt_name]
    table = torch.randn(50, 64)
    save_safetensors_dir({"model.embed_tokens.weight": quantize(table, fmt)}, tmp_path)
    emb = Embedding(50, 64)
    head = LMHead(50, 64, tied_to=emb)
    model = torch.nn.ModuleDict({"model": torch.nn.ModuleDict({"embed_tokens": emb}), "lm_head": head})
    use_block_formats(model, BlockQuantConfig("GGUF", "test", {"model.embed_tokens.weight": fmt}))
    emb.load("weight", WeightSource(tmp_path), "model.embed_tokens.weight")
    assert emb.weight.dtype == torch.uint8 and emb.weight.shape == (50, fmt.row_bytes(64))
    ids = torch.tensor([3, 0, 49, 3])
    rows = emb(ids)
    assert rows.dtype == torch.float32 and torch.equal(rows, dequantize(quantize(table, fmt), fmt)[ids])
    hidden = torch.randn(2, 64)
    assert torch.allclose(head(hidden), qmatmul_torch(hidden, emb.weight, fmt), atol=1e-4)


@pytest.fixture
def native_ops(restore_ops):
    """The op API bound as a worker on this CPU binds it (--kernels auto), then put back."""
    import pdserve_kernels as ops

    ops.configure("cpu", torch.float32, "auto")


@pytest.mark.parametrize("int16", ["1", "0"])
def test_a_q8_head_multiplies_int16_activations_where_the_q4_layers_do(monkeypatch, native_ops, int16):
    """On AVX-512 (unless $PDSERVE_INT16_ACTIVATIONS=0) a loaded Q8_0 head packs its blocks and
    multiplies int16-rounded activations (the packed kernel's
    reference: rounding, then the blocks' product; bound as in tests/kernels); elsewhere it keeps
    the fp32 path."""
    from pdserve_kernels import cpu_lib
    from pdserve_kernels.quant import qmatmul_packed_reference

    monkeypatch.setenv("PDSERVE_INT16_ACTIVATIONS", int16)
    head = LMHead(35, 96)
    head.use_blocks(Q8_0, on_load=False)
    head.weight.data.copy_(quantize(torch.randn(35, 96), Q8_0))
    head.finish()
    hidden = torch.randn(5, 96)
    if int16 == "1" and cpu_lib.int16_activations():
        assert head.packed is not None
        expected = qmatmul_packed_reference(hidden, head.weight, Q8_0, head.packed)
        assert ((head(hidden) - expected).abs() <= 1e-5 * (hidden.abs() @ dequantize(head.weight, Q8_0).abs().T)).all()
    else:
        assert head.packed is None
        assert torch.allclose(head(hidden), qmatmul_torch(hidden, head.weight, Q8_0), atol=1e-4)


def test_untied_head_quantized_on_load_reads_its_vocab_slice(tmp_path):
    head_w = torch.randn(50, 64)
    save_safetensors_dir({"lm_head.weight": head_w}, tmp_path)
    head = LMHead(50, 64, tp=TPGroup(1, 2))
    head.use_blocks(Q8_0, on_load=True)
    head.load("weight", WeightSource(tmp_path), "lm_head.weight")
    assert torch.equal(head.weight, quantize(head_w[25:50], Q8_0))
