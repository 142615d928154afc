"""Hand-written C kernels: shipped as source, compiled on the machine that runs them, loaded with ctypes.

Each kernel stands beside a plain PyTorch path that stays the reference (its tests compare the two) and
the fallback: no C compiler, a failed build or `POSTTRAIN_C_KERNELS=0` leave the PyTorch ops in place,
with a warning that says why, once per library and process. The libraries:
- `decode` (posttrain/rollout/cpu/kernels/decode.c, through `rollout/cpu/ckernels.py`): the CPU decode
  step's attention, norms, SwiGLU and packed matmuls;
- `softmax` (kernels/softmax.c, through `native/softmax.py`): the training attention's masked softmax
  and its backward, bf16 in and out (`models/prefix_attention.py`);
- `swiglu` (kernels/swiglu.c, `native/swiglu.py`): the gated MLP's elementwise backward (`models/fused_mlp.py`);
- `rmsnorm` (kernels/rmsnorm.c, `native/rmsnorm.py`): the fused RMSNorm's backward (`models/fused_norm.py`);
- `rope` (kernels/rope.c, `native/rope.py`): the rotary embedding, forward and backward (`models/fused_attention.py`);
- `logprobs` (kernels/logprobs.c, `native/logprobs.py`): token log-probs, entropies and the log-probs' gradient
  over the vocabulary (`losses/logprobs.py`);
- `adamw` (kernels/adamw.c, `native/adamw.py`): AdamW's step over fp32 parameters, writing their bf16 copies
  (`stages/_adamw.py`);
- `widen` (kernels/widen.c, `native/widen.py`): a bf16 weight gradient widened to its fp32 parameter's dtype
  (`models/_fused.weight_grad`).
The last seven are `Library` objects: built and loaded on first use, once per build kind.

A source is built as one translation unit behind `kernels/common.h` (bf16 casts, exp, the AVX-512
loads and stores) with the system C compiler (`$CC`, else `cc`, else `gcc`): `-O3 -march=native
-fopenmp`, into `<cache_dir>/kernels/`, named by a hash of the sources, the flags, the compiler's version
and the CPU — a fresh build whenever one of them changes, under a second once per machine. `-fopenmp`
links `libgomp.so.1`, which resolves to the copy PyTorch already loaded, so a kernel shares PyTorch's
OpenMP thread pool.
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

from posttrain.telemetry.devices import cache_dir, cpu_name

ENV_DISABLE = "POSTTRAIN_C_KERNELS"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
Signatures = dict[str, tuple[object, tuple[object, ...]]]  # name: (ctypes result, ctypes arguments)


class BuildError(RuntimeError):
    pass


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _common() -> bytes:
    return resources.files("posttrain.native").joinpath("kernels/common.h").read_bytes()


def build(name: str, source: bytes, generic: bool = False) -> Path:
    """Compile `source` behind kernels/common.h into the shared library `name` (or find it built); its path.

    `generic` builds the plain-C loops even where AVX-512 is there (the tests check both paths).
    Raises `BuildError` with the compiler's message when it cannot.
    """
    cc = _compiler()
    if cc is None:
        raise BuildError("no C compiler ($CC, cc or gcc) on PATH")
    flags = [*FLAGS, *(["-DPOSTTRAIN_GENERIC"] if generic else [])]
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30,
                                 check=False).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        raise BuildError(f"{cc} --version failed: {err}") from err
    unit = _common() + b"\n" + source
    digest = hashlib.sha256(b"\0".join([unit, " ".join(flags).encode(), version.encode(),
                                        cpu_name().encode()])).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{name}-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    src = target.with_suffix(f".{os.getpid()}.c")
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    try:
        src.write_bytes(unit)
        done = subprocess.run([cc, *flags, "-o", str(tmp), str(src), "-lm"], capture_output=True, text=True, check=False,
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


def load(name: str, source: bytes, signatures: Signatures, generic: bool, what: str) -> ctypes.CDLL | None:
    """Build and load library `name` with its functions' `signatures` bound; None where it cannot be built
    or loaded (a warning names `what` falls back and why) or where `POSTTRAIN_C_KERNELS=0`. Not cached:
    the caller keeps the library it got."""
    if os.environ.get(ENV_DISABLE) == "0":
        return None
    try:
        lib = ctypes.CDLL(str(build(name, source, generic)))
    except (BuildError, OSError) as err:
        warnings.warn(f"posttrain: the C {what} kernels are unavailable, using PyTorch ops ({err})",
                      RuntimeWarning, stacklevel=3)
        return None
    for fn_name, (result, arguments) in signatures.items():
        fn = getattr(lib, fn_name)
        fn.restype, fn.argtypes = result, list(arguments)
    return lib


class Library:
    """One kernel source under kernels/, built and loaded on first use, once per build kind (the vector code
    where the CPU has it, or `generic`: the plain-C loops), with its functions' signatures bound."""

    def __init__(self, name: str, signatures: Signatures, what: str):
        self.name, self.signatures, self.what = name, signatures, what
        self._loaded: dict[bool, ctypes.CDLL | None] = {}

    def source(self) -> bytes:
        return resources.files("posttrain.native").joinpath(f"kernels/{self.name}.c").read_bytes()

    def get(self, generic: bool = False) -> ctypes.CDLL | None:
        """The loaded library, or None where it cannot be built (warned once) or is turned off."""
        if os.environ.get(ENV_DISABLE) == "0":
            return None
        if generic not in self._loaded:
            self._loaded[generic] = load(self.name, self.source(), self.signatures, generic, self.what)
        return self._loaded[generic]
