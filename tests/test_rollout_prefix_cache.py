"""The native engine's prefix cache: a call that starts from kept rows samples what a full prefill samples;
weight changes never leave a stale entry; the byte cap holds; `PrefixCache` by hand."""

from __future__ import annotations


import pytest
import torch

from posttrain.models import build_tiny
from posttrain.rollout import HFEngine, NativeEngine, SamplingParams, prefix_cache_of
from posttrain.rollout.prefix_cache import PrefixCache, PrefixEntry

pytestmark = pytest.mark.usefixtures("one_thread")

# tiny-1m: 4 layers × 4 kv heads × head_dim 32; keys and values, fp32 → 2·4·4·32·4 = 4,096 bytes a token
BYTES_PER_TOKEN = 4096
# fp32 round-off: the kept keys/values came from another batch shape (the previous call's prefill and its
# one-token decode steps) than a full prefill computes them in, so sums run in another order: each
# differs by a few ulp (1e-7 relative), and a log-prob, after 4 layers and a 512-way log-softmax, by
# ≲ 1e-5 (measured ≤ 3.4e-6 here, ≤ 1.0e-5 over 4-turn episodes). 1e-4 leaves 10× room; a wrong position, a slot
# off by one or an unmasked hole moves log-probs by ≳ 1e-2 and fails it.
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def tiny1m(tok):
    return build_tiny("tiny-1m", vocab_size=len(tok), seed=0, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id).eval()


@pytest.fixture(scope="module")
def stopping1m(tok):
    """tiny-1m whose rows stop at different steps: an untrained model almost never samples EOS, a long EOS
    embedding row (tied to the output) makes it likely, so kept rows leave the batch at compactions
    mid-call (greedy lengths 4, 1, 1, 1; seeded 10, 1, 2, 10 below)."""
    m = build_tiny("tiny-1m", vocab_size=len(tok), seed=0, pad_token_id=tok.pad_token_id,
                   eos_token_id=tok.eos_token_id).eval()
    with torch.no_grad():
        m.model.embed_tokens.weight[tok.eos_token_id] *= 18
    return m


def prompts_of(tok, count=4):
    base = tok("12 + 345 = 357 and 9 + 8 = 17")["input_ids"]
    return [base[i % 5: i % 5 + 3 + i] for i in range(count)]  # 3, 4, 5, … tokens: left padding


def entry(ids, fill=0.0, layers=1):
    t = torch.full((1, len(ids), 2), fill)  # (kv_heads 1, C, head_dim 2) fp32: 8 bytes a token a tensor
    return PrefixEntry(tuple(ids), [t] * layers, [t] * layers)


def test_prefix_cache_by_hand():
    c = PrefixCache(max_bytes=100)
    assert c.store("a", entry([1, 2]))            # 2 tokens × 8 bytes × (keys + values) = 32 bytes
    assert c.store("b", entry([1, 2, 3, 4]))      # 64 bytes; 96 ≤ 100
    assert c.bytes == 96
    assert c.lookup([1, 2, 3, 4, 5]).ids == (1, 2, 3, 4)        # the longest prefix
    assert c.lookup([1, 2, 9]).ids == (1, 2)
    assert c.lookup([1, 2, 3, 4]).ids == (1, 2)                   # a proper prefix only: one token left to run
    assert c.lookup([7, 1, 2]) is None
    assert c.lookup([1, 2, 3, 4, 5], key="a").ids == (1, 2)       # the key's own entry first, if it extends
    assert c.store("c", entry([5]))                # 16 bytes: 112 > 100 evicts "a", the oldest → 80
    assert list(c.entries) == ["b", "c"] and c.bytes == 80 and c.stats.evicted == 1
    assert c.store("c", entry([5, 6]))             # replacing "c" frees its 16 first: 64 + 32 = 96
    assert c.bytes == 96 and len(c) == 2
    assert not c.store("b", entry(list(range(7))))  # 112 > the whole cap: refused, and "b" is superseded
    assert list(c.entries) == ["c"] and c.bytes == 32 and c.stats.refused == 1
    c.release(["c", "unknown"])
    assert c.bytes == 0 and len(c) == 0
    c.store("d", entry([1]))
    c.check("weights v1")                          # a new stamp (the first) clears
    assert len(c) == 0 and c.stats.cleared == 1
    c.store("d", entry([1]))
    c.check("weights v1")
    assert len(c) == 1
    with pytest.raises(ValueError, match="max_bytes=-1"):
        PrefixCache(-1)


def _second_turn(first, extra):
    """Each row's next prompt: its prompt, its whole completion, then `extra` (an environment's tokens)."""
    return [list(p) + first.completion_ids[j, :k].tolist() + extra
            for j, (p, k) in enumerate(zip(first_prompts(first), first.completion_lengths.tolist()))]


def first_prompts(r):
    return [r.prompt_ids[j][r.prompt_mask[j]].tolist() for j in range(len(r))]


@pytest.mark.parametrize("options", [{}, {"decode_ops": "torch"}, {"decode_ops": "c-generic"}, {"kernels": "hf"}],
                         ids=["auto", "torch-select", "c-generic", "hf-forward"])
@pytest.mark.parametrize("greedy", [True, False])
def test_a_call_from_kept_rows_equals_a_full_prefill(tok, stopping1m, options, greedy):
    # compact_below=1.0: compaction as soon as a row finishes, so kept rows leave the batch mid-call
    # (copied out first where compaction copies the cache: decode_ops="torch", kernels="hf")
    params = SamplingParams(max_new_tokens=10, temperature=0.0 if greedy else 1.0, seed=5)
    tiny1m = stopping1m
    cached = NativeEngine(tiny1m, tok, compact_below=1.0, **options)
    prompts = prompts_of(tok)
    first = cached.generate(prompts, params, keep=[f"row{j}" for j in range(len(prompts))])
    assert len(cached.prefix_cache) == 4
    # a kept row covers its prompt and its completion but the last token (never fed to the model)
    lengths = first.completion_lengths.tolist()
    assert len(set(lengths)) > 1                                       # rows stopped at different steps
    kept = [tuple(p) + tuple(first.completion_ids[j, :k - 1].tolist()) for j, (p, k) in enumerate(zip(prompts, lengths))]
    assert [cached.prefix_cache.entries[f"row{j}"].ids for j in range(4)] == kept
    assert cached.prefix_cache.bytes == sum(map(len, kept)) * BYTES_PER_TOKEN
    extra = tok(" = 42")["input_ids"]
    second = _second_turn(first, extra)
    second.insert(1, prompts_of(tok, 6)[5])                            # a miss among the hits
    got = cached.generate(second, params)
    want = NativeEngine(tiny1m, tok, compact_below=1.0, **options).generate(second, params)
    assert cached.prefix_cache.stats.hits == 4                         # every kept row, not the new prompt
    assert cached.prefix_cache.stats.hit_tokens == sum(len(p) + k - 1 for p, k in zip(prompts, lengths))
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert torch.equal(got.prompt_ids, want.prompt_ids)
    assert float((got.policy_logprobs - want.policy_logprobs).abs().max()) <= LOGPROB_TOL
    assert float((got.logprobs - want.logprobs).abs().max()) <= LOGPROB_TOL


def test_kept_rows_of_n_samples(tok, stopping1m):
    # n = 2: rows are prompt-major; each sample keeps its own continuation
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=1)
    tiny1m = stopping1m
    cached = NativeEngine(tiny1m, tok, compact_below=1.0, decode_ops="torch")
    prompts = prompts_of(tok, 3)
    first = cached.generate(prompts, params, keep=list(range(6)))
    second = _second_turn(first, tok(" ok")["input_ids"])
    one = SamplingParams(max_new_tokens=6, temperature=1.0, seed=2)
    got = cached.generate(second, one)
    want = NativeEngine(tiny1m, tok).generate(second, one)
    assert cached.prefix_cache.stats.hits == 6
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert float((got.policy_logprobs - want.policy_logprobs).abs().max()) <= LOGPROB_TOL


def test_bf16_cache_kept_rows_give_the_same_tokens(tok, tiny1m):
    # bf16 arithmetic keeps a bf16 KV cache where the C attention runs: the kept values are the very bf16
    # numbers the earlier call wrote, a full prefill computes them again from other sums and may round
    # one differently (1 bf16 ulp = 2^-8 relative), so log-probs may move by ~1e-2; tokens are compared
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    opts = dict(dtype=torch.bfloat16, compute=torch.bfloat16)
    cached = NativeEngine(tiny1m, tok, **opts)
    prompts = prompts_of(tok)
    first = cached.generate(prompts, params, keep=list(range(4)))
    second = _second_turn(first, tok(" = 42")["input_ids"])
    got = cached.generate(second, params)
    want = NativeEngine(tiny1m, tok, **opts).generate(second, params)
    assert cached.prefix_cache.stats.hits == 4
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert float((got.policy_logprobs - want.policy_logprobs).abs().max()) <= 5e-2


@pytest.mark.parametrize("how", ["update_weights", "sync_weights", "in_place"])
def test_no_entry_survives_a_weight_change(tok, how):
    model = build_tiny("tiny-1m", vocab_size=len(tok), seed=0, pad_token_id=tok.pad_token_id,
                       eos_token_id=tok.eos_token_id).eval()
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    engine = NativeEngine(model, tok)
    prompts = prompts_of(tok)
    first = engine.generate(prompts, params, keep=list(range(4)))
    assert len(engine.prefix_cache) == 4
    with torch.no_grad():                                             # bumps each parameter's version
        for p in model.parameters():
            p.mul_(1.5)
    if how == "update_weights":
        engine.update_weights(model)
        assert len(engine.prefix_cache) == 0
    elif how == "sync_weights":
        engine.sync_weights(model)
        assert len(engine.prefix_cache) == 0
    second = _second_turn(first, tok(" = 42")["input_ids"])
    got = engine.generate(second, params)                             # "in_place": the stamp clears it here
    assert engine.prefix_cache.stats.hits == 0
    want = NativeEngine(model, tok).generate(second, params)
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert torch.equal(got.policy_logprobs, want.policy_logprobs)     # no hit: the same computation


def test_the_byte_cap_holds(tok, tiny1m):
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    prompts = prompts_of(tok)                                        # 3, 4, 5, 6 tokens
    # rows keep ≤ 6 + 3 = 9 tokens = 36,864 bytes; a cap of 20 tokens holds two short rows at most
    engine = NativeEngine(tiny1m, tok, prefix_cache_bytes=20 * BYTES_PER_TOKEN)
    first = engine.generate(prompts, params, keep=list(range(4)))
    sizes = [len(p) + k - 1 for p, k in zip(prompts, first.completion_lengths.tolist())]
    assert engine.prefix_cache.bytes <= 20 * BYTES_PER_TOKEN
    assert engine.prefix_cache.bytes == sum(len(e.ids) for e in engine.prefix_cache.entries.values()) * BYTES_PER_TOKEN
    assert sum(sizes) > 20                                             # so something had to go
    assert engine.prefix_cache.stats.evicted + engine.prefix_cache.stats.refused >= 1
    tiny = NativeEngine(tiny1m, tok, prefix_cache_bytes=2 * BYTES_PER_TOKEN)  # smaller than any row
    tiny.generate(prompts, params, keep=list(range(4)))
    assert len(tiny.prefix_cache) == 0 and tiny.prefix_cache.stats.refused == 4
    engine.release(list(range(4)))
    assert engine.prefix_cache.bytes == 0 and len(engine.prefix_cache) == 0
    assert engine.memory_bytes()["prefix cache"] == 0


def test_only_what_is_asked_is_kept_and_bad_keep_is_named(tok, tiny1m):
    engine = NativeEngine(tiny1m, tok)
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    engine.generate(prompts_of(tok), params)
    assert len(engine.prefix_cache) == 0
    engine.generate(prompts_of(tok), params, keep=[None, "b", None, None])
    assert list(engine.prefix_cache.entries) == ["b"]
    with pytest.raises(ValueError, match=r"keep has 3 keys; expected one per row \(4 prompts × n=1 = 4\)"):
        engine.generate(prompts_of(tok), params, keep=[None] * 3)


def test_which_engines_keep_prefixes(tok, tiny1m):
    assert prefix_cache_of(NativeEngine(tiny1m, tok)) is not None
    assert prefix_cache_of(NativeEngine(tiny1m, tok, prefix_cache_bytes=0)) is None
    assert prefix_cache_of(HFEngine(tiny1m, tok)) is None


def test_bf16_samples_differ_only_where_the_draw_meets_a_rounding_shift(tok, tiny1m, monkeypatch):
    # Seeded T = 1 in bf16: kept and recomputed keys/values round differently (1 bf16 ulp), the CDF the
    # inversion draw reads shifts by ~1e-4, and a row whose uniform u lands inside that shift picks the
    # neighbouring token (then its continuations differ). So wherever the two paths' samples part, the
    # first differing draw must have u between the two CDFs at the lower of the two tokens — any other
    # divergence would be a bug. (This setting parts one row at step 7: u = 0.263881, CDFs 0.263857 /
    # 0.263957, docs/rollout.md; the check holds for every row whatever the machine's rounding.)
    import posttrain.rollout.native as native
    opts = dict(dtype=torch.bfloat16, compute=torch.bfloat16, compact_below=0.0)  # rows stay where they are
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=5)
    cached = NativeEngine(tiny1m, tok, **opts)
    second = _second_turn(cached.generate(prompts_of(tok), params, keep=list(range(4))), tok(" = 42")["input_ids"])
    seen: list = []
    real = native.sample_into

    def spy(logits, p, u, *out):
        seen.append((logits.clone(), u.clone()))
        return real(logits, p, u, *out)

    monkeypatch.setattr(native, "sample_into", spy)
    got = cached.generate(second, params)
    kept_steps, seen[:] = seen[:], []
    want = NativeEngine(tiny1m, tok, **opts).generate(second, params)
    assert cached.prefix_cache.stats.hits == 4
    for j in range(len(got)):
        differ = (got.completion_ids[j] != want.completion_ids[j]).nonzero()[:, 0]
        if differ.numel() == 0:
            continue
        t = int(differ[0])
        (la, u), (lb, ub) = kept_steps[t], seen[t]
        assert torch.equal(u, ub)                                       # the same uniforms: seeds unchanged
        lo = min(int(got.completion_ids[j, t]), int(want.completion_ids[j, t]))
        ca, cb = float(la[j].softmax(-1)[: lo + 1].sum()), float(lb[j].softmax(-1)[: lo + 1].sum())
        assert min(ca, cb) - 1e-6 <= float(u[j]) <= max(ca, cb) + 1e-6
        assert abs(ca - cb) < 1e-2                                      # a rounding shift, not another distribution
