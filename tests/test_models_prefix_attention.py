"""The shared-prefix attention kernel against the naive reference: each sequence in its own padded row."""

from __future__ import annotations

import pytest
import torch

from posttrain.models import build_tiny
from posttrain.models import prefix_attention
from posttrain.models.prefix_attention import NAME, shared_prefix
from posttrain.rollout.text import positions_from_mask
from posttrain.stages._packing import group_rows, shared_prompt_logits

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


def test_layout_shares_each_prompt_once_and_keeps_positions():
    # prompts [5, 6] ×2 then [7] ×1: rows = 2 groups, 2 slots; N = 3 (longest completion)
    ids, mask, pos, p = padded_batch([[5, 6], [5, 6], [7]], [[1, 2, 3], [4], [8, 9]])
    lay = group_rows(ids, mask, pos, p, PAD)
    assert (lay.prefix_len, lay.slots) == (2, 2)
    assert lay.input_ids.tolist() == [[5, 6, 1, 2, 3, 4, 0, 0], [0, 7, 8, 9, 0, 0, 0, 0]]
    # slot tokens continue from the prompt's length: [5 6 | 1 2 3] → 2 3 4; [7 | 8 9] → 1 2
    real = lay.key_mask[:, 0, 0]
    assert lay.position_ids[real].tolist() == [0, 1, 2, 3, 4, 2, 0, 1, 2]
    assert lay.row.tolist() == [0, 0, 1] and lay.slot.tolist() == [0, 1, 0]


@pytest.fixture(params=["matmul", "sdpa"])
def products(request, monkeypatch):
    """Both ways the kernel computes its two products: matmuls + fp32 softmax (short keys), and fused
    SDPA (long keys) — forced here by moving the threshold, so both run on the same short case."""
    monkeypatch.setattr(prefix_attention, "SDPA_FROM", 10**9 if request.param == "matmul" else 1)
    return request.param


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # GQA (tiny-30m-like heads) and q/k/v biases (qwen2)
@pytest.mark.parametrize("amp", [False, True])
def test_shared_prefix_forward_equals_the_padded_one(tokenizer, arch, amp, products):
    """Logits and every parameter's gradient equal the padded forward's, in fp32 and under bf16 autocast."""
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
                logits = shared_prompt_logits(model, ids, mask, pos, p, PAD)
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
        torch.testing.assert_close(g_shared[n], g, atol=atol * 2, rtol=5e-2 if amp else 1e-3, msg=n)
    assert model.config._attn_implementation == "eager"  # switched back after the forward


def test_kernel_is_what_runs_and_slots_never_see_each_other(tokenizer, products):
    """Changing one completion's tokens leaves every other completion's logits bitwise unchanged —
    which a mask that let slots see their left neighbours would break — and the kernel is the one called."""
    model = build_tiny("tiny-1m", vocab_size=len(tokenizer), seed=0, max_seq_len=64, pad_token_id=PAD)
    ids, mask, pos, p = case(len(tokenizer))
    calls = []
    from transformers import AttentionInterface

    kernel = AttentionInterface._global_mapping[NAME]
    AttentionInterface._global_mapping[NAME] = lambda *a, **k: calls.append(1) or kernel(*a, **k)
    try:
        with torch.no_grad():
            before = shared_prompt_logits(model, ids, mask, pos, p, PAD)
            changed = ids.clone()
            changed[0, p : p + 9] = torch.randint(1, len(tokenizer), (9,))  # sequence 0 = slot 0 of group 0
            after = shared_prompt_logits(model, changed, mask, pos, p, PAD)
    finally:
        AttentionInterface._global_mapping[NAME] = kernel
    assert len(calls) == 2 * model.config.num_hidden_layers
    assert torch.equal(before[1:], after[1:])
    assert not torch.equal(before[0, 1:], after[0, 1:])


def test_width_that_does_not_split_into_slots_is_an_error(tokenizer):
    model = build_tiny("tiny-1m", vocab_size=len(tokenizer), seed=0, max_seq_len=64, pad_token_id=PAD)
    ids = torch.ones(1, 10, dtype=torch.long)
    with shared_prefix(model), pytest.raises(ValueError, match="not prefix_len 3 \\+ slots 2"):
        model(input_ids=ids, attention_mask=torch.ones(1, 1, 1, 10, dtype=torch.bool), prefix_len=3, slots=2)
