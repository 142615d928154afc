"""The packed and shared-prompt log-prob forwards agree with the naive padded forward."""

from __future__ import annotations

import pytest
import torch

from posttrain.data import EncodedCompletion, encode_preference, parse_record
from posttrain.models import build_tiny
from posttrain.stages._packing import (
    first_fit,
    pair_logps,
    sequence_logps,
    sequence_logps_padded,
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["sdpa", "eager"])  # "auto" picks eager on a CPU for short contexts
def setup(request, tokenizer, world):
    torch.manual_seed(0)
    model = build_tiny("tiny-1m", vocab_size=len(tokenizer), seed=0, pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    model.set_attn_implementation(request.param)
    pairs = [encode_preference(parse_record(r, "preference"), tokenizer, 160) for r in world.preference_split(12)]
    return model, pairs, tokenizer.pad_token_id


def test_first_fit_packs_longest_first_within_the_cap():
    # lengths 5, 4, 3, 2 with cap 7: 5 → row 0; 4 → row 1; 3 → row 1 (4+3=7); 2 → row 0 (5+2=7)
    assert first_fit([3, 5, 2, 4], 7) == [[1, 2], [3, 0]]


@pytest.mark.parametrize("length_normalized", [False, True])
def test_packed_sequences_match_the_padded_forward(setup, length_normalized):
    model, pairs, pad = setup
    seqs = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    naive = sequence_logps_padded(model, seqs, pad, length_normalized=length_normalized)
    packed = sequence_logps(model, seqs, pad, length_normalized=length_normalized, row_len=100)
    # fp32 sums of ~40 log-probs of ~-6: rounding ~1e-5; a wrong mask or position would be off by > 0.1
    torch.testing.assert_close(packed, naive, rtol=0, atol=1e-4)


def test_shared_prompt_pairs_match_the_padded_forward(setup):
    model, pairs, pad = setup
    naive_a = sequence_logps_padded(model, [p.chosen for p in pairs], pad, length_normalized=False)
    naive_b = sequence_logps_padded(model, [p.rejected for p in pairs], pad, length_normalized=False)
    a, b = pair_logps(model, [(p.chosen, p.rejected) for p in pairs], pad, length_normalized=False)
    torch.testing.assert_close(a, naive_a, rtol=0, atol=1e-4)
    torch.testing.assert_close(b, naive_b, rtol=0, atol=1e-4)


def test_shared_prompt_gradients_match_the_padded_forward(setup):
    model, pairs, pad = setup
    subset = pairs[:4]

    def grads(fn) -> list[torch.Tensor]:
        model.zero_grad()
        a, b = fn()
        (a - 2 * b).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    naive = grads(lambda: (sequence_logps_padded(model, [p.chosen for p in subset], pad, length_normalized=False),
                           sequence_logps_padded(model, [p.rejected for p in subset], pad, length_normalized=False)))
    shared = grads(lambda: pair_logps(model, [(p.chosen, p.rejected) for p in subset], pad, length_normalized=False))
    for g_naive, g_shared in zip(naive, shared):
        torch.testing.assert_close(g_shared, g_naive, rtol=1e-3, atol=1e-5)
    model.zero_grad()


def test_the_second_reply_never_sees_the_first(setup):
    """Changing reply a leaves reply b's log-prob bitwise unchanged (a kernel that let b see a would not),
    and a pair whose replies do not share the prompt is an error naming the pair."""
    model, _, _ = setup
    a = EncodedCompletion([1, 2, 3, 4], [-100, -100, 3, 4], prompt_len=2)
    b = EncodedCompletion([1, 2, 5, 6], [-100, -100, 5, 6], prompt_len=2)
    other = EncodedCompletion([1, 2, 7, 8], [-100, -100, 7, 8], prompt_len=2)
    with torch.no_grad():
        la, lb = pair_logps(model, [(a, b)], 0, length_normalized=False)
        la2, lb2 = pair_logps(model, [(other, b)], 0, length_normalized=False)
    assert torch.equal(lb, lb2) and not torch.equal(la, la2)
    with pytest.raises(ValueError, match="pair 0 .* does not share its prompt tokens"):
        pair_logps(model, [(a, EncodedCompletion([9, 2, 5], [-100, -100, 5], prompt_len=2, origin="x.jsonl:3"))], 0,
                   length_normalized=False)


def test_pairs_length_normalized_and_a_shared_prompt_across_pairs(setup):
    """Length-normalized means equal the padded forward's; two pairs with one prompt share it."""
    model, pairs, pad = setup
    twice = pairs[:3] + [pairs[2]]  # pairs 2 and 3 have the same prompt: one row of 4 slots
    naive_a = sequence_logps_padded(model, [p.chosen for p in twice], pad, length_normalized=True)
    naive_b = sequence_logps_padded(model, [p.rejected for p in twice], pad, length_normalized=True)
    a, b = pair_logps(model, [(p.chosen, p.rejected) for p in twice], pad, length_normalized=True)
    # means of ~-6 log-probs: fp32 rounding ~1e-6; a slot seeing its neighbour would move them by > 0.01
    torch.testing.assert_close(a, naive_a, rtol=0, atol=1e-5)
    torch.testing.assert_close(b, naive_b, rtol=0, atol=1e-5)
