"""The native engine against `transformers` generate and against a teacher-forced forward."""

from __future__ import annotations

import gc

import pytest
import torch

from posttrain.models import build_tiny
from posttrain.rollout import (
    HFEngine,
    NativeEngine,
    Rollout,
    SamplingParams,
    make_engine,
)
from posttrain.rollout.cpu.fused import rms_norm, rms_norm_fused
from posttrain.rollout.cpu.projections import FORMS
from posttrain.rollout.sampling import process_logits

CHI2_CRIT_DF3 = 16.266  # χ² critical value, 3 dof, α = 0.001


def _model(tok, preset):
    return build_tiny(preset, vocab_size=len(tok), seed=0, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id).eval()


@pytest.fixture(scope="module")
def tiny1m(tok):
    return _model(tok, "tiny-1m")


@pytest.fixture(scope="module")
def tiny30m(tok):
    return _model(tok, "tiny-30m")


def prompts_of(tok, count=6):
    """Mixed lengths: 3, 4, … tokens, so left padding is exercised."""
    base = tok("12 + 345 = 357 and 9 + 8 = 17")["input_ids"]
    return [base[i % 5: i % 5 + 3 + i] for i in range(count)]


def teacher_forced(model, r: Rollout) -> torch.Tensor:
    """Log-softmax logits at the positions that predicted each completion token. Shape: (R, N, V)."""
    with torch.no_grad():
        logits = model(input_ids=r.sequence_ids, attention_mask=r.sequence_mask, position_ids=r.position_ids).logits
    p = r.prompt_ids.shape[1]
    return logits[:, p - 1:-1].float()


def min_greedy_margin(model, r: Rollout) -> float:
    """Smallest top-1 − top-2 logit gap along the greedy path: the equality test needs it ≫ 1e-6."""
    top2 = teacher_forced(model, r).topk(2, -1).values
    gap = (top2[..., 0] - top2[..., 1])[r.completion_mask]
    return float(gap.min())


@pytest.mark.parametrize("preset, kernels", [
    ("tiny-1m", "fused"), ("tiny-30m", "fused"),  # tiny-30m: GQA and untied head through the fused path
    ("tiny-1m", "hf"),                             # the architecture-generic path (the model's own forward)
])
def test_greedy_equals_generate_token_for_token(tok, tiny1m, tiny30m, preset, kernels):
    model = tiny1m if preset == "tiny-1m" else tiny30m
    prompts = prompts_of(tok, 5)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    ref = HFEngine(model, tok).generate(prompts, params)
    assert min_greedy_margin(model, ref) > 1e-4, "near-tie in the random model: the comparison would be brittle"
    ours = NativeEngine(model, tok, kernels=kernels).generate(prompts, params)
    assert torch.equal(ours.completion_ids, ref.completion_ids)
    assert torch.equal(ours.completion_mask, ref.completion_mask)
    assert ours.finish_reason == ref.finish_reason
    assert ours.texts == ref.texts
    assert torch.equal(ours.prompt_ids, ref.prompt_ids)
    # both report the raw model's log-prob of the greedy token
    assert (ours.policy_logprobs - ref.policy_logprobs).abs().max() <= 1e-4


@pytest.mark.parametrize("preset, kernels", [("tiny-30m", "fused"), ("tiny-1m", "hf")])
def test_logprobs_match_a_teacher_forced_forward(tok, tiny1m, tiny30m, preset, kernels):
    model = tiny1m if preset == "tiny-1m" else tiny30m
    params = SamplingParams(n=3, temperature=0.8, top_k=20, top_p=0.95, max_new_tokens=10, seed=1)
    r = NativeEngine(model, tok, kernels=kernels).generate(prompts_of(tok, 3), params)
    tf = teacher_forced(model, r)                                                 # (R, N, V)
    ids = r.completion_ids[..., None]
    policy = tf.log_softmax(-1).gather(-1, ids)[..., 0]
    rows, width, vocab = tf.shape
    sampled = process_logits(tf.reshape(-1, vocab), params).log_softmax(-1).reshape(rows, width, vocab)
    sampled = sampled.gather(-1, ids)[..., 0]
    m = r.completion_mask
    d_policy = float((policy - r.policy_logprobs)[m].abs().max())
    d_sampled = float((sampled - r.logprobs)[m].abs().max())
    print(f"max |engine − teacher-forced|: policy {d_policy:.2e}, sampling distribution {d_sampled:.2e}")
    assert d_policy <= 1e-4
    assert d_sampled <= 1e-4
    assert (r.logprobs[~m] == 0).all() and (r.policy_logprobs[~m] == 0).all()


def test_seeded_sampling_is_reproducible(tok, tiny1m):
    engine = NativeEngine(tiny1m, tok)
    prompts = prompts_of(tok, 3)
    a = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=10, seed=7))
    b = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=10, seed=7))
    c = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=10, seed=8))
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    # the n samples of one prompt differ (they share the prefill, not the noise)
    assert not torch.equal(a.completion_ids[0], a.completion_ids[1])
    assert a.prompt_index.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]


def test_engine_samples_the_models_next_token_distribution_by_chi2(tok, tiny1m):
    """10k one-token samples of one prompt (prefill shared by all 10k rows) vs the model's top-4 softmax."""
    prompt = prompts_of(tok, 1)
    params = SamplingParams(n=10_000, top_k=4, max_new_tokens=1, seed=0)
    r = NativeEngine(tiny1m, tok).generate(prompt, params)
    with torch.no_grad():
        logits = tiny1m(input_ids=torch.tensor(prompt)).logits[0, -1].float()
    top = logits.topk(4)
    q = top.values.softmax(-1)                                                   # the known distribution
    first = r.completion_ids[:, 0]
    assert set(first.tolist()) <= set(top.indices.tolist())                     # top-k never leaks
    counts = torch.stack([(first == i).sum() for i in top.indices]).double()
    chi2 = float(((counts - q * 10_000) ** 2 / (q * 10_000)).sum())
    assert chi2 < CHI2_CRIT_DF3


def test_engine_at_temperature_one_samples_the_full_softmax_by_chi2(tok, tiny1m):
    """T = 1, no filter (the benchmark's setting, the sampler's identity fast path): 10k first tokens of one
    prompt binned as the 3 most likely tokens + everything else (3 dof) vs the model's softmax."""
    prompt = prompts_of(tok, 1)
    r = NativeEngine(tiny1m, tok).generate(prompt, SamplingParams(n=10_000, max_new_tokens=1, seed=1))
    with torch.no_grad():
        p = tiny1m(input_ids=torch.tensor(prompt)).logits[0, -1].double().softmax(-1)
    top = p.topk(3)
    q = torch.cat([top.values, 1 - top.values.sum(0, keepdim=True)])          # 4 bins, sum 1
    first = r.completion_ids[:, 0]
    counts = torch.stack([(first == i).sum() for i in top.indices] + [(~torch.isin(first, top.indices)).sum()]).double()
    chi2 = float(((counts - q * 10_000) ** 2 / (q * 10_000)).sum())
    assert chi2 < CHI2_CRIT_DF3
    # negative control (the random model is near-uniform, so this is the hard case): uniform is rejected
    u = torch.tensor([1, 1, 1, p.numel() - 3], dtype=torch.float64) / p.numel()
    assert float(((counts - u * 10_000) ** 2 / (u * 10_000)).sum()) > CHI2_CRIT_DF3  # measured ≈ 70


def test_eos_is_kept_in_the_completion_and_ends_the_row(tok, tiny1m):
    # Declare the 40 lowest ids end-of-sequence so rows end early at random points.
    eos = list(range(40))
    r = NativeEngine(tiny1m, tok, eos_token_ids=eos).generate(prompts_of(tok), SamplingParams(
        n=4, max_new_tokens=20, seed=3))
    lengths = r.completion_lengths
    assert (lengths < 20).any() and "stop" in r.finish_reason
    for i, reason in enumerate(r.finish_reason):
        last = int(r.completion_ids[i, lengths[i] - 1])
        if reason == "stop":
            assert last in eos                                       # the EOS token is in ids and mask
            assert not any(t in eos for t in r.completion_ids[i, : lengths[i] - 1].tolist())
        else:
            assert lengths[i] == 20 and not any(t in eos for t in r.completion_ids[i, : lengths[i]].tolist())
        assert (r.completion_ids[i, lengths[i]:] == tok.pad_token_id).all()


@pytest.mark.parametrize("seed", range(4))
def test_compaction_does_not_change_any_sample(tok, tiny1m, seed):
    # 8 prompts × n = 2 with 40 "EOS" ids: rows end at random steps, the batch compacts several times
    # (through 8 = the prompt count, where a bug once re-ran the prefill expansion)
    prompts, eos = prompts_of(tok, 8), list(range(40))
    params = SamplingParams(n=2, max_new_tokens=12, seed=seed)
    never = NativeEngine(tiny1m, tok, eos_token_ids=eos, compact_below=0.0).generate(prompts, params)
    always = NativeEngine(tiny1m, tok, eos_token_ids=eos, compact_below=1.0).generate(prompts, params)
    assert (never.completion_lengths < 12).sum() >= 4                       # compaction really happened
    assert torch.equal(never.completion_ids, always.completion_ids)
    assert torch.allclose(never.policy_logprobs, always.policy_logprobs, atol=1e-5)
    tf = teacher_forced(tiny1m, always).log_softmax(-1).gather(-1, always.completion_ids[..., None])[..., 0]
    assert (tf - always.policy_logprobs)[always.completion_mask].abs().max() <= 1e-4  # compacted rows stay right


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_samples_read_their_prompt_from_one_copy(tok, tiny1m, dtype):
    # n = 3 samples of each prompt, with the C attention: the prefill's keys and values are read in place by
    # every sample (cpu/fused.py departure 12), not copied into each row; tokens, log-probs and the rows kept
    # for a later call (their prompt from the shared copy, their tokens from their own cache) are the bits of
    # the engine that copies them (`KVCache.expand`, as the paths without the C attention do)
    prompts, eos = prompts_of(tok, 4), list(range(40))                   # rows end at different steps
    params = SamplingParams(n=3, max_new_tokens=12, seed=3)
    opts = {"eos_token_ids": eos, "compact_below": 1.0, "dtype": dtype, "compute": dtype}
    shared = NativeEngine(tiny1m, tok, **opts)
    assert shared.step.gathers_rows(torch.device("cpu"))
    got = shared.generate(prompts, params, keep=list(range(12)))
    plen, rows = got.prompt_ids.shape[1], 12
    layer_bytes = 2 * tiny1m.config.num_key_value_heads * tiny1m.config.head_dim * dtype.itemsize
    assert shared.memory_bytes()["KV cache"] == tiny1m.config.num_hidden_layers * layer_bytes * (4 * plen + rows * 12)
    copied = NativeEngine(tiny1m, tok, **opts, share_prompts=False)
    want = copied.generate(prompts, params, keep=list(range(12)))
    assert copied.memory_bytes()["KV cache"] == tiny1m.config.num_hidden_layers * layer_bytes * rows * (plen + 12)
    assert (want.completion_lengths < 12).sum() >= 3                   # compaction really happened
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert torch.equal(got.policy_logprobs, want.policy_logprobs) and torch.equal(got.logprobs, want.logprobs)
    for j in range(rows):
        a, b = shared.prefix_cache.entries[j], copied.prefix_cache.entries[j]
        assert a.ids == b.ids
        assert all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values))


@pytest.mark.parametrize("matmul", ["mkl", "dnn"])
def test_packed_matmuls_with_compaction_give_the_mm_samples(tok, tiny1m, matmul):
    # packed weights (forced here; "auto" packs only large models) through compactions: the mkl pack for
    # 16 rows is reused, zero-padded, for 15, 14, … rows
    prompts, eos = prompts_of(tok, 8), list(range(40))
    params = SamplingParams(n=2, max_new_tokens=12, seed=5)
    ref = NativeEngine(tiny1m, tok, eos_token_ids=eos, compact_below=0.0, matmul="mm").generate(prompts, params)
    got = NativeEngine(tiny1m, tok, eos_token_ids=eos, compact_below=1.0, matmul=matmul).generate(prompts, params)
    assert (ref.completion_lengths < 12).sum() >= 4                       # compaction really happened
    assert torch.equal(got.completion_ids, ref.completion_ids)
    assert (got.policy_logprobs - ref.policy_logprobs).abs().max() <= 1e-4


def test_stop_string_truncates_the_text_and_matches_generate(tok, tiny1m):
    prompts = prompts_of(tok, 3)
    free = NativeEngine(tiny1m, tok).generate(prompts, SamplingParams(temperature=0, max_new_tokens=16))
    stop = free.texts[0][3:5]                                                # occurs in row 0's greedy text
    params = SamplingParams(temperature=0, max_new_tokens=16, stop=[stop])
    ours = NativeEngine(tiny1m, tok).generate(prompts, params)
    ref = HFEngine(tiny1m, tok).generate(prompts, params)
    assert ours.finish_reason[0] == "stop"
    end = free.texts[0].find(stop) + len(stop)
    assert ours.texts[0] == free.texts[0][:end]                              # cut right after the stop string
    k = int(ours.completion_lengths[0])
    assert torch.equal(ours.completion_ids[0, :k], free.completion_ids[0, :k])   # a prefix of the free run
    assert k < int(free.completion_lengths[0])
    assert torch.equal(ours.completion_ids, ref.completion_ids)
    assert ours.texts == ref.texts and ours.finish_reason == ref.finish_reason


def test_weight_updates_are_seen_by_the_fused_copies(tok):
    model = _model(tok, "tiny-1m")
    engine = NativeEngine(model, tok, kernels="fused")
    prompts, params = prompts_of(tok, 3), SamplingParams(temperature=0, max_new_tokens=8)
    before = engine.generate(prompts, params)
    with torch.no_grad():  # an "optimizer step": in-place change of every parameter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after = engine.generate(prompts, params)  # the version counters moved: rebuilt without being told
    ref = HFEngine(model, tok).generate(prompts, params)
    assert not torch.equal(before.completion_ids, after.completion_ids)
    assert torch.equal(after.completion_ids, ref.completion_ids)


def test_update_weights_after_a_fused_optimizer_step(tok):
    """`AdamW(fused=True)` writes parameters without moving their version counters; `update_weights`
    (which the RL stages call after every optimizer step) makes the next rollout sample the new policy."""
    model = _model(tok, "tiny-1m")
    engine = NativeEngine(model, tok, kernels="fused")
    prompts, params = prompts_of(tok, 3), SamplingParams(temperature=0, max_new_tokens=8)
    before = engine.generate(prompts, params)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    engine.update_weights(model)
    after = engine.generate(prompts, params)
    ref = HFEngine(model, tok).generate(prompts, params)
    assert not torch.equal(before.completion_ids, after.completion_ids)
    assert torch.equal(after.completion_ids, ref.completion_ids)


@pytest.mark.parametrize("dtype, matmul, compute", [(None, "mm", "auto"), (None, "mkl", "auto"),
                                                    (torch.bfloat16, "dnn", torch.bfloat16),
                                                    (torch.bfloat16, "mv", torch.bfloat16),
                                                    (torch.bfloat16, "mm", "auto")])  # bf16 values widened to fp32
def test_a_rebuild_into_the_previous_buffers_equals_a_fresh_build(tok, dtype, matmul, compute):
    """`FusedWeights.refresh` writes each rebuild into the last one's buffers (and fp32 copies alias the
    parameters): after an update the engine must compute exactly what a new engine computes."""
    rows = 1 if matmul == "mv" else 3
    if not FORMS[matmul].available(dtype or torch.float32, rows):
        pytest.skip(f"this CPU cannot run the {matmul} form on {dtype} weights")
    model = _model(tok, "tiny-1m")
    prompts = prompts_of(tok, rows)
    params = SamplingParams(max_new_tokens=8, seed=3)
    engine = NativeEngine(model, tok, kernels="fused", dtype=dtype, matmul=matmul, compute=compute)
    before = engine.generate(prompts, params)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)
    engine.update_weights(model)
    after = engine.generate(prompts, params)
    fresh = NativeEngine(model, tok, kernels="fused", dtype=dtype, matmul=matmul, compute=compute).generate(prompts, params)
    assert not torch.equal(before.policy_logprobs, after.policy_logprobs)
    assert torch.equal(after.completion_ids, fresh.completion_ids)
    assert torch.equal(after.policy_logprobs, fresh.policy_logprobs)


@pytest.mark.parametrize("dtype, matmul", [(None, "mm"), (torch.bfloat16, "dnn"), (torch.bfloat16, "c")])
def test_release_memory_frees_the_copies_and_sync_rebuilds_them_exactly(tok, dtype, matmul):
    """What the RL stages do around every update: `release_memory` after the rollout (the engine then
    holds no weight copy or decode form), an optimizer step, `sync_weights` — which must rebuild the copies
    *and* the decode forms the last generate used, so the next rollout equals a fresh engine's bit for bit."""
    if not FORMS[matmul].available(dtype or torch.float32, 3):
        pytest.skip(f"this CPU cannot run the {matmul} form on {dtype} weights")
    model = _model(tok, "tiny-30m")
    prompts, params = prompts_of(tok, 3), SamplingParams(max_new_tokens=8, seed=5)
    engine = NativeEngine(model, tok, kernels="fused", dtype=dtype, matmul=matmul)
    engine.generate(prompts, params)
    held = engine.memory_bytes()["fused weights"]
    freed = engine.release_memory()
    assert freed == held > 0
    assert engine.memory_bytes()["fused weights"] == 0
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.05)
    moved = engine.sync_weights(model)
    assert engine.memory_bytes()["fused weights"] == held  # copies and decode forms back, before any generate
    assert moved > held  # the rebuild read the parameters and wrote every copy and form
    after = engine.generate(prompts, params)
    fresh = NativeEngine(model, tok, kernels="fused", dtype=dtype, matmul=matmul).generate(prompts, params)
    assert torch.equal(after.completion_ids, fresh.completion_ids)
    assert torch.equal(after.policy_logprobs, fresh.policy_logprobs)
    assert engine.release_memory() == held and engine.release_memory() == 0  # a second release frees nothing more


@pytest.mark.parametrize("kernels, dtype, matmul", [("fused", None, "mm"), ("fused", torch.bfloat16, "dnn"),
                                                    ("fused", torch.bfloat16, "c"), ("hf", None, "auto")])
def test_a_rollout_leaves_no_tensor_to_the_cyclic_collector(tok, tiny1m, kernels, dtype, matmul):
    """A generate's KV cache, decode buffers and packed weights are freed when it returns, by reference
    counting: a reference cycle through them (a bound method stored on the decode plan, the HF cache view
    holding its cache) kept every rollout's buffers until Python's cyclic collector ran — ~170 MiB more
    resident per GRPO step at 512-token completions. With the collector off, nothing a rollout leaves
    behind in a cycle may be a tensor."""
    if matmul != "auto" and not FORMS[matmul].available(dtype or torch.float32, 3):
        pytest.skip(f"this CPU cannot run the {matmul} form on {dtype} weights")
    engine = NativeEngine(tiny1m, tok, kernels=kernels, dtype=dtype, matmul=matmul)
    prompts, params = prompts_of(tok, 3), SamplingParams(max_new_tokens=8, seed=5, n=2)
    engine.generate(prompts, params)  # the first call builds what stays (copies, decode forms, tuning)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds unreachable is kept in gc.garbage to look at
    try:
        engine.generate(prompts, params)
        gc.collect()
        cyclic = [type(o).__name__ for o in gc.garbage if torch.is_tensor(o)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cyclic == [], f"{len(cyclic)} tensors of the rollout waited for the cyclic collector"


def test_small_bf16_weights_are_multiplied_in_fp32_on_their_exact_values(tok, tiny1m):
    """tiny-1m in bf16 decodes in fp32 (`projections.compute_dtype`): the log-probs are then those of the bf16
    model's values in exact fp32 arithmetic, i.e. of the widened model, to fp32 precision."""
    import copy
    params = SamplingParams(max_new_tokens=8, seed=2)
    engine = NativeEngine(tiny1m, tok, dtype=torch.bfloat16)
    r = engine.generate(prompts_of(tok, 3), params)
    assert engine.step.compute_dtype == torch.float32 and engine.step.weights.lm_head.dtype == torch.float32
    widened = copy.deepcopy(tiny1m).to(torch.bfloat16).float()
    tf = teacher_forced(widened, r).log_softmax(-1).gather(-1, r.completion_ids[..., None])[..., 0]
    assert float((tf - r.policy_logprobs)[r.completion_mask].abs().max()) <= 1e-4
    assert all(bool((n.weight == 1).all())                           # unit norm weights: folding rounds nothing
               for n in tiny1m.modules() if type(n).__name__ == "LlamaRMSNorm")
    m16 = copy.deepcopy(tiny1m).to(torch.bfloat16)                     # a bf16 model itself: the same choice
    r16 = NativeEngine(m16, tok).generate(prompts_of(tok, 3), params)
    assert torch.equal(r16.completion_ids, r.completion_ids)
    assert float((r16.policy_logprobs - r.policy_logprobs).abs().max()) <= 1e-5


def test_bf16_weights_give_the_bf16_models_logprobs(tok, tiny1m):
    params = SamplingParams(max_new_tokens=8, seed=2)
    engine = NativeEngine(tiny1m, tok, dtype=torch.bfloat16, compute=torch.bfloat16)
    r = engine.generate(prompts_of(tok, 3), params)
    # bf16 arithmetic with the C attention keeps a bf16 KV cache (fused.py departure 5)
    assert engine.step.cache_dtype == (torch.bfloat16 if engine.step.gathers_rows(torch.device("cpu")) else torch.float32)
    import copy
    m16 = copy.deepcopy(tiny1m).to(torch.bfloat16)
    tf = teacher_forced(m16, r).log_softmax(-1).gather(-1, r.completion_ids[..., None])[..., 0]
    d = float((tf - r.policy_logprobs)[r.completion_mask].abs().max())
    # bf16 has 8 mantissa bits: logits of size ~1 carry ±4e-3 rounding per op; the two paths round differently
    assert d < 5e-2
    assert next(tiny1m.parameters()).dtype == torch.float32                  # the policy itself stays fp32


def test_fused_rms_norm_matches_the_naive_one():
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)) * 3
    w = torch.rand(64, generator=torch.Generator().manual_seed(1)) + 0.5
    assert torch.allclose(rms_norm_fused(x, w, 1e-5), rms_norm(x, w, 1e-5), atol=1e-6)
    xb, wb = x.bfloat16(), w.bfloat16()
    # bf16: the naive norm rounds twice, the fused once; they differ by at most ~2 bf16 ulps (2^-7 relative)
    assert torch.allclose(rms_norm_fused(xb, wb, 1e-5).float(), rms_norm(xb, wb, 1e-5).float(), rtol=2 ** -6, atol=1e-2)


def test_rollout_tensors_are_usable_in_autograd(tok, tiny1m):
    r = NativeEngine(tiny1m, tok).generate(prompts_of(tok, 2), SamplingParams(max_new_tokens=4, seed=0))
    logits = tiny1m(input_ids=r.sequence_ids, attention_mask=r.sequence_mask, position_ids=r.position_ids).logits
    loss = logits[:, -1].log_softmax(-1).gather(-1, r.completion_ids[:, -1:]).sum()
    loss.backward()                                   # fails if the rollout held inference-mode tensors
    assert tiny1m.lm_head.weight.grad is not None or tiny1m.model.embed_tokens.weight.grad is not None
    tiny1m.zero_grad(set_to_none=True)


def test_bad_input_is_named(tok, tiny1m):
    engine = make_engine("native", tiny1m, tok)
    with pytest.raises(ValueError, match="empty batch"):
        engine.generate([], SamplingParams())
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        engine.generate([[5, 6], []], SamplingParams())
    with pytest.raises(TypeError, match="mixed"):
        engine.generate(["a", [5]], SamplingParams())
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.generate([[5]], {"n": 2})
    with pytest.raises(ValueError, match="unknown rollout backend 'sglang'"):
        make_engine("sglang", tiny1m, tok)
    with pytest.raises(ValueError, match="kernels="):
        NativeEngine(tiny1m, tok, kernels="triton")


def test_string_prompts_and_the_vllm_backend_on_cpu(tok, tiny1m):
    r = make_engine("native", tiny1m, tok).generate(["12 + 3 =", "7 + 8 ="], SamplingParams(n=2, max_new_tokens=3, seed=0))
    assert r.completion_ids.shape[0] == 4 and len(r.texts) == 4
    if not torch.cuda.is_available():
        with pytest.raises((ImportError, RuntimeError), match="vLLM backend needs"):
            make_engine("vllm", tiny1m, tok)
