"""The fused decode step against its naive versions: the HF forward, the many-token forward, `mm`."""

from __future__ import annotations


import pytest
import torch

from posttrain.models import build_tiny
from posttrain.rollout import HFEngine, NativeEngine, SamplingParams
from posttrain.rollout.cpu.fused import FusedDecoder, pair_halves
from posttrain.rollout.kv_cache import KVCache
from posttrain.rollout.cpu.projections import FORMS, PROJECTION_KINDS, make_projection, projection_kind
from posttrain.rollout.cpu.tuning import candidates as tuning_candidates


def _cache(model, rows: int, capacity: int) -> KVCache:
    cfg = model.config
    return KVCache.allocate(layers=cfg.num_hidden_layers, rows=rows, kv_heads=cfg.num_key_value_heads,
                            capacity=capacity, head_dim=cfg.hidden_size // cfg.num_attention_heads,
                            dtype=torch.float32, device="cpu")


def test_pair_halves_puts_each_rotary_pair_side_by_side():
    # D = 6: HF rotates (0, 3), (1, 4), (2, 5) together → order 0, 3, 1, 4, 2, 5
    assert pair_halves(6).tolist() == [0, 3, 1, 4, 2, 5]


@pytest.mark.parametrize("kind, dtype", [("mm", torch.float32), ("mm", torch.bfloat16), ("mkl", torch.float32),
                                         ("dnn", torch.float32), ("dnn", torch.bfloat16),
                                         ("mv", torch.float32), ("mv", torch.bfloat16), ("c", torch.float32),
                                         ("c", torch.bfloat16), ("amx", torch.bfloat16)])
def test_every_projection_kind_computes_the_linear_product(kind, dtype):
    rows = 1 if kind == "mv" else 5
    if not FORMS[kind].available(dtype, rows):
        pytest.skip(f"this CPU cannot run the {kind} form on {dtype} weights (the c form's C loops: "
                    "tests/test_rollout_cpu_ckernels.py; oneDNN's bf16 packing needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; "
                    "amx needs AMX tiles)")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 48, generator=g).to(dtype)                    # (out, in), HF's layout
    b = torch.randn(40, generator=g).to(dtype)
    x = torch.randn(rows, 48, generator=g).to(dtype)
    ref = x.double() @ w.double().T + b.double()                      # the same bf16 values, exact products
    p = make_projection(w, b, kind, rows)
    assert p.kind == kind                                              # the class of the form named
    # fp32: another summation order → ~1e-6 on values of size ~10; bf16: one output rounding of values
    # |y| ≲ 32 is ≤ 2^-8·32 = 0.125 (plus the bias add's rounding in `add_to`)
    tol = 1e-4 if dtype == torch.float32 else 0.25
    assert (p(x).double() - ref).abs().max() <= tol
    out = torch.empty(rows, 40, dtype=dtype)
    p.into(x, out)
    assert (out.double() - ref).abs().max() <= tol
    h = torch.ones(rows, 40, dtype=dtype)
    p.add_to(x, h)                                                     # h = 1 + x·Wᵀ + b
    assert (h.double() - (ref + 1)).abs().max() <= 2 * tol
    if kind in ("c", "amx"):                                           # a C kernel trusts sizes: checked first
        with pytest.raises(ValueError, match="for a 40 × 48 weight"):
            p.into(x[:, :40], out)


def test_mkl_projection_pads_fewer_rows_up_to_its_packing():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(24, 32, generator=g), torch.randn(8, 32, generator=g)
    p = make_projection(w, None, "mkl", 8)
    assert torch.allclose(p(x[:3]), x[:3] @ w.T, atol=1e-5)          # 3 rows through a pack for 8
    with pytest.raises(ValueError, match="packed for at most 8"):
        p(torch.randn(9, 32))


def test_projection_kind_picks_packing_only_for_large_cpu_weights():
    cpu, big, small = torch.device("cpu"), 100 << 20, 1 << 20
    assert projection_kind(torch.float32, 8, cpu, big) in ("mkl", "mm")      # mm only if this torch lacks MKL packing
    assert projection_kind(torch.float32, 8, cpu, small) == "mm"
    assert projection_kind(torch.float32, 1, cpu, big) == "mm"
    assert projection_kind(torch.float32, 64, cpu, big) == "mm"
    assert projection_kind(torch.bfloat16, 1, cpu, big) == ("amx" if FORMS["amx"].available(torch.bfloat16, 1) else "mv")
    assert projection_kind(torch.float32, 8, torch.device("meta"), big) == "mm"
    with pytest.raises(ValueError, match="kind='nt'"):
        make_projection(torch.zeros(2, 2), None, "nt", 1)


@pytest.mark.parametrize("decode_ops", ["torch", "c", "c-generic"])
@pytest.mark.parametrize("arch, preset, dtype, kind, rows", [
    ("llama", "tiny-1m", torch.float32, "mm", 3),
    ("llama", "tiny-1m", torch.float32, "mm", 130),   # 130 · 128 > 16384: the reduction form of the norm
    ("llama", "tiny-4m", torch.float32, "mkl", 3),    # GQA (8 query heads over 4 KV heads)
    ("llama", "tiny-4m", torch.float32, "dnn", 3),    # what the tuner picks for fp32 on an AMD EPYC
    ("qwen2", "tiny-1m", torch.float32, "mm", 3),     # Q/K/V biases: permuted with their rows
    ("llama", "tiny-1m", torch.bfloat16, "dnn", 3),
    ("llama", "tiny-1m", torch.bfloat16, "dnn", 130),
    ("llama", "tiny-1m", torch.bfloat16, "mv", 1),
    ("llama", "tiny-4m", torch.bfloat16, "c", 3),     # our bf16 GEMM (AVX512-BF16), GQA
    ("llama", "tiny-1m", torch.float32, "c", 64),     # our fp32 GEMM (AVX-512), 8 blocks of 8 rows
    ("qwen2", "tiny-1m", torch.bfloat16, "c", 130),   # its biases; 130 rows: 16 blocks of 8 and a partial one
    ("llama", "tiny-4m", torch.bfloat16, "amx", 3),   # our bf16 GEMM on AMX tiles, GQA
    ("qwen2", "tiny-1m", torch.bfloat16, "amx", 130), # its biases; 130 rows: 8 tiles of 16 and one of 2
])
def test_decode_plan_equals_the_many_token_forward(tok, arch, preset, dtype, kind, rows, decode_ops):
    """Prefill 5 tokens, then one token by the plan vs the same token by `FusedDecoder.__call__` (q = 1),
    with the step's non-matmul work as PyTorch ops, as the C kernels, and as their plain-C loops."""
    if not FORMS[kind].available(dtype, rows):
        pytest.skip(f"this CPU cannot run the {kind} form on {dtype} weights")
    model = build_tiny(preset, vocab_size=len(tok), arch=arch, seed=0).eval().to(dtype)
    dec = FusedDecoder(model, matmul=kind, compute=dtype, decode_ops=decode_ops)  # bf16 arithmetic, not widened
    dec.prepare(16, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tok), (rows, 6), generator=g)
    mask = torch.ones(rows, 6, dtype=torch.bool)
    mask[0, :2] = False                                                # row 0: two left pads
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    key_mask = torch.cat([mask, torch.ones(rows, 4, dtype=torch.bool)], 1)  # (R, capacity 10)
    with torch.inference_mode():
        a, b = _cache(model, rows, 10), _cache(model, rows, 10)
        dec(ids[:, :5], pos[:, :5], a, key_mask)
        dec(ids[:, :5], pos[:, :5], b, key_mask)
        ref = dec(ids[:, 5:], pos[:, 5:], a, key_mask)                 # the naive q = 1 step
        plan = dec.plan(b, key_mask)
        assert (plan.lib is None) == (decode_ops == "torch")
        got = plan(ids[:, 5], pos[:, 5])
    assert b.length == a.length == 6
    # fp32: the same math in another op order → ≤ 1e-5 on logits of size ~1; bf16: both paths round the
    # same bf16 activations but through different GEMM kernels → a few bf16 ulps of logits ≲ 4: ≤ 0.1
    tol = 1e-5 if dtype == torch.float32 else 0.1
    assert (got - ref).abs().max() <= tol
    assert torch.allclose(a.keys[-1][:, :, :6], b.keys[-1][:, :, :6], atol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_on_the_decode_steps_packed_weights_equals_f_linear(tok, dtype):
    """With `decode_rows` and a oneDNN decode form, the prefill multiplies by the packed weights the plan
    then reuses; logits and cache as with `F.linear` on the plain copies (left pads included)."""
    if "dnn" not in tuning_candidates(dtype, 6):
        pytest.skip("this torch build has no oneDNN packed GEMM")
    model = build_tiny("tiny-4m", vocab_size=len(tok), seed=0).eval().to(dtype)
    dec = FusedDecoder(model, matmul="dnn", compute=dtype)
    dec.prepare(16, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, len(tok), (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, :3] = False                                                # row 1: three left pads
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        a, b = _cache(model, 3, 7), _cache(model, 3, 7)
        ref = dec(ids, pos, a, mask)
        assert "dnn" not in dec.weights._projections                  # F.linear: nothing packed
        got = dec(ids, pos, b, mask, decode_rows=6)
    assert "dnn" in dec.weights._projections                          # packed once, for the plan to reuse
    tol = 1e-5 if dtype == torch.float32 else 0.1                      # as the plan-vs-forward test above
    assert (got - ref).abs().max() <= tol
    assert torch.allclose(a.keys[-1], b.keys[-1], atol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_plan_on_cache_rows_equals_one_on_the_selected_cache(tok, dtype):
    """Compaction without a copy: running rows that read and write cache rows [4, 1, 3] of a 5-row cache
    give the logits, and leave the keys and values, of a plan on `cache.select([4, 1, 3])`."""
    model = build_tiny("tiny-4m", vocab_size=len(tok), seed=0).eval().to(dtype)
    dec = FusedDecoder(model, matmul="mm", compute=dtype, decode_ops="c")
    dec.prepare(16, torch.device("cpu"))
    assert dec.gathers_rows(torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, len(tok), (5, 6), generator=g)
    mask = torch.ones(5, 6, dtype=torch.bool)
    mask[1, :2] = False
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    key_mask = torch.cat([mask, torch.ones(5, 4, dtype=torch.bool)], 1)
    keep = torch.tensor([4, 1, 3])
    with torch.inference_mode():
        a, b = _cache(model, 5, 10), _cache(model, 5, 10)
        dec(ids[:, :5], pos[:, :5], a, key_mask)
        dec(ids[:, :5], pos[:, :5], b, key_mask)
        b.select(keep)
        got = dec.plan(a, key_mask[keep], cache_rows=keep)(ids[keep, 5], pos[keep, 5])
        ref = dec.plan(b, key_mask[keep])(ids[keep, 5], pos[keep, 5])
        assert torch.equal(got, ref)
        for k_a, k_b, v_a, v_b in zip(a.keys, b.keys, a.values, b.values):
            assert torch.equal(k_a[keep, :, :6], k_b[:, :, :6]) and torch.equal(v_a[keep, :, :6], v_b[:, :, :6])
        with pytest.raises(ValueError, match="must index the cache's 5 rows"):
            dec.plan(a, key_mask[:1], cache_rows=torch.tensor([5]))
        plain = FusedDecoder(model, matmul="mm", compute=dtype, decode_ops="torch")
        plain.prepare(16, torch.device("cpu"))
        with pytest.raises(ValueError, match="need the C attention kernel"):
            plain.plan(a, key_mask[keep], cache_rows=keep)
        prefix = _cache(model, 1, 6)                                   # a prompt's keys read by 5 rows
        prefix.advance(6)
        wide = torch.ones(5, 16, dtype=torch.bool)
        with pytest.raises(ValueError, match="need the C attention kernel"):
            plain.plan(a, wide, prefix=prefix, share=5)
        with pytest.raises(ValueError, match="does not cover the cache's 5 rows"):
            dec.plan(a, wide, prefix=prefix, share=4)
        with pytest.raises(ValueError, match=r"key_mask has shape \(5, 10\), expected \(5, 16\)"):
            dec.plan(a, key_mask, prefix=prefix, share=5)


def test_qwen2_with_biases_matches_generate_token_for_token(tok):
    model = build_tiny("tiny-1m", vocab_size=len(tok), arch="qwen2", seed=0, pad_token_id=tok.pad_token_id,
                       eos_token_id=tok.eos_token_id).eval()
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    with torch.no_grad():                                              # non-zero biases, so their order matters
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    base = tok("12 + 345 = 357 and 9 + 8 = 17")["input_ids"]
    prompts = [base[:4], base[2:9], base[1:6]]
    params = SamplingParams(temperature=0, max_new_tokens=10)
    ref = HFEngine(model, tok).generate(prompts, params)
    ours = NativeEngine(model, tok, kernels="fused").generate(prompts, params)
    assert torch.equal(ours.completion_ids, ref.completion_ids)
    assert (ours.policy_logprobs - ref.policy_logprobs).abs().max() <= 1e-4


def test_plan_rejects_a_cache_it_cannot_use(tok):
    model = build_tiny("tiny-1m", vocab_size=len(tok), seed=0).eval()
    dec = FusedDecoder(model)
    dec.prepare(8, torch.device("cpu"))
    cache = _cache(model, 2, 8)
    with pytest.raises(ValueError, match=r"key_mask has shape \(2, 5\), expected \(2, 8\)"):
        dec.plan(cache, torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="matmul='nt'"):
        FusedDecoder(model, matmul="nt")
    assert "mm" in PROJECTION_KINDS


@pytest.mark.parametrize("preset", ["tiny-1m", "tiny-30m"])
def test_the_accelerated_step_equals_the_plain_pytorch_step_in_one_engine(tok, preset):
    # the native engine with every accelerator on (fused copies, tuned matmul form, C kernels where they
    # build) against the same engine running the model's own PyTorch forward (kernels="hf", the reference
    # beside rollout/cpu/): same seeded samples, log-probs equal to fp32 round-off (~1e-6 on values ~1)
    model = build_tiny(preset, vocab_size=len(tok), seed=0, pad_token_id=tok.pad_token_id,
                       eos_token_id=tok.eos_token_id).eval()
    base = tok("12 + 345 = 357 and 9 + 8 = 17")["input_ids"]
    prompts = [base[:4], base[2:9], base[1:6]]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=5)
    fast = NativeEngine(model, tok, kernels="fused")
    plain = NativeEngine(model, tok, kernels="hf")
    assert (fast.kernels, plain.kernels) == ("fused", "hf")
    a, b = fast.generate(prompts, params), plain.generate(prompts, params)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert (a.policy_logprobs - b.policy_logprobs).abs().max() <= 1e-4
    assert (a.logprobs - b.logprobs).abs().max() <= 1e-4
