"""The decode step's C kernels against the PyTorch ops they replace, per layer, in one process.

    python benchmarks/decode_kernels.py                     # tiny-30m's shapes, rows 1 / 16 / 64
    python benchmarks/decode_kernels.py --rows 64 --layers 1 --positions 80

Attention: RoPE on the new query heads and key, key and value into the cache, scores + pad mask,
softmax, value sum — `DecodePlan._attention_torch`'s six ops vs one `posttrain_decode_attention`
call. `--layers` caches are cycled, as a step walks its layers, so with several they stream from
memory (one fits in the L3 cache). RMSNorm (bf16 residual → bf16 matmul input) and silu(gate)·up
(bf16) are timed the same way. The two sides alternate (C, torch, C, torch); each figure is µs per
layer, the median over the repetitions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from posttrain.rollout.cpu import ckernels


def timed(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - t0) / calls * 1e6


def attention_case(lib, rows: int, layers: int, positions: int, hq: int, hkv: int, d: int, threads: int):
    g = torch.Generator().manual_seed(0)
    cap, slot, group = positions + 8, positions - 1, hq // hkv
    keys = [torch.randn(rows, hkv, cap, d, generator=g) for _ in range(layers)]
    values = [torch.randn(rows, hkv, cap, d, generator=g) for _ in range(layers)]
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=g)
    rot = torch.polar(torch.ones(rows, d // 2), torch.rand(rows, d // 2, generator=g) * 6.3)
    key_mask = torch.ones(rows, cap, dtype=torch.bool)
    key_mask[::3, :4] = False                                          # some rows' left pads
    bias_rows = torch.zeros(rows, cap).masked_fill_(~key_mask, float("-inf"))
    out = torch.empty(rows, hq * d)
    scratch = torch.empty(threads, lib.posttrain_scratch_floats(group, cap, d))

    def c(i: int) -> None:
        i %= layers
        lib.posttrain_decode_attention(rows, hq, hkv, d, cap, slot, qkv.data_ptr(), 0, qkv.shape[1], rot.data_ptr(),
                                       keys[i].data_ptr(), values[i].data_ptr(), 0, None, None, None, 0, 1,
                                       bias_rows.data_ptr(),
                                       d ** -0.5, out.data_ptr(), 0, out.shape[1], scratch.data_ptr(), threads)

    as_c = lambda t, *shape: torch.view_as_complex(t.view(*shape, d // 2, 2))
    q_c, k_c = as_c(qkv[:, : hq * d], rows, hq), as_c(qkv[:, hq * d: (hq + hkv) * d], rows, hkv)
    v_new = qkv[:, (hq + hkv) * d:].view(rows, hkv, d)
    qr = torch.empty(rows, hq * d)
    qr_c, q3, out3 = as_c(qr, rows, hq), qr.view(rows * hkv, group, d), out.view(rows * hkv, group, d)
    k_cache_c = [as_c(k, rows, hkv, cap) for k in keys]
    k_flat = [k.view(rows * hkv, cap, d) for k in keys]
    v_flat = [v.view(rows * hkv, cap, d) for v in values]
    bias = bias_rows[:, None, None, :].expand(rows, hkv, 1, cap).reshape(rows * hkv, 1, cap)
    rot_b = rot[:, None]

    def torch_ops(i: int) -> None:                                     # as DecodePlan._attention_torch
        i %= layers
        torch.mul(q_c, rot_b, out=qr_c)
        torch.mul(k_c, rot_b, out=k_cache_c[i].select(2, slot))
        values[i].select(2, slot).copy_(v_new)
        scores = torch.baddbmm(bias[:, :, : slot + 1], q3, k_flat[i][:, : slot + 1].mT, alpha=d ** -0.5)
        torch.bmm(scores.softmax(-1), v_flat[i][:, : slot + 1], out=out3)

    return c, torch_ops


def norm_case(lib, rows: int, hidden: int, threads: int):
    h = torch.randn(rows, hidden).bfloat16()
    x = torch.empty_like(h)
    h32, ms = torch.empty(rows, hidden), torch.empty(rows, 1)

    def c(i: int) -> None:
        lib.posttrain_rms_norm(rows, hidden, h.data_ptr(), 1, 1e-6, x.data_ptr(), 1, threads)

    def torch_ops(i: int) -> None:                                     # as DecodePlan._norm_torch (mean form)
        h32.copy_(h)
        torch.mean(h32.square(), -1, keepdim=True, out=ms)
        ms.add_(1e-6).rsqrt_()
        torch.mul(h32, ms, out=x)

    return c, torch_ops


def swiglu_case(lib, rows: int, inter: int, threads: int):
    gu = torch.randn(rows, 2 * inter).bfloat16()
    act = torch.empty(rows, inter).bfloat16()
    gate, up = gu[:, :inter], gu[:, inter:]

    def c(i: int) -> None:
        lib.posttrain_silu_mul(rows, inter, gu.data_ptr(), act.data_ptr(), 1, threads)

    def torch_ops(i: int) -> None:                                     # as DecodePlan._swiglu_torch
        F.silu(gate, inplace=True)
        torch.mul(gate, up, out=act)

    return c, torch_ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--layers", type=int, default=10, help="caches cycled (10: tiny-30m's, streaming from memory)")
    ap.add_argument("--positions", type=int, default=50, help="positions attended to")
    ap.add_argument("--heads", type=int, nargs=3, default=[8, 4, 64], metavar=("HQ", "HKV", "D"))
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lib = ckernels.decode_library()
    if lib is None:
        raise SystemExit("the C kernels did not build (see the warning); nothing to compare")
    hq, hkv, d = a.heads
    print(f"# decode kernels, C vs PyTorch ops, µs per layer (median of {a.reps}); {a.threads} threads, "
          f"{hq} query / {hkv} KV heads of {d}, {a.positions} positions, {a.layers} layers' caches cycled; "
          f"vector path: {bool(lib.posttrain_vector_path())}")
    print("| op | rows | C | PyTorch ops | speed-up |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for rows in a.rows:
            cases = {"attention": attention_case(lib, rows, a.layers, a.positions, hq, hkv, d, a.threads),
                     "RMSNorm (bf16)": norm_case(lib, rows, a.hidden, a.threads),
                     "silu(gate)·up (bf16)": swiglu_case(lib, rows, a.intermediate, a.threads)}
            for name, (c, ref) in cases.items():
                calls = max(a.layers * 3, 200 // max(1, rows // 8))
                timed(c, calls), timed(ref, calls)                     # warm-up
                got = {"c": [], "torch": []}
                for _ in range(a.reps):
                    got["c"].append(timed(c, calls))
                    got["torch"].append(timed(ref, calls))
                mc, mt = statistics.median(got["c"]), statistics.median(got["torch"])
                print(f"| {name} | {rows} | {mc:,.1f} | {mt:,.1f} | {mt / mc:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
