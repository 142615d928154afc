"""The shared-prefix attention kernel against the naive reference: each sequence in its own padded row."""

from __future__ import annotations

import pytest
import torch

from posttrain.models import build_tiny
from posttrain.models import prefix_attention
from posttrain.models.prefix_attention import NAME, shared_prefix
from posttrain.rollout.text import positions_from_mask
from posttrain.models.prefix_attention import Segments
from posttrain.stages._packing import TOKEN_BUCKET, pack_groups, packed_width, shared_prompt_logprobs, token_bucket

pytestmark = pytest.mark.usefixtures("one_thread")
PAD = 0


def padded_batch(prompts: list[list[int]], completions: list[list[int]]):
    """(B, P + N) left-padded prompts, right-padded completions, as GRPO's `build_batch` lays them out."""
    p, n = max(map(len, prompts)), max(map(len, completions))
    ids = torch.full((len(prompts), p + n), PAD)
    mask = torch.zeros((len(prompts), p + n), dtype=torch.bool)
    for i, (a, c) in enumerate(zip(prompts, completions)):
        ids[i, p - len(a) : p], mask[i, p - len(a) : p] = torch.tensor(a), True
        ids[i, p : p + len(c)], mask[i, p : p + len(c)] = torch.tensor(c), True
    return ids, mask, positions_from_mask(mask), p


def case(vocab: int, seed: int = 0):
    """Three prompts of 3, 7 and 5 tokens with 4, 3 (a short group) and 4 completions of 1–9 tokens."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda k: torch.randint(1, vocab, (k,), generator=g).tolist()
    prompts, completions = [], []
    for plen, lens in ((3, [9, 1, 4, 9]), (7, [2, 5, 9]), (5, [6, 6, 3, 8])):
        prompt = rand(plen)
        for k in lens:
            prompts.append(prompt)
            completions.append(rand(k))
    return padded_batch(prompts, completions)


def test_layout_packs_each_prompt_once_and_each_completion_at_its_length():
    # prompts [5, 6] ×2 then [7] ×1; completions of 3, 1 and 2 tokens (a completion's last token is no input)
    ids, mask, pos, p = padded_batch([[5, 6], [5, 6], [7]], [[1, 2, 3], [4], [8, 9]])
    lay = pack_groups(ids, mask, pos, p)
    assert lay.input_ids.tolist() == [[5, 6, 1, 2, 7, 8]]            # no padding anywhere
    # slot tokens continue from the prompt's length: [5 6 | 1 2] → 2 3; [7 | 8] → 1
    assert lay.position_ids.tolist() == [[0, 1, 2, 3, 0, 1]]
    assert lay.segments == Segments(prefixes=((0, 2), (4, 1)), slots=(((2, 2),), ((5, 1),)))
    assert packed_width(ids, mask, p) == lay.segments.width == 6
    # logits kept: the prompts' last columns, then the slot columns; token 0 of each completion is
    # predicted by its prompt's last column, token t by the slot column of token t − 1
    assert lay.keep.tolist() == [1, 4, 2, 3, 5]
    assert lay.first.tolist() == [0, 0, 1]
    assert lay.seq.tolist() == [0, 0, 0, 1, 2, 2] and lay.pos.tolist() == [0, 1, 2, 0, 0, 1]


def test_layout_pads_to_a_bucket_with_a_group_nothing_reads():
    """`bucket`: a last group of padding (the last token again, positions from 0, no completions) fills the row to
    a multiple; `keep` repeats its last column to one; the prompts and the kept count are said apart."""
    ids, mask, pos, p = padded_batch([[5, 6], [5, 6], [7]], [[1, 2, 3], [4], [8, 9]])
    lay = pack_groups(ids, mask, pos, p, bucket=4)
    assert lay.input_ids.tolist() == [[5, 6, 1, 2, 7, 8, 8, 8]]
    assert lay.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1]]
    assert lay.segments == Segments(prefixes=((0, 2), (4, 1), (6, 2)), slots=(((2, 2),), ((5, 1),), ()))
    assert lay.keep.tolist() == [1, 4, 2, 3, 5, 5, 5, 5]
    assert (lay.groups, lay.kept) == (2, 5)
    assert pack_groups(ids, mask, pos, p, bucket=3).input_ids.shape[1] == 6  # already a multiple: no group added
    assert len(pack_groups(ids, mask, pos, p, bucket=3).segments.prefixes) == 2


def test_the_bucket_is_for_bf16_matmuls_on_a_cpu():
    """oneDNN builds a kernel per shape for a CPU's bf16 matmuls; MKL's fp32 ones build nothing."""
    cpu = torch.device("cpu")
    assert token_bucket(cpu) == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert token_bucket(cpu) == TOKEN_BUCKET
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert token_bucket(cpu) == 1


def test_padding_to_a_bucket_changes_no_log_prob_and_no_gradient(tokenizer):
    """The padding group is attended by nothing and its logits are dropped: log-probs, entropies and every
    gradient as without it (fp32: the matmuls' other row counts may round differently, ~1e-6)."""
    model = build_tiny("tiny-4m", vocab_size=len(tokenizer), seed=1, max_seq_len=64, pad_token_id=PAD,
                       eos_token_id=tokenizer.eos_token_id)
    ids, mask, pos, p = case(len(tokenizer))

    def run(bucket: int):
        model.zero_grad(set_to_none=True)
        logps, ent = shared_prompt_logprobs(model, ids, mask, pos, p, entropy=True, bucket=bucket)
        logps.sum().backward()
        return logps.detach(), ent, {n: q.grad.clone() for n, q in model.named_parameters()}

    plain, ent_plain, g_plain = run(1)
    padded, ent_padded, g_padded = run(TOKEN_BUCKET)
    assert packed_width(ids, mask, p) % TOKEN_BUCKET  # the case does pad
    torch.testing.assert_close(padded, plain, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_padded, ent_plain, atol=1e-5, rtol=0)
    for n, g in g_plain.items():
        torch.testing.assert_close(g_padded[n], g, atol=1e-5, rtol=1e-4, msg=n)


def test_layout_rejects_completions_that_are_not_right_padded():
    ids, mask, pos, p = padded_batch([[5, 6], [5, 6]], [[1, 2, 3], [4]])
    mask[0, p + 1] = False  # a hole inside completion 0
    with pytest.raises(ValueError, match="right-padded"):
        pack_groups(ids, mask, pos, p)


@pytest.fixture(params=["matmul", "sdpa", "mixed", "causal", "causal-padded", "all-three", "blocks", "blocks-sdpa",
                        "blocks-and-squares"])
def products(request, monkeypatch):
    """Every way the kernel computes its products: all in one padded bucket through matmuls (short keys),
    every size in its own bucket through fused SDPA under a mask (long keys), both in one forward (the
    case's products have 3 to 15 keys; from 9 they go to SDPA), every product as a causal square through
    SDPA (very long keys) in buckets of one size or all in one bucket padded at the end, and all three
    ways in one forward (matmuls below 5 keys, masked SDPA below 11, causal squares from 11); and every
    sequence longer than 3 tokens as blocks of at most 3 queries, through matmuls, through masked SDPA, and
    as blocks through matmuls below 11 keys with the longer sequences whole as causal squares — forced by
    moving the thresholds, so all run on the same short case."""
    sdpa_from, causal_from, budget, block = {
        "matmul": (10**9, 10**9, 10**9, 10**9), "sdpa": (1, 10**9, 0, 10**9), "mixed": (9, 10**9, 0, 10**9),
        "causal": (1, 1, 0, 10**9), "causal-padded": (1, 1, 10**9, 10**9), "all-three": (5, 11, 0, 10**9),
        "blocks": (10**9, 10**9, 0, 3), "blocks-sdpa": (1, 10**9, 4096, 3), "blocks-and-squares": (11, 11, 0, 3)}[request.param]
    monkeypatch.setattr(prefix_attention, "SDPA_FROM", sdpa_from)
    monkeypatch.setattr(prefix_attention, "CAUSAL_FROM", causal_from)
    monkeypatch.setattr(prefix_attention, "PAD_BUDGET", budget)
    monkeypatch.setattr(prefix_attention, "QUERY_BLOCK", block)
    return request.param


def test_plan_buckets_products_of_similar_size_and_restores_column_order():
    # one prompt of 4 tokens and slots of 6, 6, 5 and 1 columns, then a prompt of 2 with one slot of 6
    seg = Segments(prefixes=((0, 4), (22, 2)), slots=(((4, 6), (10, 6), (16, 5), (21, 1)), ((24, 6),)))
    plan = prefix_attention._plan(seg, 10**9, 10**9, 0, torch.device("cpu"))
    # no padding allowed: equal sizes only — slots 6 after prompt 4 (×2), slot 6 after prompt 2, slot 5, …
    assert [(b.m, b.length, b.keys) for b in plan.buckets] == [(2, 6, 10), (1, 6, 8), (1, 5, 9), (1, 4, 4), (1, 2, 2), (1, 1, 5)]
    loose = prefix_attention._plan(seg, 10**9, 10**9, 10**9, torch.device("cpu"))
    assert [(b.m, b.length, b.keys) for b in loose.buckets] == [(7, 6, 10)]       # everything in one
    for p in (plan, loose):
        # every column's output comes from the bucket row that holds that column as its query
        assert p.q_index[p.out_index].tolist() == list(range(seg.width))
    # the slot at 16 (5 queries after the first prompt's 4 keys) in the loose bucket: its keys are the
    # prompt's, then its own, then padding
    m = 3
    assert loose.k_index[m * 10 : (m + 1) * 10].tolist() == [0, 1, 2, 3, 16, 17, 18, 19, 20, 0]
    assert loose.buckets[0].mask[m, 0, 0, 2].tolist() == [0, 0, 0, 0, 0, 0, 0, float("-inf"), float("-inf"), float("-inf")]
    # as causal squares in one bucket: each slot's rows are [its prompt | itself], padded at the end to 10
    square = prefix_attention._plan(seg, 1, 1, 10**9, torch.device("cpu"))
    assert [(b.m, b.length, b.keys, b.mask) for b in square.buckets] == [(7, 10, 10, None)]
    assert square.q_index[m * 10 : (m + 1) * 10].tolist() == [0, 1, 2, 3, 16, 17, 18, 19, 20, 0]
    assert square.q_index[square.out_index].tolist() == list(range(seg.width))


def test_plan_gathers_token_head_rows_straight_into_each_buckets_layout():
    """With Hq query heads and Hkv key heads the gathers index (column · H + head) rows: a bucket's queries come
    out as (M, Hq, L) rows, its keys as (M, Hkv, S), and every (column, head) output is its own query's row."""
    seg = Segments(prefixes=((0, 4), (22, 2)), slots=(((4, 6), (10, 6), (16, 5), (21, 1)), ((24, 6),)))
    for sdpa_from, block in ((10**9, 10**9), (10**9, 3), (1, 10**9)):  # matmuls, query blocks, causal squares
        by_column = prefix_attention._plan(seg, sdpa_from, sdpa_from, 0, torch.device("cpu"), block)
        plan = prefix_attention._plan(seg, sdpa_from, sdpa_from, 0, torch.device("cpu"), block, (4, 2))
        assert plan.q_index[plan.out_index].tolist() == list(range(seg.width * 4))
        # the outputs' backward gather: a kept row takes its (column, head)'s gradient, every other row none
        assert plan.out_reader[plan.out_index].tolist() == list(range(seg.width * 4))
        dropped = torch.ones(plan.q_index.numel(), dtype=torch.bool)
        dropped[plan.out_index] = False
        assert bool((plan.out_reader[dropped] == seg.width * 4).all()) and (sdpa_from == 1) <= bool(dropped.any())
        q_at = k_at = qc = kc = 0
        for b in plan.buckets:
            cols = by_column.q_index[qc : qc + b.m * b.length].view(b.m, 1, b.length)
            assert plan.q_index[q_at : q_at + b.m * 4 * b.length].view(b.m, 4, b.length).equal(
                cols * 4 + torch.arange(4).view(1, 4, 1))
            keys = by_column.k_index[kc : kc + b.m * b.keys].view(b.m, 1, b.keys)
            assert plan.k_index[k_at : k_at + b.m * 2 * b.keys].view(b.m, 2, b.keys).equal(
                keys * 2 + torch.arange(2).view(1, 2, 1))
            q_at, k_at, qc, kc = q_at + b.m * 4 * b.length, k_at + b.m * 2 * b.keys, qc + b.m * b.length, kc + b.m * b.keys


def test_plan_runs_a_long_sequence_as_blocks_of_queries_each_with_only_the_keys_it_reads():
    # a prompt of 4 tokens and slots of 6 and 5 columns; blocks of at most 3 queries
    seg = Segments(prefixes=((0, 4),), slots=(((4, 6), (10, 5)),))
    plan = prefix_attention._plan(seg, 10**9, 10**9, 0, torch.device("cpu"), 3)
    # the slot of 6: queries 0–2 with the prompt's 4 keys and its own first 3, queries 3–5 with all 10; the slot
    # of 5 as 2 + 3 (4 + 2 keys, then 4 + 5); the prompt as 2 + 2 (keys 2, then 4)
    assert sorted((b.m, b.length, b.keys) for b in plan.buckets) == [(1, 2, 2), (1, 2, 4), (1, 2, 6), (1, 3, 7),
                                                                      (1, 3, 9), (1, 3, 10)]
    assert plan.q_index[plan.out_index].tolist() == list(range(seg.width))
    [(i, later)] = [(i, b) for i, b in enumerate(plan.buckets) if (b.length, b.keys) == (3, 10)]
    at = sum(b.m * b.keys for b in plan.buckets[:i])
    assert plan.k_index[at : at + 10].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # the prompt, then all its own keys
    # its query i (own position 3 + i) reads the prompt and own keys 0 … 3 + i: a prefix of 4 + 3 + i + 1
    assert later.limit[0].tolist() == [8, 9, 10]
    # a sequence long enough for the causal squares (here from 10 keys: the slot of 6) stays whole, a square
    squares = prefix_attention._plan(seg, 10, 10, 0, torch.device("cpu"), 3)
    assert sorted((b.m, b.length, b.keys, b.mask is None) for b in squares.buckets) == [
        (1, 2, 2, False), (1, 2, 4, False), (1, 2, 6, False), (1, 3, 9, False), (1, 10, 10, True)]
    assert squares.q_index[squares.out_index].tolist() == list(range(seg.width))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # GQA (tiny-30m-like heads) and q/k/v biases (qwen2)
@pytest.mark.parametrize("amp", [False, True])
def test_shared_prefix_forward_equals_the_padded_one(tokenizer, arch, amp, products):
    """Log-probs and every parameter's gradient equal the padded forward's, in fp32 and under bf16 autocast."""
    model = build_tiny("tiny-4m", vocab_size=len(tokenizer), arch=arch, seed=1, max_seq_len=64,
                       pad_token_id=PAD, eos_token_id=tokenizer.eos_token_id)
    model.config._attn_implementation = "eager"
    if arch == "qwen2":  # random biases, so that a wrong bias path shows
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    ids, mask, pos, p = case(len(tokenizer))
    targets, c_mask = ids[:, p:], mask[:, p:]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp)

    def run(shared: bool):
        model.zero_grad(set_to_none=True)
        with autocast:
            if shared:
                logps = shared_prompt_logprobs(model, ids, mask, pos, p) * c_mask
            else:
                logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=ids.shape[1] - p + 1).logits[:, :-1]
                logps = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0] * c_mask
        logps.sum().backward()
        return logps.detach(), {n: q.grad.clone() for n, q in model.named_parameters()}

    padded, g_padded = run(False)
    shared, g_shared = run(True)
    # fp32: round-off only. bf16: the two forwards round different sums (other GEMM shapes), ~1e-2 on a log-prob
    atol = 5e-2 if amp else 1e-4
    torch.testing.assert_close(shared, padded, atol=atol, rtol=0)
    for n, g in g_padded.items():
        # bf16: the two forwards' roundings reach ~0.1 on the tied embedding's largest entries (0.104 over the
        # rtol with the log-probs' C kernel, 0.090 with PyTorch's ops; its gradient agrees to 0.7% in norm either way)
        torch.testing.assert_close(g_shared[n], g, atol=atol * 3 if amp else atol * 2, rtol=5e-2 if amp else 1e-3, msg=n)
    assert model.config._attn_implementation == "eager"  # switched back after the forward


def test_kernel_is_what_runs_and_slots_never_see_each_other(tokenizer, products):
    """Changing one completion's tokens leaves every other completion's log-probs bitwise unchanged —
    which a kernel that let slots see their left neighbours would break — and the kernel is the one called."""
    model = build_tiny("tiny-1m", vocab_size=len(tokenizer), seed=0, max_seq_len=64, pad_token_id=PAD)
    ids, mask, pos, p = case(len(tokenizer))
    calls = []
    from transformers import AttentionInterface

    kernel = AttentionInterface._global_mapping[NAME]
    AttentionInterface._global_mapping[NAME] = lambda *a, **k: calls.append(1) or kernel(*a, **k)
    try:
        with torch.no_grad():
            before = shared_prompt_logprobs(model, ids, mask, pos, p)
            changed = ids.clone()
            changed[0, p : p + 9] = torch.randint(1, len(tokenizer), (9,))  # sequence 0 = slot 0 of group 0
            after = shared_prompt_logprobs(model, changed, mask, pos, p)
    finally:
        AttentionInterface._global_mapping[NAME] = kernel
    assert len(calls) == 2 * model.config.num_hidden_layers
    assert torch.equal(before[1:], after[1:])
    assert not torch.equal(before[0, 1:], after[0, 1:])


def test_a_row_that_is_not_the_segments_width_is_an_error(tokenizer):
    model = build_tiny("tiny-1m", vocab_size=len(tokenizer), seed=0, max_seq_len=64, pad_token_id=PAD)
    ids = torch.ones(1, 10, dtype=torch.long)
    segments = Segments(prefixes=((0, 3),), slots=(((3, 2), (5, 2)),))  # 7 columns
    with shared_prefix(model), pytest.raises(ValueError, match="one packed row of 7 columns"):
        model(input_ids=ids, attention_mask=torch.ones(1, 1, 1, 10, dtype=torch.bool), segments=segments)


def test_the_matmul_path_keeps_its_probabilities_only_in_the_values_dtype():
    """Under bf16 the softmax's fp32 output is not kept for the backward (eager attention keeps it beside
    the bf16 copy): every saved tensor of the probabilities' size is bf16; the gradients match eager's
    two matmuls and fp32 softmax to bf16 round-off, and in fp32 they match it to fp32 round-off."""
    g = torch.Generator().manual_seed(0)
    m, length, keys, hq, hkv, d = 3, 5, 9, 4, 2, 8
    allowed = torch.rand(m, 1, 1, length, keys, generator=g) > 0.3
    allowed[..., 0] = True
    bucket = prefix_attention._Bucket(m, length, keys, False, torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf")))
    base = [torch.randn(m, h, n, d, generator=g) for n, h in ((length, hq), (keys, hkv), (keys, hkv))]

    def eager(q, k, v):  # the pre-`_Softmax` form: fp32 softmax kept by autograd, cast after
        group = hq // hkv
        scores = torch.matmul(q.reshape(m, hkv, group * length, d), k.transpose(-1, -2)).view(m, hkv, group, length, keys)
        probs = torch.softmax(scores.float() * 0.3 + bucket.mask, dim=-1).to(v.dtype)
        return torch.matmul(probs.view(m, hkv, group * length, keys), v).reshape(-1, d)

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        runs = []
        for fn in (eager, lambda q, k, v: prefix_attention._matmul_bucket(bucket, q, k, v, 0.3, 0.0)):
            inputs = [t.detach().to(dtype).clone().requires_grad_() for t in base]
            saved: list[torch.Tensor] = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                out = fn(*inputs)
            out.float().square().sum().backward()
            runs.append((out, [t.grad for t in inputs], saved))
        (ref, ref_grads, ref_saved), (ours, grads, saved) = runs
        probs_size = m * hq * length * keys
        if dtype is torch.bfloat16:
            assert any(t.dtype == torch.float32 and t.numel() == probs_size for t in ref_saved)  # what eager keeps
            assert all(t.dtype == torch.bfloat16 for t in saved if t.numel() == probs_size)
            assert sum(t.numel() * t.element_size() for t in saved) < sum(t.numel() * t.element_size() for t in ref_saved)
        torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)
        assert all(a is not None for a in grads + ref_grads)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, atol=tol * 4, rtol=tol * 4)
