"""The C decode kernels (`rollout/ckernels.py`, `rollout/kernels/decode.c`) against PyTorch ops, both
builds (AVX-512 where the CPU has it, and the plain-C loops), and their build's failure modes."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from posttrain.rollout.cpu import ckernels


@pytest.fixture(scope="module", params=[False, True], ids=["native", "generic"])
def lib(request):
    got = ckernels.decode_library(generic=request.param)
    assert got is not None, "the C kernels did not build (scripts/test.sh installs a compiler)"
    if request.param:
        assert got.posttrain_vector_path() == 0
    return got


def _attention_reference(qkv, rot, k, v, key_mask, slot, hq, hkv, d, scaling, rounded=False):
    """What DecodePlan's PyTorch ops compute: RoPE on adjacent pairs, then masked softmax attention.
    `rounded`: k and v already hold the new slot (as a bf16 cache stores it); it is not overwritten."""
    rows = qkv.shape[0]
    heads = qkv.float().view(rows, hq + 2 * hkv, d // 2, 2)
    c, s = rot[..., 0][:, None], rot[..., 1][:, None]                  # (R, 1, D/2)
    a, b = heads[..., 0], heads[..., 1]
    rotated = torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)  # (R, heads, D)
    q, k_new, v_new = rotated[:, :hq], rotated[:, hq:hq + hkv], heads[:, hq + hkv:].flatten(-2)
    k, v = k.clone(), v.clone()
    if not rounded:
        k[:, :, slot], v[:, :, slot] = k_new, v_new
    keys = k[:, :, : slot + 1].repeat_interleave(hq // hkv, 1)         # (R, Hq, S, D)
    values = v[:, :, : slot + 1].repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("rhd,rhsd->rhs", q.double(), keys.double()) * scaling
    scores = scores.masked_fill(~key_mask[:, None, : slot + 1], float("-inf"))
    out = torch.einsum("rhs,rhsd->rhd", scores.softmax(-1), values.double())
    return out.reshape(rows, hq * d), k, v


@pytest.mark.parametrize("rows, hq, hkv, d, slot, dtype", [
    (3, 4, 4, 32, 6, torch.float32),     # tiny-1m's heads
    (5, 8, 4, 64, 20, torch.float32),    # tiny-30m's (GQA 2), a slot past a 16-wide softmax block
    (2, 6, 2, 48, 16, torch.float32),    # a head of 3 × 16 (a partial register block), GQA 3
    (4, 8, 4, 64, 33, torch.bfloat16),   # bf16 projections in, bf16 attention out
    (1, 2, 1, 128, 0, torch.float32),    # one row, the first slot: attends to itself only
])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_equals_the_pytorch_ops(lib, rows, hq, hkv, d, slot, dtype, kv_dtype):
    g = torch.Generator().manual_seed(rows * 100 + d)
    cap = slot + 3
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=g).to(dtype)
    angle = torch.rand(rows, d // 2, generator=g) * 6.3
    rot = torch.stack([angle.cos(), angle.sin()], -1).contiguous()     # (R, D/2, 2)
    k = torch.randn(rows, hkv, cap, d, generator=g).to(kv_dtype)
    v = torch.randn(rows, hkv, cap, d, generator=g).to(kv_dtype)
    key_mask = torch.ones(rows, cap, dtype=torch.bool)
    key_mask[0, : min(3, slot)] = False                                 # row 0: left pads
    ref, k_ref, v_ref = _attention_reference(qkv, rot, k.float(), v.float(), key_mask, slot, hq, hkv, d, d ** -0.5)
    if kv_dtype == torch.bfloat16:                                      # what a bf16 cache holds: the new key rounded
        k_ref[:, :, slot], v_ref[:, :, slot] = k_ref[:, :, slot].bfloat16().float(), v_ref[:, :, slot].bfloat16().float()
        ref = _attention_reference(qkv, rot, k_ref, v_ref, key_mask, slot, hq, hkv, d, d ** -0.5, rounded=True)[0]
    bias = torch.zeros(rows, cap).masked_fill_(~key_mask, float("-inf"))
    out = torch.full((rows, hq * d), float("nan")).to(dtype)
    scratch = torch.empty(2, lib.posttrain_scratch_floats(hq // hkv, cap, d))
    bf16 = int(dtype == torch.bfloat16)
    assert lib.posttrain_decode_attention(rows, hq, hkv, d, cap, slot, qkv.data_ptr(), bf16, qkv.shape[1],
                                          rot.data_ptr(), k.data_ptr(), v.data_ptr(), int(kv_dtype == torch.bfloat16),
                                          None, None, None, 0, 1, bias.data_ptr(),
                                          d ** -0.5, out.data_ptr(), bf16, out.shape[1], scratch.data_ptr(), 2) == 0
    # fp32: another summation order → ~1e-6 on outputs of size ~1; bf16: one rounding of the output
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (out.double() - ref).abs().max() <= tol
    assert torch.allclose(k.float(), k_ref, atol=1e-6) and torch.allclose(v.float(), v_ref, atol=1e-6)  # slot written


@pytest.mark.parametrize("share, plen, slot, row_of", [
    (4, 13, 6, None),          # a prompt's 4 samples; a prefix that is not a whole number of 4-key blocks
    (3, 8, 0, None),           # the first decode slot: the prefix and the new key only
    (2, 21, 17, [5, 0, 3]),    # compacted: running rows read cache rows 5, 0, 3 (prefix rows 2, 0, 1)
])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_over_a_shared_prefix_is_the_expanded_cache(lib, share, plen, slot, row_of, kv_dtype):
    """Keys and values held once per prompt (`prefix`, read by its `share` samples) give the bits of the same
    keys copied into every row's cache ahead of its own, and write the new key into the row's own cache."""
    hq, hkv, d, cap, prompts = 8, 4, 64, slot + 5, 3
    cache_rows = prompts * share
    rows = cache_rows if row_of is None else len(row_of)
    g = torch.Generator().manual_seed(plen * 10 + slot)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=g).to(torch.bfloat16)
    angle = torch.rand(rows, d // 2, generator=g) * 6.3
    rot = torch.stack([angle.cos(), angle.sin()], -1).contiguous()
    pk, pv = (torch.randn(prompts, hkv, plen, d, generator=g).to(kv_dtype) for _ in range(2))
    own_k, own_v = (torch.randn(cache_rows, hkv, cap, d, generator=g).to(kv_dtype) for _ in range(2))
    full_k, full_v = (torch.cat([p.repeat_interleave(share, 0), o], 2) for p, o in ((pk, own_k), (pv, own_v)))
    key_mask = torch.ones(rows, plen + cap, dtype=torch.bool)
    key_mask[0, :3] = False                                             # row 0's prompt: left pads
    bias = torch.zeros(rows, plen + cap).masked_fill_(~key_mask, float("-inf"))
    of = None if row_of is None else torch.tensor(row_of, dtype=torch.int64)
    kv_bf16 = int(kv_dtype == torch.bfloat16)

    def attend(k, v, prefix, width, at_slot):
        out = torch.full((rows, hq * d), float("nan"), dtype=torch.bfloat16)
        scratch = torch.empty(2, lib.posttrain_scratch_floats(hq // hkv, plen + cap, d))
        p_k, p_v, n = (None, None, 0) if prefix is None else (prefix[0].data_ptr(), prefix[1].data_ptr(), plen)
        assert lib.posttrain_decode_attention(rows, hq, hkv, d, width, at_slot, qkv.data_ptr(), 1, qkv.shape[1],
                                              rot.data_ptr(), k.data_ptr(), v.data_ptr(), kv_bf16,
                                              None if of is None else of.data_ptr(), p_k, p_v, n, share,
                                              bias.data_ptr(), d ** -0.5, out.data_ptr(), 1, out.shape[1],
                                              scratch.data_ptr(), 2) == 0
        return out

    expanded = attend(full_k, full_v, None, plen + cap, plen + slot)
    shared = attend(own_k, own_v, (pk, pv), cap, slot)
    assert torch.equal(shared, expanded) and not shared.isnan().any()
    assert torch.equal(own_k, full_k[:, :, plen:]) and torch.equal(own_v, full_v[:, :, plen:])  # the new slot


def test_decode_attention_refuses_shapes_it_does_not_handle(lib):
    assert not ckernels.supports(8, 3, 64) and not ckernels.supports(8, 4, 40) and ckernels.supports(8, 4, 64)
    buf = torch.zeros(64)
    head = (buf.data_ptr(), 0, 8, buf.data_ptr(), buf.data_ptr(), buf.data_ptr(), 0, None)
    tail = (buf.data_ptr(), 1.0, buf.data_ptr(), 0, 8, buf.data_ptr(), 1)
    args = (*head, None, None, 0, 1, *tail)
    assert lib.posttrain_decode_attention(1, 4, 4, 40, 4, 0, *args) == -1   # head_dim not a multiple of 16
    assert lib.posttrain_decode_attention(1, 4, 4, 32, 4, 4, *args) == -1   # slot beyond the capacity
    assert lib.posttrain_decode_attention(1, 4, 4, 32, 4, 0, *head, None, None, 2, 1, *tail) == -1  # no prefix
    assert lib.posttrain_decode_attention(1, 4, 4, 32, 4, 0, *head, buf.data_ptr(), buf.data_ptr(), 1, 0,
                                          *tail) == -1                      # a prefix shared by no rows


@pytest.mark.parametrize("hidden, in_dtype, out_dtype", [(128, torch.float32, torch.float32),
                                                         (520, torch.bfloat16, torch.bfloat16),
                                                         (72, torch.float32, torch.bfloat16)])
def test_rms_norm_equals_the_pytorch_ops(lib, hidden, in_dtype, out_dtype):
    g = torch.Generator().manual_seed(hidden)
    h = (torch.randn(7, hidden, generator=g) * 3).to(in_dtype)
    x = torch.empty(7, hidden, dtype=out_dtype)
    assert lib.posttrain_rms_norm(7, hidden, h.data_ptr(), int(in_dtype == torch.bfloat16), 1e-6, x.data_ptr(),
                                  int(out_dtype == torch.bfloat16), 2) == 0
    h32 = h.float()
    ref = (h32 * torch.rsqrt(h32.square().mean(-1, keepdim=True) + 1e-6)).to(out_dtype)
    # fp32: ~1e-6 on values of size ~1; bf16 out: at most one bf16 ulp (2^-8 relative) from the reference's rounding
    assert torch.allclose(x.float(), ref.float(), rtol=1e-5 if out_dtype == torch.float32 else 8e-3, atol=1e-6)


@pytest.mark.parametrize("inter, dtype", [(352, torch.float32), (1408, torch.bfloat16), (20, torch.float32)])
def test_silu_mul_equals_the_pytorch_ops(lib, inter, dtype):
    g = torch.Generator().manual_seed(inter)
    gu = (torch.randn(5, 2 * inter, generator=g) * 4).to(dtype)
    gu[0, :3] = torch.tensor([-100.0, 100.0, 0.0])                      # e^-|g| underflows; silu(0) = 0
    act = torch.empty(5, inter, dtype=dtype)
    assert lib.posttrain_silu_mul(5, inter, gu.data_ptr(), act.data_ptr(), int(dtype == torch.bfloat16), 2) == 0
    gate, up = gu.float().chunk(2, -1)
    ref = F.silu(gate.double()) * up.double()
    # fp32: the polynomial exp's ~2e-7 relative error; bf16: one rounding of the product (2^-8 relative)
    rtol = 1e-5 if dtype == torch.float32 else 8e-3
    assert torch.allclose(act.double(), ref, rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, n, k, bias, accumulate", [(1, 40, 48, False, False), (8, 64, 512, True, False),
                                                      (13, 300, 96, True, True), (64, 33, 2, False, True)])
def test_packed_gemm_equals_the_product(lib, rows, n, k, bias, accumulate, dtype):
    """The packed matmuls (the `c` projection form), both builds: y (+)= x·Wᵀ + b."""
    g = torch.Generator().manual_seed(rows + n)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    out = torch.randn(rows, n, generator=g).to(dtype)
    start = out.clone()
    name = "bf16" if dtype == torch.bfloat16 else "f32"
    packed = torch.empty(lib.posttrain_packed_elements(n, k), dtype=dtype)
    assert getattr(lib, f"posttrain_pack_{name}")(n, k, w.data_ptr(), packed.data_ptr(), 2) == 0
    assert getattr(lib, f"posttrain_gemm_{name}")(rows, n, k, x.data_ptr(), k, packed.data_ptr(),
                                                  None if b is None else b.data_ptr(), out.data_ptr(), n,
                                                  int(accumulate), 2) == 0
    ref = x.double() @ w.double().T + (0 if b is None else b.double()) + (start.double() if accumulate else 0)
    # fp32 sums of k products: ~1e-6·√k; bf16: exact products summed in fp32, then one rounding (2^-8 relative)
    if dtype == torch.float32:
        assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5 * k ** 0.5)
    else:
        assert torch.allclose(out.double(), ref, rtol=2 ** -8, atol=1e-3 * k ** 0.5)


@pytest.mark.parametrize("rows, n, k, bias, accumulate", [
    (1, 40, 48, False, False),     # one tile step and 8 pairs on the dot products; one partial column group
    (16, 2816, 512, True, False),  # tiny-30m's gate/up at the GRPO benchmark's 16 rows: whole tiles
    (13, 300, 96, True, True),     # 19 blocks: 4 groups of 4, then 3 blocks one at a time
    (17, 100, 70, False, True),    # 16 rows then 1 (the tiles configured again); 35 pairs: 2 tile steps + 3
    (40, 64, 1408, True, True),    # 16 + 16 + 8 rows; k 1,408: 44 tile steps
    (32, 300, 96, True, False),    # 16 + 16 rows, the tiles configured once: 19 blocks, the last group's 3 one by one
    (70, 100, 70, False, True),    # 16 × 4 + 6 rows; 35 pairs: 2 tile steps + 3
    (3, 33, 2, False, False),      # one pair: no tile step at all
])
def test_amx_gemm_equals_the_product(rows, n, k, bias, accumulate):
    """The bf16 matmul on AMX tiles (the `amx` form) on `c`'s packed layout: y (+)= x·Wᵀ + b, and `c`'s
    result to within a rounding of either (both sum exact products in fp32, in different orders)."""
    lib = ckernels.amx_library()
    if lib is None:
        pytest.skip("no AMX tiles on this CPU (or not granted by the kernel)")
    g = torch.Generator().manual_seed(rows + n)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(rows, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    start = torch.randn(rows, n, generator=g).bfloat16()
    packed = torch.empty(lib.posttrain_packed_elements(n, k), dtype=torch.bfloat16)
    assert lib.posttrain_pack_bf16(n, k, w.data_ptr(), packed.data_ptr(), 2) == 0
    outs = {}
    for name in ("gemm_bf16_amx", "gemm_bf16"):
        outs[name] = start.clone()
        assert getattr(lib, f"posttrain_{name}")(rows, n, k, x.data_ptr(), k, packed.data_ptr(),
                                                  None if b is None else b.data_ptr(), outs[name].data_ptr(), n,
                                                  int(accumulate), 2) == 0
    ref = x.double() @ w.double().T + (0 if b is None else b.double()) + (start.double() if accumulate else 0)
    got = outs["gemm_bf16_amx"].double()
    assert torch.allclose(got, ref, rtol=2 ** -8, atol=1e-3 * k ** 0.5)
    assert torch.allclose(got, outs["gemm_bf16"].double(), rtol=2 ** -7, atol=2e-3 * k ** 0.5)


def test_amx_gemm_refuses_where_it_cannot_run():
    """The plain-C build has no AMX path: it says so, and its matmul returns -1 without writing."""
    lib = ckernels.decode_library(generic=True)
    assert lib.posttrain_amx_path() == 0
    x, out = torch.ones(2, 32, dtype=torch.bfloat16), torch.zeros(2, 16, dtype=torch.bfloat16)
    packed = torch.ones(lib.posttrain_packed_elements(16, 32), dtype=torch.bfloat16)
    assert lib.posttrain_gemm_bf16_amx(2, 16, 32, x.data_ptr(), 32, packed.data_ptr(), None, out.data_ptr(), 16, 0, 1) == -1
    assert not out.any()


@pytest.mark.parametrize("n, k", [(48, 8), (33, 6), (5, 2), (33, 70), (20, 64)])  # 70, 64: 16 pairs at a time, then the rest
def test_bf16_packing_is_the_documented_layout(lib, n, k):
    """packed[((c / 16)·(k/2) + p)·32 + (c % 16)·2 + i] = W[c, 2p + i], zero columns padding n to whole blocks."""
    w = torch.randint(1, 2**15, (n, k), dtype=torch.int16).view(torch.bfloat16)  # every bit pattern nonzero
    packed = torch.full((lib.posttrain_packed_elements(n, k),), float("nan"), dtype=torch.bfloat16)
    assert lib.posttrain_pack_bf16(n, k, w.data_ptr(), packed.data_ptr(), 2) == 0
    blocks = -(-n // 16)
    padded = torch.cat([w, torch.zeros(blocks * 16 - n, k, dtype=w.dtype)])
    want = padded.view(blocks, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(-1)
    assert torch.equal(packed.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("n, k", [(48, 8), (33, 35), (20, 16)])  # 35, 16: 16 inputs at a time, then the rest
def test_f32_packing_is_the_documented_layout(lib, n, k):
    """packed[((c / 16)·k + i)·16 + c % 16] = W[c, i], zero columns padding n to whole blocks."""
    w = torch.randint(1, 2**31 - 1, (n, k), dtype=torch.int32)                      # every bit pattern nonzero
    packed = torch.full((lib.posttrain_packed_elements(n, k),), -1, dtype=torch.int32)
    assert lib.posttrain_pack_f32(n, k, w.data_ptr(), packed.data_ptr(), 2) == 0
    blocks = -(-n // 16)
    padded = torch.cat([w, torch.zeros(blocks * 16 - n, k, dtype=w.dtype)])
    assert torch.equal(packed, padded.view(blocks, 16, k).permute(0, 2, 1).reshape(-1))


def test_the_build_is_cached_by_source_flags_compiler_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path))
    first = ckernels.build()
    assert first.parent == tmp_path / "kernels" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert ckernels.build() == first and first.stat().st_mtime_ns == mtime   # found, not rebuilt
    generic = ckernels.build(generic=True)
    assert generic != first                                              # other flags, another library
    assert sorted(p.suffix for p in (tmp_path / "kernels").iterdir()) == [".so", ".so"]  # no temporary left


def test_a_failed_build_names_the_compiler_and_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")                                    # a "compiler" that always fails
    with pytest.raises(ckernels.BuildError, match="false"):
        ckernels.build()
    monkeypatch.setattr(ckernels, "_loaded", {})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert ckernels.decode_library() is None
    assert any("C decode kernels are unavailable" in str(w.message) for w in seen)
    assert not list((tmp_path / "kernels").glob("*.tmp")) and not list((tmp_path / "kernels").glob("*.c"))


def test_the_kernels_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(ckernels.ENV_DISABLE, "0")
    assert ckernels.decode_library() is None


@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("cols", [37, 64])  # 37: a tail of 5 columns past two vectors of 16, rows unaligned; 64: whole
def test_fold_writes_the_bits_torch_mul_writes(lib, paired, norm, cols):
    """The engine's bf16 weight copies: w (its rows in `pair_halves` order where paired) times the norm weight,
    rounded once — bit for bit `torch.mul(w, norm, out=<bf16>)` (or the bf16 cast) on the strided view."""
    from posttrain.rollout.cpu.fused import _pair_rows, _paired

    g = torch.Generator().manual_seed(3)
    heads, d = 3, 8
    w = torch.randn(heads * d, cols, generator=g) * torch.logspace(-30, 30, cols)  # tiny, huge, ties in between
    w[0, :4] = torch.tensor([0.0, -0.0, float("inf"), 1.0 + 2 ** -8])  # a tie that rounds to even
    n = torch.rand(cols, generator=g) + 0.5 if norm else None
    out = torch.empty(heads * d, cols, dtype=torch.bfloat16)
    rows = _pair_rows(heads, d, w.device) if paired else None
    assert lib.posttrain_fold_bf16(heads * d, cols, w.data_ptr(), None if rows is None else rows.data_ptr(),
                                   None if n is None else n.data_ptr(), out.data_ptr(), 2) == 0
    src = _paired(w, heads, d) if paired else w
    ref = torch.empty(src.shape, dtype=torch.bfloat16)
    if n is None:
        ref.copy_(src)
    else:
        torch.mul(src, n, out=ref)
    assert torch.equal(out.view(torch.int16), ref.reshape(heads * d, cols).view(torch.int16))
