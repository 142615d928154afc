"""EpochSampler / BatchIterator: per-epoch permutations and exact resume from a small state dict."""

from __future__ import annotations

import json

import numpy as np
import pytest

from posttrain.data import BatchIterator, EpochSampler


def take(sampler: EpochSampler, k: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(k)]


def test_epochs_are_seeded_permutations():
    s = EpochSampler(10, 3, seed=5)
    assert s.batches_per_epoch == 3  # 10 // 3, the last partial batch dropped
    batches = take(s, 6)
    epoch0 = np.random.default_rng(5).permutation(10).tolist()  # seed + epoch = 5
    epoch1 = np.random.default_rng(6).permutation(10).tolist()  # seed + epoch = 6
    assert batches[:3] == [epoch0[0:3], epoch0[3:6], epoch0[6:9]]
    assert batches[3:] == [epoch1[0:3], epoch1[3:6], epoch1[6:9]]
    assert s.epoch == 1 and s.position == 3


def test_keep_last_and_no_shuffle():
    s = EpochSampler(5, 2, seed=0, shuffle=False, drop_last=False)
    assert s.batches_per_epoch == 3
    assert take(s, 4) == [[0, 1], [2, 3], [4], [0, 1]]


@pytest.mark.parametrize("kill_after", [0, 1, 3, 4, 7])
def test_resume_equals_uninterrupted(kill_after):
    reference = take(EpochSampler(11, 4, seed=3), 10)
    first = EpochSampler(11, 4, seed=3)
    take(first, kill_after)
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON round trip (trainer_state)
    resumed = EpochSampler(11, 4, seed=999)  # the saved seed wins
    resumed.load_state_dict(state)
    assert take(resumed, 10 - kill_after) == reference[kill_after:]
    assert resumed.seed == 3


def test_state_dict_content():
    s = EpochSampler(11, 4, seed=3)
    take(s, 3)  # 2 batches per epoch: the third starts epoch 1
    assert s.state_dict() == {"epoch": 1, "position": 1, "seed": 3, "n": 11, "batch_size": 4,
                              "shuffle": True, "drop_last": True}


def test_load_state_dict_rejects_a_changed_dataset():
    s = EpochSampler(11, 4, seed=3)
    with pytest.raises(ValueError, match="sampler state was saved with n=12 but this run has n=11; the data or batch "
                                         "size changed since the checkpoint"):
        s.load_state_dict({**s.state_dict(), "n": 12})
    with pytest.raises(ValueError, match=r"sampler state is missing \['position'\]"):
        s.load_state_dict({k: v for k, v in s.state_dict().items() if k != "position"})
    with pytest.raises(ValueError, match="position=9 is out of range"):
        s.load_state_dict({**s.state_dict(), "position": 9})


def test_bad_construction():
    with pytest.raises(ValueError, match="empty dataset"):
        EpochSampler(0, 1, seed=0)
    with pytest.raises(ValueError, match="batch_size 8 is larger than the dataset \\(5 items\\) with drop_last=True"):
        EpochSampler(5, 8, seed=0)
    with pytest.raises(ValueError, match="batch_size must be ≥ 1, got 0"):
        EpochSampler(5, 0, seed=0)


def test_batch_iterator_resume():
    items = [f"x{i}" for i in range(9)]
    it = BatchIterator(items, 2, collate=lambda rows: "+".join(rows), seed=11)
    reference = [next(it) for _ in range(9)]
    first = BatchIterator(items, 2, collate=lambda rows: "+".join(rows), seed=11)
    [next(first) for _ in range(5)]
    resumed = BatchIterator(items, 2, collate=lambda rows: "+".join(rows), seed=11)
    resumed.load_state_dict(first.state_dict())
    assert [next(resumed) for _ in range(4)] == reference[5:]
    assert resumed.epoch == 2  # 4 batches per epoch; batch 9 is the first of epoch 2
