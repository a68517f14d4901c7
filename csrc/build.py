"""Build libpdserve_kernels.so from csrc/ with nvcc, cached by a hash of sources and flags.

One object per .cu file (a CUTLASS GEMM configuration costs minutes and ~6 GB, so at most
two compile jobs run). Each object is cached under its own hash (its source, the local
headers it includes, flags, archs, nvcc and CUTLASS versions), so editing an attention kernel
never recompiles the GEMM; the linked library is cached under the hash of its objects.
Cache root: $PDSERVE_KERNELS_CACHE or ~/.cache/pdserve/kernels. Standard library only.

    python csrc/build.py [--jobs 2] [--out build/kernels] [--probes]
    python csrc/build.py --object SRC --arch sm_120 --out FILE   # one object, uncached
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

CSRC = Path(__file__).resolve().parent
LIB_NAME = "libpdserve_kernels.so"
PORTABLE = ("sm_80", "sm_90a", "sm_120a")
# Which GPUs each translation unit carries code for. The block-scaled GEMM exists on
# sm_120a only; a plain sm_120 build would compile with its MMA body silently left out.
UNITS: dict[str, tuple[str, ...]] = {
    "host.cu": (),
    "nvfp4_gemm_sm120_128x128x128.cu": ("sm_120a",),
    "nvfp4_quant.cu": PORTABLE,
    "nvfp4_gemv.cu": PORTABLE,
    "attn_prefill.cu": PORTABLE,
    "attn_decode.cu": PORTABLE,
}
FLAGS = ("-std=c++17", "-O3", "--expt-relaxed-constexpr", "-DNDEBUG",
         "-Xcompiler", "-fPIC,-fvisibility=hidden")
# Built only on request (tests) and never linked: the trap, the GEMM for plain sm_120.
PROBES: dict[str, tuple[str, tuple[str, ...]]] = {
    "gemm_plain_sm120": ("nvfp4_gemm_sm120_128x128x128.cu", ("sm_120",)),
}
MAX_JOBS = 2


class Toolchain(NamedTuple):
    nvcc: str
    nvcc_version: str
    includes: tuple[str, ...]
    cutlass_version: str


class BuildResult(NamedTuple):
    library: Path
    key: str
    objects: dict[str, dict]
    probes: dict[str, dict]
    seconds: float


def toolchain() -> Toolchain:
    """nvcc from PATH (or $CUDA_HOME/bin) and the CUTLASS headers of the nvidia-cutlass wheel."""
    nvcc = shutil.which("nvcc") or str(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin/nvcc")
    if not Path(nvcc).exists():
        raise FileNotFoundError("nvcc not found (PATH or $CUDA_HOME/bin)")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("CUTLASS headers missing: pip install --no-deps nvidia-cutlass==4.2.0.0")
    source = Path(list(spec.submodule_search_locations)[0]) / "source"
    includes = (str(source / "include"), str(source / "tools/util/include"))
    return Toolchain(nvcc, version.strip().splitlines()[-1], includes,
                     importlib.metadata.version("nvidia-cutlass"))


def gencode(archs: tuple[str, ...]) -> list[str]:
    """sm_XY[a] -> -gencode arch=compute_XY[a],code=sm_XY[a] (SASS only, no PTX)."""
    out: list[str] = []
    for arch in archs or ("sm_80",):  # host-only unit: any arch, it has no kernels
        out += ["-gencode", f"arch=compute_{arch[3:]},code={arch}"]
    return out


def local_headers(path: Path, seen: set[Path] | None = None) -> set[Path]:
    """Every csrc header that `path` includes, recursively (`#include "..."` only)."""
    seen = set() if seen is None else seen
    for name in re.findall(r'^\s*#include\s+"([^"]+)"', path.read_text(), re.M):
        header = (path.parent / name).resolve()
        if header.exists() and header not in seen and CSRC in header.parents:
            seen.add(header)
            local_headers(header, seen)
    return seen


def object_key(src: Path, archs: tuple[str, ...], tc: Toolchain) -> str:
    h = hashlib.sha256()
    for part in (tc.nvcc_version, tc.cutlass_version, " ".join(FLAGS), " ".join(archs)):
        h.update(part.encode() + b"\0")
    for f in [src, *sorted(local_headers(src))]:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:24]


def compile_object(src: Path, archs: tuple[str, ...], out: Path, tc: Toolchain) -> float:
    """nvcc -c into a temp file renamed onto `out` (safe for concurrent builds); seconds."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp.o")
    cmd = [tc.nvcc, *FLAGS, *gencode(archs), *(f"-I{i}" for i in tc.includes), f"-I{CSRC}",
           "-c", str(src), "-o", str(tmp)]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"nvcc failed for {src.name}:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}")
    tmp.replace(out)
    seconds = time.monotonic() - start
    out.with_suffix(".seconds").write_text(f"{seconds:.1f}")  # compile cost, for reports
    return seconds


def cache_root() -> Path:
    env = os.environ.get("PDSERVE_KERNELS_CACHE")
    return Path(env) if env else Path.home() / ".cache/pdserve/kernels"


def _plan(name: str, src: str, archs: tuple[str, ...], root: Path, tc: Toolchain) -> dict:
    key = object_key(CSRC / src, archs, tc)
    path = root / "obj" / f"{name}-{key}.o"
    timing = path.with_suffix(".seconds")
    seconds = float(timing.read_text()) if path.exists() and timing.exists() else 0.0
    return {"source": src, "key": key, "archs": list(archs), "object": str(path),
            "seconds": seconds, "cached": path.exists()}


def build(jobs: int = MAX_JOBS, out_dir: Path | None = None, probes: bool = False,
          log=print) -> BuildResult:
    """Compile what is not cached, link, and copy the library into out_dir (if given)."""
    start = time.monotonic()
    tc = toolchain()
    missing = sorted(p.name for p in CSRC.glob("*.cu") if p.name not in UNITS)
    if missing:
        raise RuntimeError(f"csrc/{missing[0]} is not listed in build.py UNITS")
    root = cache_root()
    objects = {name: _plan(Path(name).stem, name, archs, root, tc) for name, archs in UNITS.items()}
    extra = {name: _plan(name, src, archs, root, tc) for name, (src, archs) in PROBES.items()} \
        if probes else {}
    todo = [o for o in [*objects.values(), *extra.values()] if not o["cached"]]
    # Longest first: the CUTLASS GEMM dominates, the others fill the second job.
    todo.sort(key=lambda o: ("gemm" not in o["source"], o["archs"] != ["sm_120a"]))
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(jobs, MAX_JOBS))) as pool:
        futures = {pool.submit(compile_object, CSRC / o["source"], tuple(o["archs"]),
                               Path(o["object"]), tc): o for o in todo}
        for fut in concurrent.futures.as_completed(futures):
            o = futures[fut]
            o["seconds"] = round(fut.result(), 1)
            log(f"compiled {o['source']} for {','.join(o['archs']) or 'host'} in {o['seconds']} s")
    lib_key = hashlib.sha256("".join(o["key"] for o in objects.values()).encode()).hexdigest()[:24]
    lib = root / "lib" / lib_key / LIB_NAME
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cmd = [tc.nvcc, "-shared", "-cudart", "static", "-Xlinker", "--exclude-libs,ALL",
               *(o["object"] for o in objects.values()), "-o", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"link failed:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}")
        tmp.replace(lib)
    info = {"library": str(lib), "key": lib_key, "nvcc": tc.nvcc_version,
            "cutlass": tc.cutlass_version, "flags": list(FLAGS), "objects": objects,
            "probes": extra, "bytes": lib.stat().st_size,
            "seconds": round(time.monotonic() - start, 1)}
    (lib.parent / "build.json").write_text(json.dumps(info, indent=2))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f".{LIB_NAME}.{os.getpid()}"
        shutil.copy2(lib, tmp)
        tmp.replace(out_dir / LIB_NAME)
        (out_dir / "build.json").write_text(json.dumps(info, indent=2))
    return BuildResult(lib, lib_key, objects, extra, info["seconds"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", "-j", type=int, default=MAX_JOBS)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--probes", action="store_true", help="also build the trap probes")
    parser.add_argument("--object", type=Path, default=None, help="compile one file, uncached")
    parser.add_argument("--arch", action="append", default=[], help="with --object: sm_XY[a]")
    args = parser.parse_args(argv)
    if args.object is not None:
        if args.out is None:
            parser.error("--object needs --out FILE")
        secs = compile_object(args.object.resolve(), tuple(args.arch), args.out, toolchain())
        print(f"compiled {args.object} for {args.arch} in {secs:.1f} s")
        return 0
    result = build(args.jobs, args.out, args.probes)
    print(f"{result.library} ({result.library.stat().st_size} bytes, {result.seconds} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
