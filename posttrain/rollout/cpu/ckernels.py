"""C kernels for the CPU decode step, compiled on the machine that runs them and loaded with ctypes.

Between its matmuls a fused decode step (`fused.DecodePlan`) runs a dozen small ops per layer, and on
a CPU each costs a fixed few µs or streams its operands at a fraction of the memory's bandwidth.
PyTorch has no fused attention for one new token per row on a CPU: its decode attention is six ops
per layer (two RoPE multiplies, a cache copy, `baddbmm`, `softmax`, `bmm`), and the batched GEMMs run
each (row, KV head) as its own tiny product. `kernels/decode.c` does those six in one call (its
header gives the layouts), an RMSNorm in one call instead of three to five, and SwiGLU's
silu(gate)·up in one instead of two, reading and writing bf16 directly where the weights are bf16
(no fp32 copies). It also holds matmuls over weights packed in blocks of 16 columns — bf16 on
AVX512-BF16 dot products, fp32 on AVX-512 FMAs (`projections.CGemm`, form `c`), and bf16 on AMX tiles
over the same packing (`projections.AMXGemm`, form `amx`, where the CPU has them) — which the tuner
measures beside MKL's and oneDNN's. On the 2-core AMD EPYC, 64 rows × tiny-30m's heads at 50 positions and 10 layers'
caches, one layer's attention takes ~0.4–0.5 ms against ~0.8–0.9 ms for the six ops
(benchmarks/README.md has the measurements).

The source ships with the package and is built on first use by `posttrain.native` (the build, its
cache and its fallback are described there). No compiler, a failed build or `POSTTRAIN_C_KERNELS=0`
leave the PyTorch ops in place (a warning says why, once per process).
"""

from __future__ import annotations

import ctypes
import os
from importlib import resources
from pathlib import Path

import torch

from posttrain import native
from posttrain.native import ENV_DISABLE, BuildError

__all__ = ["ENV_DISABLE", "BuildError", "amx_library", "build", "decode_library", "gemm_library", "supports"]
MAX_HEAD_DIM, MAX_GROUP = 512, 64  # the C source's limits
_loaded: dict[bool, ctypes.CDLL | None] = {}


def _source() -> bytes:
    return resources.files("posttrain.rollout.cpu").joinpath("kernels/decode.c").read_bytes()


def build(generic: bool = False) -> Path:
    """Compile the decode kernels (or find them built); the path of the shared library (`native.build`)."""
    return native.build("decode", _source(), generic)


_I, _P, _N, _F = ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_float
_GEMM = (_I, _I, _I, _P, _N, _P, _P, _P, _N, _I, _I)
SIGNATURES = {  # name: (result, arguments), as in kernels/decode.c
    "posttrain_decode_attention": (_I, (_I, _I, _I, _I, _I, _I, _P, _I, _N, _P, _P, _P, _I, _P, _P, _P, _I, _I, _P,
                                        _F, _P, _I, _N, _P, _I)),
    "posttrain_scratch_floats": (_N, (_I, _I, _I)),
    "posttrain_vector_path": (_I, ()),
    "posttrain_bf16_dot_path": (_I, ()),
    "posttrain_rms_norm": (_I, (_I, _I, _P, _I, _F, _P, _I, _I)),
    "posttrain_silu_mul": (_I, (_I, _I, _P, _P, _I, _I)),
    "posttrain_packed_elements": (_N, (_I, _I)),
    "posttrain_fold_bf16": (_I, (_I, _I, _P, _P, _P, _P, _I)),
    "posttrain_pack_bf16": (_I, (_I, _I, _P, _P, _I)),
    "posttrain_pack_f32": (_I, (_I, _I, _P, _P, _I)),
    "posttrain_gemm_bf16": (_I, _GEMM),
    "posttrain_amx_path": (_I, ()),
    "posttrain_gemm_bf16_amx": (_I, _GEMM),
    "posttrain_gemm_f32": (_I, _GEMM),
}


def decode_library(generic: bool = False) -> ctypes.CDLL | None:
    """The loaded kernel library, or None where it cannot be built (warned once) or is turned off."""
    if os.environ.get(ENV_DISABLE) == "0":
        return None
    if generic not in _loaded:
        _loaded[generic] = native.load("decode", _source(), SIGNATURES, generic, "decode")
    return _loaded[generic]


def gemm_library(dtype: torch.dtype) -> ctypes.CDLL | None:
    """The library, where its matmul for `dtype` weights is vector code (the `c` projection form): fp32 on
    AVX-512, bf16 on AVX512-BF16 dot products; else None (the plain-C loops are for tests only)."""
    lib = decode_library()
    if lib is None or dtype not in (torch.float32, torch.bfloat16):
        return None
    fast = lib.posttrain_bf16_dot_path() if dtype == torch.bfloat16 else lib.posttrain_vector_path()
    return lib if fast else None


def amx_library() -> ctypes.CDLL | None:
    """The library, where its bf16 matmul on AMX tiles runs (the `amx` projection form): built with AMX and on a
    CPU whose tile state Linux grants this process; else None."""
    lib = gemm_library(torch.bfloat16)
    return lib if lib is not None and lib.posttrain_amx_path() else None


def supports(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the attention kernel handles this shape (the norm and SwiGLU kernels handle any)."""
    return (kv_heads > 0 and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP
            and head_dim <= MAX_HEAD_DIM and head_dim % 16 == 0)
