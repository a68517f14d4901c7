"""ctypes loader and typed wrappers of libpdserve_kernels.so (built from csrc/ by `make kernels`).

The library has a plain C ABI and links cudart statically, so it needs no CUDA build of torch
and loads on machines without a GPU: there its host-only helpers work and every launch
returns an error status, which the wrappers raise as `KernelError`.
Search order: $PDSERVE_KERNELS_LIB, then <repo>/build/kernels/libpdserve_kernels.so.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
from pathlib import Path

import torch

from .dispatch import Availability

LIB_NAME = "libpdserve_kernels.so"
ABI_VERSION = 1
STATUS_NAMES = {
    0: "ok",
    1: "no CUDA device",
    2: "unsupported GPU architecture",
    3: "invalid argument",
    4: "workspace too small",
    5: "CUTLASS cannot implement this problem",
    6: "CUDA launch failed",
}
_P, _I, _I64, _F, _SZ = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_size_t
_SIGNATURES: dict[str, tuple[type, list[type]]] = {
    "pds_status_name": (ctypes.c_char_p, [_I]),
    "pds_abi_version": (_I, []),
    "pds_device_capability": (_I, [ctypes.POINTER(_I), ctypes.POINTER(_I)]),
    "pds_nvfp4_sf_bytes": (_I64, [_I64, _I64]),
    "pds_nvfp4_sf_offset": (_I64, [_I64, _I64, _I64, _I64]),
    "pds_nvfp4_gemm_workspace_bytes": (_I64, [_I, _I, _I]),
    "pds_attn_decode_workspace_bytes": (_I64, [_I, _I, _I, _I]),
    "pds_nvfp4_gemm_bf16": (_I, [_P, _P, _P, _P, _P, _P, _F, _I, _I, _I, _P, _SZ, _P]),
    "pds_nvfp4_quantize_bf16": (_I, [_P, _P, _P, _P, _F, _I, _I, _P]),
    "pds_nvfp4_gemv_bf16": (_I, [_P, _P, _P, _P, _I, _F, _I, _I, _I, _P]),
    "pds_attn_prefill_bf16": (_I, [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _F, _I, _P]),
    "pds_attn_decode_paged_bf16": (
        _I, [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I, _P, _SZ, _P]),
}


class KernelError(RuntimeError):
    """A launch returned a non-zero pds_status."""

    def __init__(self, entry: str, status: int) -> None:
        super().__init__(f"{entry}: {STATUS_NAMES.get(status, 'unknown status')} ({status})")
        self.status = status


def library_path() -> Path | None:
    """The library to load, or None when none was built."""
    env = os.environ.get("PDSERVE_KERNELS_LIB")
    if env:
        return Path(env) if Path(env).exists() else None
    path = Path(__file__).resolve().parent.parent / "build" / "kernels" / LIB_NAME
    return path if path.exists() else None


@functools.lru_cache(maxsize=4)
def _load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    if lib.pds_abi_version() != ABI_VERSION:
        raise OSError(f"{path}: ABI {lib.pds_abi_version()}, expected {ABI_VERSION}")
    return lib


def load(path: str | Path | None = None) -> ctypes.CDLL:
    """Load (once) and type the library; OSError when it is missing or incompatible."""
    if path is None:
        return _load_found(os.environ.get("PDSERVE_KERNELS_LIB"))
    return _load(str(Path(path).resolve()))


@functools.lru_cache(maxsize=4)
def _load_found(env: str | None) -> ctypes.CDLL:
    """The library `library_path()` finds, looked up once per value of PDSERVE_KERNELS_LIB
    (`env`): every launch calls `load`, and resolving the path took ≈ 0.2 ms, 30 times in a prompt
    step on a GPU (docs/gpu.md). A library not found is looked up again on the next call."""
    found = library_path()
    if found is None:
        raise OSError(f"{LIB_NAME} not found: run `make kernels` or set PDSERVE_KERNELS_LIB")
    return _load(str(found.resolve()))


def device_capability(lib: ctypes.CDLL | None = None) -> tuple[int, int] | None:
    """(major, minor) of the current GPU as the library's cudart sees it; None without one."""
    lib = lib or load()
    major, minor = _I(), _I()
    status = lib.pds_device_capability(ctypes.byref(major), ctypes.byref(minor))
    return (major.value, minor.value) if status == 0 else None


def available(need_sm120: bool = False) -> Availability:
    """Library loaded and a GPU it has code for (SM120 for the block-scaled GEMM)?"""
    try:
        lib = load()
    except OSError as err:
        return Availability(False, str(err))
    cap = device_capability(lib)
    if cap is None:
        return Availability(False, "no CUDA device (driver or GPU missing)")
    portable = cap[0] == 8 or cap in ((9, 0), (12, 0))
    if need_sm120 and cap != (12, 0):
        return Availability(False, f"compute capability {cap} is not SM120 (sm_120a)", cap)
    if not portable:
        return Availability(False, f"no code for compute capability {cap}", cap)
    return Availability(True, "ok", cap)


# ---- host-only helpers ------------------------------------------------------------------

def nvfp4_sf_bytes(rows: int, k: int) -> int:
    return load().pds_nvfp4_sf_bytes(rows, k)


def nvfp4_sf_offset(rows: int, k: int, row: int, k_block: int) -> int:
    """Offset of scale (row, k_block) as CuTe's layout in the GEMM computes it."""
    return load().pds_nvfp4_sf_offset(rows, k, row, k_block)


def nvfp4_gemm_workspace_bytes(m: int, n: int, k: int) -> int:
    return load().pds_nvfp4_gemm_workspace_bytes(m, n, k)


def attn_decode_workspace_bytes(batch: int, num_q_heads: int, head_dim: int, num_splits: int) -> int:
    return load().pds_attn_decode_workspace_bytes(batch, num_q_heads, head_dim, num_splits)


def default_decode_splits(batch: int, num_kv_heads: int, group: int, max_context: int,
                          num_sms: int) -> int:
    """Enough splits for ~2 CTAs per SM, no more than 64-key tiles, at most 32."""
    ctas = batch * num_kv_heads * math.ceil(group / 16)
    want = math.ceil(2 * num_sms / max(ctas, 1))
    return max(1, min(want, math.ceil(max(max_context, 1) / 64), 32))


# ---- launches (tensors on the current CUDA device, current stream) ----------------------

def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _stream(t: torch.Tensor) -> int | None:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else None


def _require(entry: str, **tensors: tuple[torch.Tensor | None, torch.dtype]) -> None:
    """Kernels take raw pointers: wrong dtypes or strides would be read silently."""
    for name, (t, dtype) in tensors.items():
        if t is None:
            continue
        if t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{entry}: {name} must be a contiguous {dtype}, got {t.dtype}")


def _check(entry: str, status: int) -> None:
    if status != 0:
        raise KernelError(entry, status)


def nvfp4_gemm(a: torch.Tensor, b: torch.Tensor, sfa: torch.Tensor, sfb: torch.Tensor,
               alpha: torch.Tensor | float, out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [m, n] = alpha · A[m,k] · B[n,k]^T; A/B packed uint8 [., k/2], SF swizzled."""
    _require("nvfp4_gemm", a=(a, torch.uint8), b=(b, torch.uint8), sfa=(sfa, sfa.dtype),
             sfb=(sfb, sfb.dtype), out=(out, torch.bfloat16))
    m, n, k = a.shape[0], b.shape[0], a.shape[1] * 2
    out = torch.empty((m, n), dtype=torch.bfloat16, device=a.device) if out is None else out
    alpha_dev = alpha if isinstance(alpha, torch.Tensor) else None
    ws_bytes = max(nvfp4_gemm_workspace_bytes(m, n, k), 0)
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=a.device) if ws_bytes else None
    status = load().pds_nvfp4_gemm_bf16(
        _ptr(out), _ptr(a), _ptr(b), _ptr(sfa), _ptr(sfb), _ptr(alpha_dev),
        float(alpha) if alpha_dev is None else 1.0, m, n, k, _ptr(ws), ws_bytes, _stream(a))
    _check("nvfp4_gemm", status)
    return out


def nvfp4_quantize(x: torch.Tensor, gs: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [m, k] -> (packed uint8 [m, k/2], swizzled E4M3 scales uint8 [sf_bytes])."""
    _require("nvfp4_quantize", x=(x, torch.bfloat16))
    m, k = x.shape
    q = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    sf = torch.empty(max(nvfp4_sf_bytes(m, k), 0), dtype=torch.uint8, device=x.device)
    gs_dev = gs if isinstance(gs, torch.Tensor) else None
    status = load().pds_nvfp4_quantize_bf16(
        _ptr(q), _ptr(sf), _ptr(x), _ptr(gs_dev), float(gs) if gs_dev is None else 1.0, m, k,
        _stream(x))
    _check("nvfp4_quantize", status)
    return q, sf


def nvfp4_gemv(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, weight_scale_2: float,
               swizzled: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [m <= 16, n] = x · dequant(W)^T (W4A16 on CUDA cores)."""
    _require("nvfp4_gemv", x=(x, torch.bfloat16), w=(w, torch.uint8),
             w_scale=(w_scale, w_scale.dtype), out=(out, torch.bfloat16))
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device) if out is None else out
    status = load().pds_nvfp4_gemv_bf16(
        _ptr(out), _ptr(x), _ptr(w), _ptr(w_scale), int(swizzled), float(weight_scale_2), m, n,
        k, _stream(x))
    _check("nvfp4_gemv", status)
    return out


def attn_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, max_seqlen_q: int, softmax_scale: float,
                 causal: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen prefill: q [total_q, hq, d], k/v [total_k, hkv, d], cu_seqlens int32 [b+1]."""
    bf16, i32 = torch.bfloat16, torch.int32
    _require("attn_prefill", q=(q, bf16), k=(k, bf16), v=(v, bf16), out=(out, bf16),
             cu_seqlens_q=(cu_seqlens_q, i32), cu_seqlens_k=(cu_seqlens_k, i32))
    out = torch.empty_like(q) if out is None else out
    status = load().pds_attn_prefill_bf16(
        _ptr(out), _ptr(q), _ptr(k), _ptr(v), _ptr(cu_seqlens_q), _ptr(cu_seqlens_k),
        cu_seqlens_q.numel() - 1, max_seqlen_q, q.shape[1], k.shape[1], q.shape[2],
        softmax_scale, int(causal), _stream(q))
    _check("attn_prefill", status)
    return out


def attn_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor, softmax_scale: float,
                num_splits: int = 1, out: torch.Tensor | None = None,
                workspace: torch.Tensor | None = None) -> torch.Tensor:
    """Paged decode: q [b, hq, d]; caches [blocks, block_size, hkv, d]; tables int32 [b, max]."""
    bf16, i32 = torch.bfloat16, torch.int32
    _require("attn_decode", q=(q, bf16), k_cache=(k_cache, bf16), v_cache=(v_cache, bf16),
             block_tables=(block_tables, i32), context_lens=(context_lens, i32), out=(out, bf16))
    batch, hq, d = q.shape
    out = torch.empty_like(q) if out is None else out
    need = attn_decode_workspace_bytes(batch, hq, d, num_splits)
    if workspace is None and need > 0:
        workspace = torch.empty(need, dtype=torch.uint8, device=q.device)
    ws_bytes = 0 if workspace is None else workspace.numel() * workspace.element_size()
    status = load().pds_attn_decode_paged_bf16(
        _ptr(out), _ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(block_tables), _ptr(context_lens),
        batch, hq, k_cache.shape[2], d, k_cache.shape[1], block_tables.shape[1], softmax_scale,
        num_splits, _ptr(workspace), ws_bytes, _stream(q))
    _check("attn_decode", status)
    return out
