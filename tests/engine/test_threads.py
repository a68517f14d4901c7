"""Threads per process: the cores are divided, never oversubscribed, except that PD's prefill and
decode worker on the native kernels each get every core; --threads overrides."""
from __future__ import annotations

import argparse
import os

import pytest
import torch

from pdserve_kernels import cpu_lib

from pdserve.engine.threads import apply_threads, cpu_cores, default_threads, serve_threads, split_threads


def test_a_worker_alone_uses_every_core_split_between_its_ranks():
    assert split_threads(8, 1).per_process == 8
    assert split_threads(8, 2).per_process == 4
    assert split_threads(8, 3).per_process == 2  # 6 of 8: never more than the cores


def test_serve_divides_the_cores_between_its_workers():
    assert serve_threads("colocated", tp=1, cores=2).per_process == 2
    assert serve_threads("colocated", tp=2, cores=2).per_process == 1
    assert serve_threads("pd", tp=1, cores=2, native=False).per_process == 1   # torch: prefill 1 + decode 1
    assert serve_threads("pd", tp=2, cores=16, native=False).per_process == 4  # 4 rank processes


def test_pd_workers_on_the_native_kernels_each_get_every_core():
    shared = serve_threads("pd", tp=1, cores=2)
    assert (shared.per_process, shared.processes, shared.shared) == (2, 2, True)
    assert not shared.oversubscribed and "sharing 2 core(s)" in shared.describe()
    assert serve_threads("pd", tp=1, cores=16).per_process == 16
    assert serve_threads("pd", tp=2, cores=16).per_process == 8   # each worker's 2 ranks split them


def test_more_processes_than_cores_get_one_thread_each():
    plan = serve_threads("pd", tp=2, cores=2, native=False)
    assert plan.per_process == 1 and plan.processes == 4 and plan.oversubscribed


@pytest.fixture
def restore_threads(restore_ops):
    """Put back what an engine sets for the whole process: the thread counts (and the op binding)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    cpu_lib.set_threads(None)


def test_apply_threads_sets_torch_and_the_native_kernels(restore_threads):
    apply_threads(1)
    assert (torch.get_num_threads(), cpu_lib.num_threads()) == (1, 1)
    apply_threads(2, torch_threads=1)
    assert (torch.get_num_threads(), cpu_lib.num_threads()) == (1, 2)


def _engine_threads(model_dir: str, **config) -> tuple[int, int, bool]:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.models import multiplies_natively

    engine = LLMEngine(EngineConfig(model=model_dir, threads=2, kv_cache_memory=8 << 20, **config))
    try:
        return torch.get_num_threads(), cpu_lib.num_threads(), multiplies_natively(engine.model)
    finally:
        engine.close()


@pytest.mark.skipif(not cpu_lib.availability(), reason="the native CPU kernels do not run here")
@pytest.mark.parametrize("int16", ["1", "0"])
def test_torch_keeps_one_thread_where_every_matmul_is_native(default_model_dir, restore_threads, monkeypatch,
                                                             int16):
    # the default model's Q4_1 layers and Q8_0 head multiply in the native kernels, packed for
    # the int16 kernel (AVX-512) or not (AVX2, or int16 turned off): torch's team would only spin
    monkeypatch.setenv("PDSERVE_INT16_ACTIVATIONS", int16)
    assert _engine_threads(default_model_dir, quantization="auto", kernels="native") == (1, 2, True)


@pytest.mark.parametrize("config", [dict(quantization="auto", kernels="torch"),      # torch's matmuls
                                    dict(quantization="none", kernels="native")])   # fp32 linears
def test_torch_keeps_every_thread_where_it_multiplies(default_model_dir, restore_threads, config):
    assert _engine_threads(default_model_dir, **config) == (2, 2, False)


def test_the_command_line_default_is_the_cores_share_and_an_explicit_count_wins():
    from pdserve.cli import build_parser, engine_config

    assert default_threads(1) == cpu_cores() == len(os.sched_getaffinity(0))
    alone = build_parser().parse_args(["generate", "hi"])
    assert engine_config(alone).threads == cpu_cores()
    ranks = build_parser().parse_args(["worker", "--tp", "2"])
    assert engine_config(ranks).threads == max(1, cpu_cores() // 2)
    given = build_parser().parse_args(["worker", "--tp", "2", "--threads", "3"])
    assert engine_config(given).threads == 3


def test_a_library_user_without_a_count_keeps_torch_setting():
    from pdserve.engine.config import EngineConfig

    assert EngineConfig().threads == 0  # LLMEngine leaves torch.set_num_threads alone for 0


def test_serve_fills_in_threads_only_when_not_given():
    from pdserve.launcher import plan_threads

    auto = argparse.Namespace(mode="pd", tp=None, threads=None)
    plan_threads(auto)
    assert auto.threads == cpu_cores()
    split = argparse.Namespace(mode="pd", tp=None, threads=None, kernels="torch")
    plan_threads(split)
    assert split.threads == max(1, cpu_cores() // 2)
    given = argparse.Namespace(mode="pd", tp=None, threads=3)
    plan_threads(given)
    assert given.threads == 3


def test_an_impossible_split_is_refused():
    with pytest.raises(ValueError, match="need at least one core and one process"):
        split_threads(0, 1)


def test_serve_divides_the_cores_between_all_its_workers():
    assert serve_threads("pd", tp=1, cores=16, workers=4).per_process == 4   # 2 prefill + 2 decode
    assert serve_threads("colocated", tp=2, cores=16, workers=2).per_process == 4
    many = serve_threads("pd", tp=1, cores=2, workers=3)  # more processes than cores: one thread each
    assert many.per_process == 1 and many.oversubscribed
    assert not serve_threads("pd", tp=1, cores=2).oversubscribed


def test_serve_plans_threads_for_the_worker_counts_it_is_given():
    from pdserve.launcher import StartupError, plan_threads

    cores = cpu_cores()
    args = argparse.Namespace(mode="colocated", tp=None, threads=None, workers=2)
    plan_threads(args)
    assert args.threads == max(1, cores // 2)
    args = argparse.Namespace(mode="pd", tp=None, threads=None, prefill_workers=2, decode_workers=1)
    plan_threads(args)
    assert args.threads == max(1, cores // 3)
    with pytest.raises(StartupError, match="--workers does not apply to --mode pd"):
        plan_threads(argparse.Namespace(mode="pd", tp=None, threads=None, workers=2))
