"""The decode step's matmul forms: one weight times a few rows of activations, in the fastest of several
kernels for the CPU, dtype and row count (`fused.py`'s departure 2, docs/rollout.md "Matmul forms").

Each form is one small class (`MatmulForm`: `MM`, `MKLPacked`, `DNNPacked`, `MV`, `CGemm`, `AMXGemm`) holding one
(out, in) weight; `FORMS` names them, `make_projection` builds one. `projection_kind` is the static choice
(measured on an Intel Xeon), `tuning.tuned_kind` the one measured on the machine that runs; `compute_dtype`
picks the arithmetic dtype for small bf16/fp16 weights on a CPU (`fused.py`'s departure 10).
"""

from __future__ import annotations

import functools

from typing import ClassVar

import torch
from torch import Tensor

from posttrain.rollout.cpu import ckernels


def _mm(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return torch.mm(x, w) if b is None else torch.addmm(b, x, w)


# Packed-weight GEMMs: the private ATen ops `torch.compile`'s CPU weight freezing emits. Optional: when a
# torch build lacks them, every projection runs as `torch.mm`.
_HAS_MKL_PACK = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
_HAS_DNN_PACK = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
PACK_MIN_BYTES = 16 << 20  # tiny-1m (4 MB in fp32) stays on `mm`, tiny-30m (118 MB) packs


def compute_dtype(dtype: torch.dtype, device: torch.device, fp32_bytes: int) -> torch.dtype:
    """The dtype to multiply `dtype` weights in (departure 10): fp32 for bf16/fp16 weights on a CPU when
    their fp32 copies are under `PACK_MIN_BYTES` (cache-resident: the step is op overhead, and a bf16 GEMM
    costs ~25 µs a call however small — tiny-1m bf16, fp32 vs bf16 arithmetic: 1.69× at 8 rows, 1.26× at
    64, `benchmarks/rollout.py --variant compute=bf16`), else `dtype`."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and fp32_bytes < PACK_MIN_BYTES:
        return torch.float32
    return dtype


def projection_kind(dtype: torch.dtype, rows: int, device: torch.device, weight_bytes: int) -> str:
    """The static choice of a decode-step matmul form for `rows` rows (departure 2; docs/rollout.md),
    measured on an Intel Xeon (AVX-512, AMX); `tuning.tuned_kind` measures the machine it runs on.

    fp32: `mm`, except MKL's packed sgemm for 2–32 rows when the weights are at least `PACK_MIN_BYTES`
    (they stream from memory every step; ~25 % faster than `mm` at 8 rows, equal at 1 and 64 rows;
    on cache-resident weights its extra copy costs more than it saves). bf16: our matmul on AMX tiles where the
    CPU has them (`AMXGemm`: at 8–64 rows 1.1–1.6× oneDNN's, at 1 row 1.7× `mv`; docs/rollout.md), else
    oneDNN's packed GEMM (~1.2–1.5× `mm`, whose per-call cost is ~25 µs even for tiny matrices), except `mv`
    for one row of large weights (~1.3× `F.linear`).
    """
    if device.type != "cpu":
        return "mm"
    large = weight_bytes >= PACK_MIN_BYTES
    if dtype == torch.float32:
        return "mkl" if _HAS_MKL_PACK and large and 2 <= rows <= 32 else "mm"
    if dtype == torch.bfloat16:
        if ckernels.amx_library() is not None:
            return "amx"
        if rows == 1 and large:
            return "mv"
        return "dnn" if _dnn_packs(dtype) else "mm"
    return "mm"


class MatmulForm:
    """y = x·Wᵀ + b for one (out, in) weight in one decode matmul form; every form computes the same product.

    A form is chosen once per (dtype, rows) — statically (`projection_kind`) or by measurement
    (`tuning.tuned_kind`) — and built for every decode matmul by `make_projection`; the decode step then
    calls `into` / `add_to` / `__call__` without asking which form it holds. A form says, as class
    attributes, its `kind` (the recipe's `matmul:` value and the tuner's cache entry), whether the prefill
    multiplies by its weights too (`packs_for_prefill`), and, as class methods, whether this torch build
    can run it (`available`) and whether a build for some rows serves another row count (`reuses`).
    `w` is (out, in) contiguous, HF's layout; `b` (out,) or None.
    """

    kind: ClassVar[str]
    packs_for_prefill: ClassVar[bool] = False  # a packed layout that also beats `F.linear` at prefill sizes

    def __init__(self, w: Tensor, b: Tensor | None, rows: int):
        self.w, self.b, self.rows = w.contiguous(), b, rows
        self.in_features, self.dtype = w.shape[1], w.dtype
        self.packed: Tensor | None = None  # the form's own copy of the weight, where it keeps one

    @classmethod
    def available(cls, dtype: torch.dtype, rows: int) -> bool:
        """Whether this torch build (and machine) runs the form for `dtype` weights and `rows` rows."""
        return True

    @classmethod
    def reuses(cls, built_rows: int, rows: int) -> bool:
        """Whether a build for `built_rows` rows serves `rows` rows (packing costs ~one pass over the weights)."""
        return built_rows == rows

    def __call__(self, x: Tensor) -> Tensor:
        """x (R, in) → (R, out), a new tensor."""
        raise NotImplementedError

    def into(self, x: Tensor, out: Tensor) -> None:
        """out ← x·Wᵀ + b (out: (R, out) contiguous)."""
        out.copy_(self(x))

    def add_to(self, x: Tensor, h: Tensor) -> None:
        """h += x·Wᵀ + b, in place (the residual stream)."""
        h.add_(self(x))


class MM(MatmulForm):
    """`torch.mm` on a pre-transposed (in, out) copy, writing into the step's buffers; any rows."""

    kind = "mm"

    def __init__(self, w: Tensor, b: Tensor | None, rows: int):
        super().__init__(w, b, rows)
        self.w = w.t().contiguous()                                        # (in, out)

    @classmethod
    def reuses(cls, built_rows: int, rows: int) -> bool:
        return True

    def __call__(self, x: Tensor) -> Tensor:
        return _mm(x, self.w, self.b)

    def into(self, x: Tensor, out: Tensor) -> None:
        if self.b is None:
            torch.mm(x, self.w, out=out)
        else:
            torch.addmm(self.b, x, self.w, out=out)

    def add_to(self, x: Tensor, h: Tensor) -> None:
        h.addmm_(x, self.w)
        if self.b is not None:
            h.add_(self.b)


class MKLPacked(MatmulForm):
    """MKL's packed sgemm (fp32), packed for exactly `rows` rows: MKL would fall back to `F.linear` for
    another count, so fewer rows are zero-padded up to `rows` (at these sizes the GEMM streams the weights
    whatever the row count, and repacking costs ~7 decode steps)."""

    kind = "mkl"

    def __init__(self, w: Tensor, b: Tensor | None, rows: int):
        super().__init__(w, b, rows)
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
        self._pad: Tensor | None = None

    @classmethod
    def available(cls, dtype: torch.dtype, rows: int) -> bool:
        return dtype == torch.float32 and _HAS_MKL_PACK

    @classmethod
    def reuses(cls, built_rows: int, rows: int) -> bool:
        return rows <= built_rows < 2 * rows                                  # pads up; repacks below half

    def __call__(self, x: Tensor) -> Tensor:
        rows = x.shape[0]
        if rows == self.rows:
            return torch.ops.mkl._mkl_linear(x, self.packed, self.w, self.b, self.rows)
        if rows > self.rows:
            raise ValueError(f"Projection: {rows} rows but packed for at most {self.rows}")
        if self._pad is None:
            self._pad = x.new_zeros(self.rows, x.shape[1])
        self._pad[:rows].copy_(x)
        return torch.ops.mkl._mkl_linear(self._pad, self.packed, self.w, self.b, self.rows)[:rows]


class DNNPacked(MatmulForm):
    """oneDNN's packed GEMM (fp32 or bf16, AMX where the CPU has it); `rows` is a packing hint only."""

    kind = "dnn"
    packs_for_prefill = True

    def __init__(self, w: Tensor, b: Tensor | None, rows: int):
        super().__init__(w, b, rows)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)

    @classmethod
    def available(cls, dtype: torch.dtype, rows: int) -> bool:
        return dtype in (torch.float32, torch.bfloat16) and _dnn_packs(dtype)

    @classmethod
    def reuses(cls, built_rows: int, rows: int) -> bool:
        return True

    def __call__(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.b, "none", [], "")


@functools.cache
def _dnn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs `dtype` weights on this CPU. Its bf16 path needs AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT and raises elsewhere (an AVX2-only AMD EPYC, say), so it is probed once, on a
    16 × 16 weight, rather than assumed from the torch build."""
    if not _HAS_DNN_PACK:
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


class MV(MatmulForm):
    """Matrix-vector on the (out, in) copy itself, for one row."""

    kind = "mv"

    def __init__(self, w: Tensor, b: Tensor | None, rows: int):
        if rows != 1:
            raise ValueError(f"Projection: kind='mv' needs rows=1, got {rows}")
        super().__init__(w, b, rows)

    @classmethod
    def available(cls, dtype: torch.dtype, rows: int) -> bool:
        return rows == 1

    def __call__(self, x: Tensor) -> Tensor:
        y = torch.mv(self.w, x[0])[None]
        return y if self.b is None else y.add_(self.b)

    def into(self, x: Tensor, out: Tensor) -> None:
        torch.mv(self.w, x[0], out=out[0])
        if self.b is not None:
            out.add_(self.b)

    def add_to(self, x: Tensor, h: Tensor) -> None:
        h[0].addmv_(self.w, x[0])
        if self.b is not None:
            h.add_(self.b)


class CGemm(MatmulForm):
    """Our C kernel (`ckernels.py`), fp32 or bf16, on weights packed in blocks of 16 columns; any rows,
    bias and residual add fused (bf16: one rounding)."""

    kind = "c"
    packs_for_prefill = True

    def __init__(self, w: Tensor, b: Tensor | None, rows: int):
        super().__init__(w, b, rows)
        self._lib = ckernels.gemm_library(w.dtype)
        if self._lib is None or w.device.type != "cpu" or (w.dtype == torch.bfloat16 and w.shape[1] % 2):
            raise ValueError(f"Projection: kind='c' needs fp32 or bf16 CPU weights (bf16: an even input size) "
                             f"and the C kernels' vector code for them (ckernels.gemm_library); got {w.dtype}")
        n, k = self.w.shape
        bf16 = w.dtype == torch.bfloat16
        self.packed = torch.empty(self._lib.posttrain_packed_elements(n, k), dtype=w.dtype)
        (self._lib.posttrain_pack_bf16 if bf16 else self._lib.posttrain_pack_f32)(
            n, k, self.w.data_ptr(), self.packed.data_ptr(), torch.get_num_threads())
        self._gemm = self._lib.posttrain_gemm_bf16 if bf16 else self._lib.posttrain_gemm_f32
        self._shape, self._bias = (n, k), (None if b is None else b.to(w.dtype).contiguous())

    @classmethod
    def available(cls, dtype: torch.dtype, rows: int) -> bool:
        return ckernels.gemm_library(dtype) is not None

    @classmethod
    def reuses(cls, built_rows: int, rows: int) -> bool:
        return True

    def _c(self, x: Tensor, out: Tensor, accumulate: bool) -> None:
        """out (+)= x·Wᵀ + b by the C kernel; x and out in the weight's dtype, rows contiguous."""
        if x.dtype != self.packed.dtype or out.dtype != self.packed.dtype or out.stride(-1) != 1:
            raise TypeError(f"Projection kind='c' multiplies {self.packed.dtype}, got x {x.dtype}, out {out.dtype}")
        x = x if x.stride(-1) == 1 else x.contiguous()
        n, k = self._shape
        if x.shape[1] != k or out.shape[1] != n or out.shape[0] != x.shape[0]:  # the kernel trusts the sizes
            raise ValueError(f"Projection kind='c': x {tuple(x.shape)} → out {tuple(out.shape)} for a {n} × {k} weight")
        self._gemm(x.shape[0], n, k, x.data_ptr(), x.stride(0), self.packed.data_ptr(),
                   None if self._bias is None else self._bias.data_ptr(), out.data_ptr(), out.stride(0),
                   int(accumulate), torch.get_num_threads())

    def __call__(self, x: Tensor) -> Tensor:
        out = x.new_empty(x.shape[0], self._shape[0])
        self._c(x, out, False)
        return out

    def into(self, x: Tensor, out: Tensor) -> None:
        self._c(x, out, False)

    def add_to(self, x: Tensor, h: Tensor) -> None:
        self._c(x, h, True)


class AMXGemm(CGemm):
    """Our bf16 matmul on AMX tiles (Intel Xeon, Sapphire Rapids and later): `CGemm`'s packed layout, whose
    pair lines are AMX weight-tile rows, multiplied 16 rows × 16 pairs × 16 columns an instruction
    (`kernels/decode.c`, `posttrain_gemm_bf16_amx`); bias and residual fused, one rounding, as `c`."""

    kind = "amx"

    def __init__(self, w: Tensor, b: Tensor | None, rows: int):
        if not self.available(w.dtype, rows):
            raise ValueError(f"Projection: kind='amx' needs bf16 weights and a CPU with AMX tiles that Linux lets "
                             f"this process use (ckernels.amx_library); got {w.dtype}")
        super().__init__(w, b, rows)
        self._gemm = self._lib.posttrain_gemm_bf16_amx

    @classmethod
    def available(cls, dtype: torch.dtype, rows: int) -> bool:
        return dtype == torch.bfloat16 and ckernels.amx_library() is not None


FORMS: dict[str, type[MatmulForm]] = {f.kind: f for f in (MM, MKLPacked, DNNPacked, MV, CGemm, AMXGemm)}  # the tuner's order
PROJECTION_KINDS = tuple(FORMS)


def form_of(kind: str) -> type[MatmulForm]:
    """The form class named `kind` (a recipe's or the tuner's `matmul:` value)."""
    form = FORMS.get(kind)
    if form is None:
        raise ValueError(f"Projection: kind={kind!r}; expected one of {PROJECTION_KINDS}")
    return form


def make_projection(w: Tensor, b: Tensor | None, kind: str, rows: int) -> MatmulForm:
    """One (out, in) weight `w` (bias `b`) in form `kind`, for `rows` rows (a hint for most forms)."""
    return form_of(kind)(w, b, rows)
