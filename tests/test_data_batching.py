"""Padding, packing and weighted mixing."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from posttrain.data import (
    IGNORE_INDEX,
    EncodedCompletion,
    EncodedPreference,
    EncodedSFT,
    collate_preference,
    collate_sft,
    mix,
    mix_indices,
    mix_quotas,
    pack_documents,
)


def test_collate_sft_right_pads():
    batch = collate_sft([EncodedSFT([5, 6, 7], [-100, 6, 7]), EncodedSFT([8], [8])], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.labels.tolist() == [[-100, 6, 7], [8, -100, -100]]  # padding never carries loss
    assert batch.input_ids.dtype == torch.long and batch.labels.shape == (2, 3)


def test_collate_sft_errors():
    with pytest.raises(ValueError, match="empty batch"):
        collate_sft([], pad_id=0)
    with pytest.raises(ValueError, match="batch row 0: 2 input_ids but 1 labels"):
        collate_sft([EncodedSFT([1, 2], [2])], pad_id=0)
    with pytest.raises(ValueError, match=r"pad_to=1 is shorter than the longest sequence in the batch \(2 tokens\)"):
        collate_sft([EncodedSFT([1, 2], [1, 2])], pad_id=0, pad_to=1)


def test_collate_preference_pads_both_sides_to_one_width():
    pair = EncodedPreference(EncodedCompletion([1, 2, 3], [-100, -100, 3], 2),
                             EncodedCompletion([1, 2, 4, 5, 6], [-100, -100, 4, 5, 6], 2))
    batch = collate_preference([pair], pad_id=9)
    # width = longest of chosen (3) and rejected (5) = 5
    assert batch.chosen.input_ids.tolist() == [[1, 2, 3, 9, 9]]
    assert batch.chosen.labels.tolist() == [[-100, -100, 3, -100, -100]]
    assert batch.rejected.input_ids.tolist() == [[1, 2, 4, 5, 6]]
    assert batch.prompt_lens.tolist() == [2]


def test_pack_documents():
    rows = pack_documents([[1, 2, 3], [4], [5, 6, 7, 8]], seq_len=4, eos_id=0)
    # stream 1 2 3 0 4 0 5 6 7 8 0 (11 tokens) -> 2 rows of 4, tail "7 8 0" dropped
    assert rows.tolist() == [[1, 2, 3, 0], [4, 0, 5, 6]]
    with pytest.raises(ValueError, match="the corpus is 3 tokens \\(EOS included\\), shorter than one row of seq_len 4"):
        pack_documents([[1, 2]], seq_len=4, eos_id=0)


def test_mix_quotas_largest_remainder():
    assert mix_quotas([0.5, 0.3, 0.2], 1000) == [500, 300, 200]
    # 10/3 = 3.33 each: floors 3,3,3 and the one left over goes to the earliest tie
    assert mix_quotas([1, 1, 1], 10) == [4, 3, 3]
    # 7·(2/7, 5/7) = 2, 5 exactly; weight 0 gets nothing
    assert mix_quotas([2, 0, 5], 7) == [2, 0, 5]
    # 5·(0.1, 0.9) = 0.5, 4.5: remainders tie at .5, the earlier source wins
    assert mix_quotas([0.1, 0.9], 5) == [1, 4]


def test_mix_proportions_and_even_reuse():
    a = [f"a{i}" for i in range(4)]
    b = [f"b{i}" for i in range(100)]
    out = mix([(a, 3.0), (b, 1.0)], n=40, seed=7)
    counts = Counter(x[0] for x in out)
    assert counts == {"a": 30, "b": 10}  # 40 · 3/4 = 30, 40 · 1/4 = 10
    # source a (4 items) is walked in whole permutations: 30 = 7·4 + 2, so each item 7 or 8 times
    per_item = Counter(x for x in out if x[0] == "a")
    assert sorted(per_item.values()) == [7, 7, 8, 8]
    # source b is large: no item of it repeats
    assert len({x for x in out if x[0] == "b"}) == 10
    # the sources are shuffled together, not concatenated source after source
    assert [x[0] for x in out] != ["a"] * 30 + ["b"] * 10


def test_mix_is_deterministic_for_a_seed():
    sources = [(list(range(50)), 1.0), (list(range(100, 150)), 2.0)]
    assert mix(sources, 60, seed=1) == mix(sources, 60, seed=1)
    assert mix(sources, 60, seed=1) != mix(sources, 60, seed=2)
    # mix is mix_indices looked up in the sources
    picks = mix_indices([50, 50], [1.0, 2.0], 60, seed=1)
    assert mix(sources, 60, seed=1) == [sources[s][0][i] for s, i in picks]


def test_mix_errors():
    with pytest.raises(ValueError, match=r"source 1: weight -1; expected a finite number ≥ 0"):
        mix([([1], 1.0), ([2], -1)], 3, seed=0)
    with pytest.raises(ValueError, match=r"sum to 0"):
        mix([([1], 0.0)], 3, seed=0)
    with pytest.raises(ValueError, match="source 0 is empty but has weight 1.0"):
        mix([([], 1.0), ([2], 1.0)], 3, seed=0)
    with pytest.raises(ValueError, match="at least one source"):
        mix([], 3, seed=0)
    assert mix([([1], 1.0)], 0, seed=0) == []
    assert IGNORE_INDEX == -100
