"""Build, cache and load libpdserve_cpu.so (csrc/cpu/: quantized matmuls, AVX2 and AVX-512 VNNI,
and the packed int16-activation product, AVX-512 VNNI; paged decode attention, fused residual add + RMSNorm,
RoPE and SwiGLU, AVX2; paged extend attention (several new tokens per sequence over the cache),
AVX2 and AVX-512; the fused blocks of a decoder layer).

`make setup` builds it (`python -m pdserve_kernels.cpu_lib`); a process that finds no build for
the current sources builds it on first use (seconds, the system C++ compiler, nothing fetched).
The library is cached under a hash of the sources, the flags and the compiler's version:
$PDSERVE_CACHE_DIR/cpu-kernels/<hash>/, else $XDG_CACHE_HOME/pdserve/..., else
~/.cache/pdserve/.... When it cannot be built or loaded, `available()` is false with the
reason, logged once, and callers use the torch reference.

Flags are chosen per translation unit and never `-march=native`: the instruction set is picked
at run time by cpuid (or forced with $PDSERVE_CPU_ISA = avx2 | avx512), so one build serves every
x86-64 machine, and no AMX instruction is ever emitted: AMX faults in a process that has not
asked Linux for the tile state, and it does not speed up the exact int16 path
(docs/quantization.md, "AMX").
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

LIB_NAME = "libpdserve_cpu.so"
ABI_VERSION = 15
SRC_DIR = Path(__file__).resolve().parent.parent / "csrc" / "cpu"
COMMON_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-fopenmp-simd", "-pthread", "-DNDEBUG")
UNIT_FLAGS: dict[str, tuple[str, ...]] = {
    "dispatch.cpp": (),
    "qgemm_avx2.cpp": ("-mavx2", "-mfma", "-mf16c"),
    "qgemm_avx512.cpp": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                         "-mavx512dq", "-mavx512vnni"),
    "attention_avx2.cpp": ("-mavx2", "-mfma", "-mf16c"),
    "attention_avx512.cpp": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512dq"),
    "extend_attention.cpp": (),
    "extend_attention_avx2.cpp": ("-mavx2", "-mfma", "-mf16c"),
    "extend_attention_avx512.cpp": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                                    "-mavx512dq"),
    "norm_avx2.cpp": ("-mavx2", "-mfma", "-mf16c"),
    "layer_ops_avx2.cpp": ("-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"),
    "qgemv_packed_avx512.cpp": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                                "-mavx512dq", "-mavx512vnni"),
    "layer_block.cpp": (),
    "f16_table.cpp": ("-mf16c",),
    "layer_stack.cpp": (),
    "work_pool.cpp": (),
}
ISAS = {"auto": 0, "avx2": 1, "avx512": 2}
ISA_NAMES = {1: "avx2", 2: "avx512"}
PATHS = {"auto": 0, "int8": 1, "f32": 2}  # how activations enter (csrc/cpu/qgemm.h)
_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


@dataclass(frozen=True)
class Availability:
    """Whether the native CPU kernels run here; false with the reason when not."""

    ok: bool
    reason: str
    isa: str = ""  # the instruction set "auto" resolves to: avx2 | avx512

    def __bool__(self) -> bool:
        return self.ok


_threads: int | None = None  # the kernels' thread count (set_threads); None: torch's


def set_threads(n: int | None) -> None:
    """Run the native kernels on `n` threads (the caller and n - 1 helpers of work_pool.h),
    whatever torch's own setting; None follows torch's again."""
    global _threads
    if n is not None and n < 1:
        raise ValueError(f"threads must be at least 1, not {n}")
    _threads = n


def num_threads() -> int:
    """Threads a native kernel runs on when its caller names none."""
    return _threads or torch.get_num_threads()


def cache_root() -> Path:
    """pdserve's cache folder (the same rule as pdserve.weights.default_model.cache_dir)."""
    if explicit := os.environ.get("PDSERVE_CACHE_DIR"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "pdserve"


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def build_key(cxx: str) -> str:
    """Hash of every source, every flag and the compiler's version."""
    digest = hashlib.sha256()
    for path in sorted(SRC_DIR.glob("*.[ch]*")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for unit, flags in sorted(UNIT_FLAGS.items()):
        digest.update(" ".join((unit, *COMMON_FLAGS, *flags)).encode())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    digest.update(version.encode())
    return digest.hexdigest()[:16]


def build(force: bool = False) -> Path:
    """Compile the library into the cache (unless there already); returns its path."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"the native CPU kernels are x86-64 only (this is {platform.machine()})")
    if not SRC_DIR.is_dir():
        raise RuntimeError(f"{SRC_DIR} not found (the kernels build from a source checkout)")
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) found")
    out = cache_root() / "cpu-kernels" / build_key(cxx) / LIB_NAME
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objects = []
        for unit, flags in UNIT_FLAGS.items():
            obj = Path(tmp) / f"{unit}.o"
            _run([cxx, *COMMON_FLAGS, *flags, "-c", str(SRC_DIR / unit), "-o", str(obj)])
            objects.append(str(obj))
        lib = Path(tmp) / LIB_NAME
        _run([cxx, "-shared", "-pthread", *objects, "-o", str(lib)])
        os.replace(lib, out)  # atomic: a racing process sees no library or a whole one
    logger.info("built %s", out)
    return out


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")


@functools.lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, Availability]:
    if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0":
        return None, Availability(False, "disabled by PDSERVE_CPU_KERNELS=0")
    try:
        path = build()
        lib = ctypes.CDLL(str(path))
    except (RuntimeError, OSError) as exc:
        return None, Availability(False, f"not built: {exc}")
    lib.pds_cpu_abi_version.restype = _I
    lib.pds_cpu_isa.restype, lib.pds_cpu_isa.argtypes = _I, [_I]
    lib.pds_cpu_qmatmul.restype = _I
    lib.pds_cpu_qmatmul.argtypes = [_I, _P, _I64, _I64, _P, _I64, _P, _I, _I, _I]
    lib.pds_cpu_dequantize.restype = _I
    lib.pds_cpu_dequantize.argtypes = [_I, _P, _I64, _I64, _P, _I, _I]
    lib.pds_cpu_paged_decode_attention.restype = _I
    lib.pds_cpu_paged_decode_attention.argtypes = [_P, _I64, _P, _P, _I, _P, _I64, _P, *[_I64] * 5,
                                                   ctypes.c_float, _P, _I, _I]
    lib.pds_cpu_paged_extend_attention.restype = _I
    lib.pds_cpu_paged_extend_attention.argtypes = [_P, _I64, _P, _P, _I, _P, _I64, _P, _P, *[_I64] * 5,
                                                   ctypes.c_float, _P, _I, _I]
    lib.pds_cpu_add_rms_norm.restype = _I
    lib.pds_cpu_add_rms_norm.argtypes = [_P, _P, _P, _P, _I64, _I64, ctypes.c_float, _I]
    lib.pds_cpu_attention_block.restype = _I
    lib.pds_cpu_attention_block.argtypes = [_P, _P, _P, ctypes.c_float, _I, _P, _P, _P, _I, _P, _P,
                                            _P, _P, _P, _P, _P, _I, _P, _P, _I64, _P, _P, *[_I64] * 6,
                                            ctypes.c_float, _P, _I, _I]
    lib.pds_cpu_mlp_block.restype = _I
    lib.pds_cpu_mlp_block.argtypes = [_P, _P, _P, ctypes.c_float, _I, _P, _P, _P, _I, _P, _P, _P,
                                      _I64, _I64, _I64, _P, _I, _I]
    lib.pds_cpu_fused_layers.restype = _I
    lib.pds_cpu_fused_layers.argtypes = [_P, _I64, _P, _P, ctypes.c_float, _P, _P, _I, _P, _P, _I64, _P, _P,
                                         *[_I64] * 7, ctypes.c_float, _P, _I, _I]
    lib.pds_cpu_qmatmul_packed.restype = _I
    lib.pds_cpu_qmatmul_packed.argtypes = [_I, _P, _I64, _I64, _P, _P, _I64, _P, _I]
    lib.pds_cpu_round_int16.restype = _I
    lib.pds_cpu_round_int16.argtypes = [_P, _I64, _I64, _P]
    lib.pds_cpu_decode_units.restype = _I64
    lib.pds_cpu_decode_units.argtypes = [_P, _I64, _P, *[_I64] * 5, _I, _I, _P, _I64]
    if lib.pds_cpu_abi_version() != ABI_VERSION:
        return None, Availability(False, f"{path}: ABI {lib.pds_cpu_abi_version()}, need {ABI_VERSION}")
    isa = lib.pds_cpu_isa(0)
    if isa == 0:
        return None, Availability(False, "the CPU lacks AVX2/FMA/F16C")
    return lib, Availability(True, f"{path} ({ISA_NAMES[isa]})", ISA_NAMES[isa])


def availability() -> Availability:
    """Whether the library is built and usable on this CPU (built on first call if needed)."""
    return _library()[1]


def isa_supported(isa: str) -> bool:
    """Whether the instruction set `isa` (avx2 | avx512) runs on this CPU."""
    lib = _library()[0]
    return lib is not None and lib.pds_cpu_isa(ISAS[isa]) == ISAS[isa]


def default_isa() -> str:
    """$PDSERVE_CPU_ISA (avx2 | avx512 | auto), forcing a path, e.g. for tests; default auto."""
    isa = os.environ.get("PDSERVE_CPU_ISA", "auto")
    if isa not in ISAS:
        raise ValueError(f"PDSERVE_CPU_ISA={isa!r}; choose one of {sorted(ISAS)}")
    return isa


def qmatmul(fmt: int, x: torch.Tensor, blocks: torch.Tensor, n: int, k: int,
            isa: str | None = None, threads: int | None = None, path: str = "auto") -> torch.Tensor:
    """y[M, n] = x[M, k] @ W^T with W the `n` rows of GGUF blocks `blocks` (format code `fmt`).

    `path`: f32 (fp32 activations; weights dequantized in registers, or in panels of 16 rows
    from 64 rows on AVX-512) or int8 (activations quantized per block of 32, integer dot
    products); auto is f32.
    """
    lib = _loaded()
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    status = lib.pds_cpu_qmatmul(fmt, x.data_ptr(), x.shape[0], k, blocks.data_ptr(), n,
                                 y.data_ptr(), ISAS[isa or default_isa()],
                                 threads or num_threads(), PATHS[path])
    if status:
        raise RuntimeError(f"pds_cpu_qmatmul: {'instruction set unavailable' if status == 1 else 'bad arguments'} "
                           f"(isa {isa or default_isa()}, fmt {fmt}, M {x.shape[0]}, K {k}, N {n})")
    return y


def dequantize(fmt: int, blocks: torch.Tensor, n: int, k: int, isa: str | None = None,
               threads: int | None = None) -> torch.Tensor:
    """fp32 [n, k]: the `n` rows of GGUF blocks `blocks` (format code `fmt`) dequantized."""
    lib = _loaded()
    out = torch.empty(n, k, dtype=torch.float32)
    status = lib.pds_cpu_dequantize(fmt, blocks.data_ptr(), n, k, out.data_ptr(), ISAS[isa or default_isa()],
                                    threads or num_threads())
    if status:
        raise RuntimeError(f"pds_cpu_dequantize: status {status} (fmt {fmt}, N {n}, K {k})")
    return out


def cache_is_half(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool | None:
    """True for fp16 caches, False for fp32 ones, None for caches the kernels do not read (other
    dtypes, K and V of different dtypes, fp16 with a head_dim not a multiple of 16)."""
    if k_cache.dtype != v_cache.dtype:
        return None
    if k_cache.dtype == torch.float16:
        return None if k_cache.shape[-1] % 16 else True
    return False if k_cache.dtype == torch.float32 else None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, lens: torch.Tensor, scale: float,
                           isa: str | None = None, threads: int | None = None) -> torch.Tensor:
    """out[B, heads, head_dim]: each sequence's one query over its first `lens[b]` cached tokens,
    K/V read in place through `block_tables` (fp32 q; caches `[blocks, block_size, kv_heads,
    head_dim]`, both fp32 or both fp16 (`cache_is_half`); int64 tables and lens; q's heads and
    head_dim contiguous, any token stride)."""
    lib = _loaded()
    B, heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    half = cache_is_half(k_cache, v_cache)
    if q.dtype != torch.float32 or half is None or q.stride()[1:] != (d, 1) \
            or not (k_cache.is_contiguous() and v_cache.is_contiguous()) or block_tables.stride(-1) != 1 \
            or block_tables.dtype != torch.int64 or lens.dtype != torch.int64 or not lens.is_contiguous():
        raise ValueError("paged_decode_attention: fp32 q (heads, head_dim contiguous), contiguous fp32 "
                         "or fp16 caches, int64 block tables (rows contiguous) and lengths")
    out = torch.empty(B, heads, d, dtype=torch.float32)
    status = lib.pds_cpu_paged_decode_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), int(half),
        block_tables.data_ptr(), block_tables.stride(0), lens.data_ptr(), B, heads, kv_heads, d, block_size, scale,
        out.data_ptr(), ISAS[isa or default_isa()], threads or num_threads())
    if status:
        why = "instruction set unavailable" if status == 1 else "bad arguments"
        raise RuntimeError(f"pds_cpu_paged_decode_attention: {why} (B {B}, heads {heads}, "
                           f"kv_heads {kv_heads}, head_dim {d}, block_size {block_size})")
    return out


def decode_units(block_tables: torch.Tensor, lens: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                 block_size: int, isa: str | None = None, threads: int | None = None
                 ) -> list[tuple[int, int, int, int]]:
    """How `paged_decode_attention` on `threads` threads cuts these rows into units of work
    (csrc/cpu/decode_split.h): per unit (rows in it, KV head, part of the keys, keys its rows
    share). Rows whose first blocks are the same share a unit for those keys (AVX-512), in as few
    units as leave about two per thread; every other unit is one row's."""
    lib = _loaded()
    tables = block_tables.to(torch.int64).contiguous()
    lens = lens.to(torch.int64).contiguous()
    room = int(tables.shape[0]) * kv_heads * int(max(1, -(-int(lens.max()) // 1024))) if lens.numel() else 0
    out = torch.empty(max(room, 1), 4, dtype=torch.int64)
    n = lib.pds_cpu_decode_units(tables.data_ptr(), tables.stride(0), lens.data_ptr(), lens.numel(), heads,
                                 kv_heads, head_dim, block_size, ISAS[isa or default_isa()], threads or num_threads(),
                                 out.data_ptr(), room)
    if n < 0:
        raise RuntimeError("pds_cpu_decode_units: " + ("instruction set unavailable" if n == -1 else "bad arguments"))
    return [tuple(int(x) for x in row) for row in out[:n].tolist()]


def paged_extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor, scale: float,
                           isa: str | None = None, threads: int | None = None) -> torch.Tensor:
    """out[T, heads, head_dim]: causal attention of each sequence's new tokens (q rows
    `starts[b]:starts[b+1]`, the last of its `lens[b]` positions) over its context, K/V read in
    place through `block_tables` (fp32 q; caches `[blocks, block_size, kv_heads, head_dim]`, both
    fp32 or both fp16; int64 tables, lens and starts; q's heads and head_dim contiguous, any token
    stride)."""
    lib = _loaded()
    T, heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    half = cache_is_half(k_cache, v_cache)
    if q.dtype != torch.float32 or half is None or q.stride()[1:] != (d, 1) \
            or not (k_cache.is_contiguous() and v_cache.is_contiguous()) or block_tables.stride(-1) != 1 \
            or block_tables.dtype != torch.int64 or lens.dtype != torch.int64 or not lens.is_contiguous() \
            or starts.dtype != torch.int64 or not starts.is_contiguous() or starts.numel() != lens.numel() + 1 \
            or int(starts[-1]) != T:
        raise ValueError("paged_extend_attention: fp32 q (heads, head_dim contiguous), contiguous fp32 or fp16 caches, "
                         "int64 block tables (rows contiguous), lengths and starts (one more than lengths, "
                         "the last = q's rows)")
    out = torch.empty(T, heads, d, dtype=torch.float32)
    status = lib.pds_cpu_paged_extend_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), int(half),
        block_tables.data_ptr(), block_tables.stride(0), lens.data_ptr(), starts.data_ptr(), lens.numel(), heads, kv_heads, d, block_size,
        scale, out.data_ptr(), ISAS[isa or default_isa()], threads or num_threads())
    if status:
        why = f"instruction set {isa or default_isa()} unavailable" if status == 1 else "bad arguments"
        raise RuntimeError(f"pds_cpu_paged_extend_attention: {why} (B {lens.numel()}, T {T}, heads {heads}, "
                           f"kv_heads {kv_heads}, head_dim {d}, block_size {block_size})")
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 threads: int | None = None) -> torch.Tensor:
    """rms_norm(x + residual) * weight for contiguous fp32 rows `[..., dim]`; the sum is written
    into `x` (when `residual` is given). Returns the normed rows (a new tensor)."""
    lib = _loaded()
    dim = x.shape[-1]
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors) or weight.shape != (dim,) \
            or (residual is not None and residual.shape != x.shape):
        raise ValueError("add_rms_norm: contiguous fp32 x, residual of x's shape and weight [dim]")
    out = torch.empty_like(x)
    status = lib.pds_cpu_add_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(),
                                      weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps,
                                      threads or num_threads())
    if status:
        raise RuntimeError(f"pds_cpu_add_rms_norm: status {status} (shape {tuple(x.shape)})")
    return out


def packed_supported() -> bool:
    """Whether the packed int16-activation path (AVX-512) runs here and is not forced off
    ($PDSERVE_CPU_ISA=avx2 forces the AVX2 kernels everywhere)."""
    return default_isa() != "avx2" and isa_supported("avx512")


def int16_activations() -> bool:
    """Whether Q4 layers and a Q8_0 LM head run with activations rounded to int16 per block of
    32: where `packed_supported()`, unless $PDSERVE_INT16_ACTIVATIONS=0. Then every row of every
    such matmul (prefill, decode, mixed steps alike) multiplies the same rounded activations
    through the packed int16 kernel (docs/cpu-kernels.md)."""
    return os.environ.get("PDSERVE_INT16_ACTIVATIONS", "1") != "0" and packed_supported()


def qmatmul_packed(fmt: int, x: torch.Tensor, qs: torch.Tensor, dm: torch.Tensor, n: int, k: int,
                   threads: int | None = None) -> torch.Tensor:
    """y[M, n] = round16(x)[M, k] @ dequant(W)^T for a matrix W of format code `fmt` (Q4_0, Q4_1,
    Q8_0) packed by `pdserve_kernels.quant.packed.pack` (AVX-512 VNNI; activations rounded to
    int16 per block of 32, as `round_int16`), any number of rows."""
    lib = _loaded()
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    status = lib.pds_cpu_qmatmul_packed(fmt, x.data_ptr(), x.shape[0], k, qs.data_ptr(), dm.data_ptr(), n,
                                        y.data_ptr(), threads or num_threads())
    if status:
        raise RuntimeError(f"pds_cpu_qmatmul_packed: {'AVX-512 unavailable' if status == 1 else 'bad arguments'} "
                           f"(M {x.shape[0]}, K {k}, N {n})")
    return y


def round_int16(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (K a multiple of 32) rounded per block of 32 exactly as the packed product rounds
    it, as fp32 (AVX-512; for tests against the torch rounding)."""
    lib = _loaded()
    x = x.contiguous()
    out = torch.empty_like(x)
    status = lib.pds_cpu_round_int16(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    if status:
        raise RuntimeError(f"pds_cpu_round_int16: status {status} (shape {tuple(x.shape)})")
    return out


def _packed_ptrs(packed) -> tuple[int | None, int | None]:
    return (None, None) if packed is None else (packed[0].data_ptr(), packed[1].data_ptr())


def attention_block(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                    qkv_fmt: int, qkv_w: torch.Tensor, o_fmt: int, o_w: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                    starts: torch.Tensor | None, heads: int, kv_heads: int, scale: float, out: torch.Tensor,
                    qkv_packed=None, o_packed=None, isa: str | None = None, threads: int | None = None
                    ) -> torch.Tensor:
    """The attention half of a decoder layer for M token rows of B sequences in one call
    (csrc/cpu/layer_block.cpp): `x += residual`, RMSNorm, qkv, RoPE, KV store, paged attention,
    o_proj into `out` [M, hidden]. The caller guarantees the layouts (`pdserve_kernels.layer_blocks`
    checks them): contiguous fp32 x/residual/out/cos/sin, fp32 or fp16 caches, uint8 weight blocks, int64 slots,
    tables (rows contiguous), lens and starts (sequence b's rows `starts[b]:starts[b+1]`; None:
    one row a sequence). `*_packed`: (qs, dm) of `pack` to multiply by instead
    of the blocks (AVX-512), or None."""
    lib = _loaded()
    M, hidden = x.shape
    _, block_size, _, head_dim = k_cache.shape
    status = lib.pds_cpu_attention_block(
        x.data_ptr(), None if residual is None else residual.data_ptr(), norm_w.data_ptr(), eps, qkv_fmt,
        qkv_w.data_ptr(), *_packed_ptrs(qkv_packed), o_fmt, o_w.data_ptr(), *_packed_ptrs(o_packed),
        cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), int(cache_is_half(k_cache, v_cache)), slots.data_ptr(), tables.data_ptr(),
        tables.stride(0), lens.data_ptr(),
        None if starts is None else starts.data_ptr(), lens.numel(), hidden, heads, kv_heads, head_dim, block_size,
        scale, out.data_ptr(), ISAS[isa or default_isa()], threads or num_threads())
    if status:
        raise RuntimeError(f"pds_cpu_attention_block: status {status} (rows {M}, sequences {lens.numel()}, "
                           f"hidden {hidden}, heads {heads}, kv_heads {kv_heads}, head_dim {head_dim})")
    return out


def mlp_block(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
              gu_fmt: int, gu_w: torch.Tensor, down_fmt: int, down_w: torch.Tensor, inter: int,
              out: torch.Tensor, gu_packed=None, down_packed=None, isa: str | None = None,
              threads: int | None = None) -> torch.Tensor:
    """The MLP half of a decoder layer in one call: `x += residual`, RMSNorm, gate/up, SwiGLU,
    down into `out` [M, hidden] (layouts as in `attention_block`)."""
    lib = _loaded()
    M, hidden = x.shape
    status = lib.pds_cpu_mlp_block(
        x.data_ptr(), None if residual is None else residual.data_ptr(), norm_w.data_ptr(), eps, gu_fmt,
        gu_w.data_ptr(), *_packed_ptrs(gu_packed), down_fmt, down_w.data_ptr(), *_packed_ptrs(down_packed), M,
        hidden, inter, out.data_ptr(),
        ISAS[isa or default_isa()], threads or num_threads())
    if status:
        raise RuntimeError(f"pds_cpu_mlp_block: status {status} (rows {M}, hidden {hidden}, inter {inter})")
    return out


def fused_layers(table: torch.Tensor, x: torch.Tensor, final_w: torch.Tensor, eps: float, cos: torch.Tensor,
                 sin: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 starts: torch.Tensor | None, heads: int,
                 kv_heads: int, head_dim: int, block_size: int, inter: int, scale: float, out: torch.Tensor,
                 isa: str | None = None, threads: int | None = None, kv_half: bool = False) -> torch.Tensor:
    """Every layer's two blocks, then the final norm, in one call (csrc/cpu/layer_stack.cpp).
    `table`: int64 [layers, 20], one row of pointers and formats per layer
    (`pdserve_kernels.layer_blocks.LayerStack` builds it); `x` [M, hidden] is used as scratch;
    `out` [M, hidden] receives the normed hidden states; `kv_half`: every layer's caches are fp16.
    Layouts as in `attention_block`."""
    lib = _loaded()
    M, hidden = x.shape
    status = lib.pds_cpu_fused_layers(
        table.data_ptr(), table.shape[0], x.data_ptr(), final_w.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(),
        int(kv_half), slots.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        None if starts is None else starts.data_ptr(), lens.numel(), hidden, heads, kv_heads,
        head_dim, block_size, inter, scale, out.data_ptr(), ISAS[isa or default_isa()],
        threads or num_threads())
    if status:
        raise RuntimeError(f"pds_cpu_fused_layers: status {status} (layers {table.shape[0]}, rows {M}, "
                           f"hidden {hidden}, heads {heads}, kv_heads {kv_heads}, head_dim {head_dim})")
    return out


def _loaded() -> ctypes.CDLL:
    lib = _library()[0]
    if lib is None:
        raise RuntimeError(f"native CPU kernels unavailable: {availability().reason}")
    return lib


if __name__ == "__main__":  # `make setup`: build now, say where and for which CPU path
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(f"pdserve CPU kernels: {build(force='--force' in sys.argv)}")
    except RuntimeError as exc:  # the torch reference still runs; say why, do not fail setup
        print(f"pdserve CPU kernels not built ({exc}); the torch reference will be used")
        sys.exit(0)
    print(f"pdserve CPU kernels: {availability().reason}")
