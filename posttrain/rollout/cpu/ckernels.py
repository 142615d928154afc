"""C kernels for the CPU decode step, compiled on the machine that runs them and loaded with ctypes.

Between its matmuls a fused decode step (`fused.DecodePlan`) runs a dozen small ops per layer, and on
a CPU each costs a fixed few µs or streams its operands at a fraction of the memory's bandwidth.
PyTorch has no fused attention for one new token per row on a CPU: its decode attention is six ops
per layer (two RoPE multiplies, a cache copy, `baddbmm`, `softmax`, `bmm`), and the batched GEMMs run
each (row, KV head) as its own tiny product. `kernels/decode.c` does those six in one call (its
header gives the layouts), an RMSNorm in one call instead of three to five, and SwiGLU's
silu(gate)·up in one instead of two, reading and writing bf16 directly where the weights are bf16
(no fp32 copies). It also holds matmuls over weights packed in blocks of 16 columns — bf16 on
AVX512-BF16 dot products, fp32 on AVX-512 FMAs (`projections.CGemm`, form `c`) — which the tuner
measures beside MKL's and oneDNN's. On the 2-core AMD EPYC, 64 rows × tiny-30m's heads at 50 positions and 10 layers'
caches, one layer's attention takes ~0.4–0.5 ms against ~0.8–0.9 ms for the six ops
(benchmarks/README.md has the measurements).

The source ships with the package and is built on first use with the system C compiler
(`$CC`, else `cc`): `-O3 -march=native -fopenmp`, into `<cache_dir>/kernels/`, named by a hash of the
source, the flags, the compiler's version and the CPU — a fresh build whenever one of them changes,
~0.6 s once per machine. `-fopenmp` links `libgomp.so.1`, which resolves to the copy PyTorch already
loaded, so the kernel shares PyTorch's OpenMP thread pool. No compiler, a failed build or
`POSTTRAIN_C_KERNELS=0` leave the PyTorch ops in place (a warning says why, once per process).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import warnings
from importlib import resources
from pathlib import Path

import torch

from posttrain.telemetry.devices import cache_dir, cpu_name

ENV_DISABLE = "POSTTRAIN_C_KERNELS"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
MAX_HEAD_DIM, MAX_GROUP = 512, 64  # the C source's limits
_loaded: dict[bool, ctypes.CDLL | None] = {}


class BuildError(RuntimeError):
    pass


def _source() -> bytes:
    return resources.files("posttrain.rollout.cpu").joinpath("kernels/decode.c").read_bytes()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(generic: bool = False) -> Path:
    """Compile the decode kernels (or find them built); the path of the shared library.

    `generic` builds the plain-C loops even where AVX-512 is there (the tests check both paths).
    Raises `BuildError` with the compiler's message when it cannot.
    """
    cc = _compiler()
    if cc is None:
        raise BuildError("no C compiler ($CC, cc or gcc) on PATH")
    flags = [*FLAGS, *(["-DPOSTTRAIN_GENERIC"] if generic else [])]
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        raise BuildError(f"{cc} --version failed: {err}") from err
    source = _source()
    digest = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode(),
                                        cpu_name().encode()])).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"decode-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    src = target.with_suffix(f".{os.getpid()}.c")
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    try:
        src.write_bytes(source)
        done = subprocess.run([cc, *flags, "-o", str(tmp), str(src), "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
            raise BuildError(f"{cc} {' '.join(flags)} failed (exit {done.returncode}):\n{tail}")
        tmp.replace(target)  # whole or not at all: a concurrent build renames the same bytes
    except (OSError, subprocess.TimeoutExpired) as err:
        raise BuildError(f"building {target.name} with {cc}: {err}") from err
    finally:
        src.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return target


_I, _P, _N, _F = ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_float
_GEMM = (_I, _I, _I, _P, _N, _P, _P, _P, _N, _I, _I)
SIGNATURES = {  # name: (result, arguments), as in kernels/decode.c
    "posttrain_decode_attention": (_I, (_I, _I, _I, _I, _I, _I, _P, _I, _N, _P, _P, _P, _I, _P, _P, _F, _P, _I, _N,
                                        _P, _I)),
    "posttrain_scratch_floats": (_N, (_I, _I, _I)),
    "posttrain_vector_path": (_I, ()),
    "posttrain_bf16_dot_path": (_I, ()),
    "posttrain_rms_norm": (_I, (_I, _I, _P, _I, _F, _P, _I, _I)),
    "posttrain_silu_mul": (_I, (_I, _I, _P, _P, _I, _I)),
    "posttrain_packed_elements": (_N, (_I, _I)),
    "posttrain_pack_bf16": (_I, (_I, _I, _P, _P, _I)),
    "posttrain_pack_f32": (_I, (_I, _I, _P, _P, _I)),
    "posttrain_gemm_bf16": (_I, _GEMM),
    "posttrain_gemm_f32": (_I, _GEMM),
}


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, (result, arguments) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = result, list(arguments)
    return lib


def decode_library(generic: bool = False) -> ctypes.CDLL | None:
    """The loaded kernel library, or None where it cannot be built (warned once) or is turned off."""
    if os.environ.get(ENV_DISABLE) == "0":
        return None
    if generic not in _loaded:
        try:
            _loaded[generic] = _bind(ctypes.CDLL(str(build(generic))))
        except (BuildError, OSError) as err:
            warnings.warn(f"posttrain: the C decode kernels are unavailable, using PyTorch ops ({err})",
                          RuntimeWarning, stacklevel=2)
            _loaded[generic] = None
    return _loaded[generic]


def gemm_library(dtype: torch.dtype) -> ctypes.CDLL | None:
    """The library, where its matmul for `dtype` weights is vector code (the `c` projection form): fp32 on
    AVX-512, bf16 on AVX512-BF16 dot products; else None (the plain-C loops are for tests only)."""
    lib = decode_library()
    if lib is None or dtype not in (torch.float32, torch.bfloat16):
        return None
    fast = lib.posttrain_bf16_dot_path() if dtype == torch.bfloat16 else lib.posttrain_vector_path()
    return lib if fast else None


def supports(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the attention kernel handles this shape (the norm and SwiGLU kernels handle any)."""
    return (kv_heads > 0 and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP
            and head_dim <= MAX_HEAD_DIM and head_dim % 16 == 0)
