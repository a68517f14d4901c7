"""The op API picks its backend by device and availability, says why, and obeys --kernels."""
from __future__ import annotations

import pytest
import torch

import pdserve_kernels as ops
from pdserve_kernels import Backend, KernelsUnavailable, attention, attention_cpu, cpu_lib, cuda_lib, dispatch


@pytest.fixture(autouse=True)
def _restore():
    """Each test configures the process-wide choice; put back the unconfigured state."""
    yield
    for op in dispatch.OPS.values():
        op.impl = None
    dispatch._current = None


def test_torch_is_chosen_when_asked_and_binds_every_op_to_its_reference():
    sel = ops.configure("cpu", torch.float32, "torch")
    assert sel.backend is Backend.TORCH and sel.reason == "--kernels torch"
    assert ops.backend_name() == "torch"
    assert ops.paged_attention.impl is attention.paged_attention
    assert ops.store_kv.impl is attention.store_kv


def test_auto_on_cpu_takes_the_native_cpu_kernels_when_built():
    avail = cpu_lib.availability()
    assert avail, f"make setup builds the native CPU kernels: {avail.reason}"
    sel = ops.configure("cpu", torch.float32, "auto")
    assert sel.backend is Backend.NATIVE
    assert sel.native_ops == ("attention_block", "fused_layers", "mlp_block", "paged_attention",
                              "qmatmul", "qmatmul_packed", "rms_norm")
    assert sel.torch_ops == ("store_kv",)
    assert ops.qmatmul.impl is dispatch.OPS["qmatmul"].native["cpu"]
    assert ops.paged_attention.impl is attention_cpu.paged_attention_cpu
    assert "native on cpu" in sel.describe()


def test_auto_on_cuda_without_a_usable_library_falls_back_to_torch_and_says_why():
    avail = cuda_lib.available()
    assert not avail  # no GPU on the machines that run the test suite
    sel = ops.select("cuda", torch.bfloat16, "auto")
    assert sel.backend is Backend.TORCH
    assert sel.reason == f"auto: native unavailable: {avail.reason}"


def test_native_forced_where_it_cannot_run_is_a_clear_error():
    with pytest.raises(KernelsUnavailable,
                       match=r"--kernels native: the native cuda kernels cannot run here: "):
        ops.configure("cuda", torch.bfloat16, "native")
    with pytest.raises(KernelsUnavailable, match="no native kernels for device type 'meta'"):
        ops.select("meta", torch.float32, "native")
    assert ops.current() is None  # a refused choice changes nothing


def test_an_unknown_backend_name_is_refused():
    with pytest.raises(ValueError, match="unknown kernels backend 'cuda'; choose one of auto, torch, native"):
        ops.select("cpu", torch.float32, "cuda")


def test_an_op_registered_after_the_choice_follows_it():
    def ref(x):
        return x + 1

    def native(x):
        return x + 2

    try:
        ops.configure("cpu", torch.float32, "torch")
        op = ops.register("test_late_op", ref, cpu=native)
        assert op(1) == 2
        ops.configure("meta", torch.float32, "auto")  # no library for meta: torch
        assert op(1) == 2
    finally:
        dispatch.OPS.pop("test_late_op")


def test_engine_refuses_native_kernels_it_cannot_run_before_loading_anything():
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    with pytest.raises(KernelsUnavailable, match="native cuda kernels cannot run here"):
        LLMEngine(EngineConfig(model="/nonexistent/model", device="cuda", kernels="native", threads=1))


def test_kernels_flag_reaches_the_engine_config_and_serve_passes_it_on():
    from pdserve.cli import build_parser, engine_config
    from pdserve.launcher import engine_flags

    args = build_parser().parse_args(["generate", "hi", "--kernels", "torch"])
    assert engine_config(args).kernels == "torch"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--kernels", "fast"])
    serve = build_parser().parse_args(["serve", "--kernels", "native"])
    assert engine_flags(serve)[-2:] == ["--kernels", "native"]


def test_the_cuda_attention_variant_runs_the_reference_for_what_its_kernels_cannot_take(caplog):
    from pdserve_kernels import attention_cuda

    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(4, 16, 2, 48), torch.randn(4, 16, 2, 48)  # head_dim 48, CPU
    q = torch.randn(2, 4, 48)
    tables = torch.tensor([[0, 1], [2, 3]])
    with caplog.at_level("WARNING"):
        got = attention_cuda.paged_attention_cuda(q, k_cache, v_cache, [0, 1, 2], [20, 7], tables, 0.2)
    want = attention.paged_attention(q, k_cache, v_cache, [0, 1, 2], [20, 7], tables, 0.2)
    assert torch.equal(got, want)
    assert "head_dim 48 / torch.float32 not supported" in caplog.text
