"""Preference data for the reward-model / DPO stages: world rankings, skip counts, bad input, KTO partners,
the scalar head's pooling and the reward normalization file."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.data import DataError, EncodedCompletion, UnpairedExample
from posttrain.models import build_tiny
from posttrain.models.heads import (
    RewardNormalization,
    last_positions,
    last_token_scores,
    load_scalar_model,
)
from posttrain.runtime.config import DataSource
from posttrain.stages._gold_eval import head_to_head
from posttrain.stages._preference_data import (
    encode_ranking_like,
    kto_partners,
    load_records,
    trim_to_response,
    world_rankings,
)
from posttrain.worlds.arithmetic import Fact, gold_reward
from conftest import world_tasks


pytestmark = pytest.mark.usefixtures("one_thread")


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_world_rankings_are_strictly_ordered_by_the_gold_judge(world):
    rows = world_rankings(world, 50, seed_offset=3)
    for row in rows:
        # The judge only reads the final answer, so any fact with the row's value judges it like the real one.
        fact = Fact(int(row["answer"]), "+", 0)
        golds = [gold_reward(fact, r) for r in row["responses"]]
        # concise 1.0 > ramble (1 − 0.01·filler chars, ≥ 0.5) > wrong 0.0
        assert golds[0] == 1.0 and 0.5 <= golds[1] < 1.0 and golds[2] == 0.0, (row, golds)


def test_file_pairs_skip_ties_and_count_them(tmp_path, world):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "What is 2+3?", "chosen": "5", "rejected": "6"},
        {"prompt": "What is 4+4?", "chosen": "8", "rejected": "8"},
        {"prompt": "What is 1+1?", "chosen": "2", "rejected": " 2"},
    ])
    loaded = load_records(world_tasks(world), [DataSource(path=path)], "preference", seed=0)
    assert len(loaded.records) == 1  # rows 2 and 3 tie (identical after stripping)
    assert loaded.skipped == {"identical chosen and rejected": 2}
    assert "skipped 2 with identical chosen and rejected (lines 2, 3)" in loaded.summaries[0]


@pytest.mark.parametrize(("kind", "row", "message"), [
    ("preference", {"prompt": "What is 2+3?", "chosen": "5", "rejected": ""}, "field 'rejected': expected a non-empty string"),
    ("preference", {"prompt": "What is 2+3?", "chosen": "   ", "rejected": "6"}, "field 'chosen': expected a non-empty string"),
    ("ranking", {"prompt": "What is 2+3?", "responses": ["5"]}, "responses"),
    ("unpaired", {"prompt": "What is 2+3?", "completion": "", "label": True}, "field 'completion'"),
])
def test_bad_preference_input_is_an_error_naming_the_line(tmp_path, world, kind, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(DataError, match=message) as err:
        load_records(world_tasks(world), [DataSource(path=path)], kind, seed=0)
    assert "bad.jsonl:1" in str(err.value)


def test_a_file_of_only_ties_is_an_error(tmp_path, world):
    path = write_jsonl(tmp_path / "ties.jsonl", [{"prompt": "x?", "chosen": "1", "rejected": "1"}])
    with pytest.raises(DataError, match="no usable preference records: all 1 rows were skipped"):
        load_records(world_tasks(world), [DataSource(path=path)], "preference", seed=0)


def test_world_unpaired_split_alternates_good_and_bad(world):
    loaded = load_records(world_tasks(world), [DataSource(world="arithmetic", n=6)], "unpaired", seed=0)
    assert [r.label for r in loaded.records] == [True, False, True, False, True, False]
    assert loaded.records[0].prompt == loaded.records[1].prompt  # the two halves of one world pair


def test_kto_partners_never_pair_an_example_with_its_own_prompt():
    examples = [UnpairedExample(p, c, label) for p, c, label in
                [("a", "1", True), ("a", "2", False), ("b", "3", True), ("b", "4", False), ("c", "5", True)]]
    partner = kto_partners(examples, seed=0)
    assert all(examples[j].prompt != examples[i].prompt for i, j in enumerate(partner))
    with pytest.raises(DataError, match="at least two prompts"):
        kto_partners(examples[:2], seed=0)


def test_trim_to_response_ends_on_the_reply_eos(tokenizer, world):
    pair = load_records(world_tasks(world), [DataSource(world="arithmetic", n=1)], "preference", seed=0).records[0]
    chosen, rejected = encode_ranking_like(pair, tokenizer, 160, "error")
    for enc in (chosen, rejected):
        assert enc.input_ids[-1] == tokenizer.eos_token_id  # <|im_end|>, not the template's newline after it
        assert enc.labels[-1] == tokenizer.eos_token_id
    raw = EncodedCompletion([5, 6, 7, 8], [-100, 6, 7, -100], 1)
    assert trim_to_response(raw).input_ids == [5, 6, 7]  # last labelled token is 7 (index 2)


def test_last_positions_handles_left_and_right_padding():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 0]])
    assert last_positions(mask).tolist() == [2, 3, 2]
    with pytest.raises(ValueError, match=r"rows \[0\] have no attended token"):
        last_positions(torch.tensor([[0, 0], [1, 0]]))


def test_last_token_scores_match_hf_pooling_on_right_padded_batches(tmp_path):
    # HF pools at the rightmost token that is not the pad id; with right padding and pad 0 that is our last position.
    model = build_tiny("tiny-1m", vocab_size=64, seed=0, pad_token_id=0, eos_token_id=1)
    model.save_pretrained(tmp_path)
    torch.manual_seed(0)
    rm = load_scalar_model(tmp_path)
    with torch.no_grad():
        rm.score.weight.normal_()
    ids = torch.tensor([[5, 6, 7, 1, 0, 0], [9, 8, 7, 6, 5, 1]])
    mask = (ids != 0).long()
    ours = last_token_scores(rm, ids, mask)
    hf = rm(input_ids=ids, attention_mask=mask).logits.squeeze(-1)  # the HF forward and its pooling
    torch.testing.assert_close(ours, hf, rtol=1e-5, atol=1e-6)


def test_new_reward_head_starts_at_zero_and_normalization_round_trips(tmp_path):
    build_tiny("tiny-1m", vocab_size=64, seed=0, pad_token_id=0, eos_token_id=1).save_pretrained(tmp_path)
    rm = load_scalar_model(tmp_path, zero_head=True)
    scores = last_token_scores(rm, torch.tensor([[3, 4, 5]]), torch.ones(1, 3, dtype=torch.long))
    assert scores.tolist() == [0.0]
    norm = RewardNormalization(mean=2.0, std=4.0, n=8, policy="checkpoints/sft/final")
    norm.save(tmp_path)
    assert RewardNormalization.load(tmp_path) == norm
    assert norm.apply(torch.tensor([6.0, 2.0])).tolist() == [1.0, 0.0]  # (6−2)/4 = 1, (2−2)/4 = 0
    with pytest.raises(ValueError, match="no reward_norm.json"):
        RewardNormalization.load(tmp_path / "nowhere")


def test_head_to_head_counts_wins_over_non_tied_comparisons():
    h = head_to_head([1.0, 0.0, 0.5, 1.0], [0.5, 0.0, 1.0, 0.0])
    # wins: 1.0>0.5, 1.0>0.0 → 2; losses: 0.5<1.0 → 1; ties: 1 → win rate 2/3
    assert (h.wins, h.losses, h.ties) == (2, 1, 1)
    assert h.win_rate == pytest.approx(2 / 3)
    assert h.policy_mean == pytest.approx(0.625) and h.reference_mean == pytest.approx(0.375)
