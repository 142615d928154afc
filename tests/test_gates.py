"""Quality gates (posttrain.data.gates): known duplicates give known counts, planted eval prompts are
removed (exact and lightly reworded) while unrelated prompts stay, length and format filters, reports."""

from __future__ import annotations

import json

import pytest

from posttrain.data import Message, PreferencePair, Problem, SFTExample, read_jsonl
from posttrain.data.gates import (
    coverage,
    decontaminate,
    eval_index,
    exact_dedup,
    format_filter,
    jaccard,
    length_filter,
    near_dedup,
    near_dedup_exact,
    normalize,
    run_gates,
    shingles,
    words,
)
from posttrain.data.gates.report import EXAMPLES

pytest.importorskip("datasketch")

A = ("Explain why the sky looks blue on a clear afternoon, for a curious child.",
     "Sunlight is made of many colours. Air scatters the short blue waves far more than the red ones, "
     "so blue light reaches your eyes from every part of the sky.")
B = ("Give me three tips for keeping a sourdough starter healthy during a hot summer.",
     "Feed it twice a day with equal weights of flour and water, keep it in the coolest corner of the "
     "kitchen, and use a little less starter in each feed so it does not over ferment.")
B_NEAR = (B[0], B[1].replace("coolest", "darkest"))  # one word changed in a 47-word record
C = ("Summarize the plot of a heist story where the crew is betrayed by their own planner.",
     "A crew of thieves plans a bank job for months, but on the night of the robbery their planner "
     "tips off the police and escapes with the loot, leaving them to be arrested.")
C_NEAR = (C[0], C[1] + " In the end one thief escapes.")  # a sentence appended
D = ("List the steps to replace a flat bicycle tyre at the side of a road.",
     "Remove the wheel, lever the tyre off the rim, pull out the tube, find the puncture, fit a new tube, "
     "seat the tyre, pump it up and refit the wheel.")
E = ("Write a short thank-you note to a neighbour who watered my plants while I was away.",
     "Dear Sam, thank you so much for looking after my plants while I was travelling. They are thriving, "
     "and I owe you a dinner soon. Best wishes, Alex.")


def _write(path, rows):
    path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in rows))
    return read_jsonl(path, "sft")[0]


@pytest.fixture
def dup_file(tmp_path):
    # line: 1 A, 2 B, 3 A (exact), 4 A re-cased and re-spaced (exact after normalization), 5 C,
    #       6 B with one word changed (near), 7 D, 8 C with a sentence appended (near), 9 E, 10 B (exact)
    shouty = ("  " + A[0].upper().replace(" ", "   "), A[1].upper() + "\n")
    return _write(tmp_path / "sft.jsonl", [A, B, A, shouty, C, B_NEAR, D, C_NEAR, E, B])


def test_exact_dedup_counts_known_duplicates(dup_file):
    kept, report = exact_dedup(dup_file)
    # lines 3 and 4 repeat line 1, line 10 repeats line 2: 3 removed, 10 − 3 = 7 kept
    assert (report.seen, report.kept, report.removed) == (10, 7, {"exact duplicate": 3})
    assert [r.origin.rsplit(":", 1)[1] for r in kept] == ["1", "2", "5", "6", "7", "8", "9"]
    assert [e.where.rsplit(":", 1)[1] for e in report.examples] == ["3", "4", "10"]  # 3 ≤ EXAMPLES shown
    assert report.examples[1].detail.endswith("sft.jsonl:1")
    # by prompt only: lines 3, 4 (A), 6, 10 (B) and 8 (C) repeat an earlier prompt → 5 removed, 5 kept
    kept, report = exact_dedup(dup_file, part="prompt")
    assert [r.origin.rsplit(":", 1)[1] for r in kept] == ["1", "2", "5", "7", "9"] and report.n_removed == 5


def test_near_dedup_counts_known_near_duplicates(dup_file):
    kept, exact = exact_dedup(dup_file)
    # B_NEAR: "coolest" → "darkest" in a w-word text (prompt + completion) replaces 3 of its w − 2 word
    # 3-grams, so J = (w − 5) / (w + 1) ≥ 0.7. C_NEAR adds 7 words (". in the end one thief escapes .")
    # to C: 7 new 3-grams, J = |C| / (|C| + 7) ≥ 0.7 since C has more than 16 shingles.
    w = len(words(B[0] + " " + B[1]))
    assert jaccard(shingles(B[0] + "\n" + B[1]), shingles(B_NEAR[0] + "\n" + B_NEAR[1])) == pytest.approx((w - 5) / (w + 1))
    survivors, report = near_dedup(kept)
    assert (report.seen, report.kept, report.removed) == (7, 5, {"near duplicate": 2})  # 7 − 2 = 5: A, B, C, D, E
    assert [r.origin.rsplit(":", 1)[1] for r in survivors] == ["1", "2", "5", "7", "9"]
    assert report.examples[0].detail.startswith("Jaccard 0.") and report.examples[0].detail.endswith("sft.jsonl:2")
    # the distinct records stay far below the threshold: no accidental removal to hide behind the counts
    texts = [p + "\n" + c for p, c in (A, B, C, D, E)]
    assert max(jaccard(shingles(x), shingles(y)) for i, x in enumerate(texts) for y in texts[i + 1:]) < 0.2
    # the whole chain: 10 in, 3 exact + 2 near out, 5 left
    final, reports = run_gates(dup_file, [exact_dedup, near_dedup])
    assert len(final) == 5 and [r.n_removed for r in reports] == [3, 2]
    assert reports[1].metrics() == {"gate/near_dedup/seen": 7, "gate/near_dedup/kept": 5,
                                    "gate/near_dedup/removed/near duplicate": 2}


def test_lsh_near_dedup_agrees_with_the_exact_reference(world):
    # 300 arithmetic SFT chats (short, templated: many pairs near the threshold) plus 30 planted copies
    # with one word changed: LSH + exact confirmation must remove exactly what the O(N²) reference removes
    rows = world.sft_split(300, seed_offset=7)
    records = [SFTExample([Message(m["role"], m["content"]) for m in r], origin=f"w[{i}]") for i, r in enumerate(rows)]
    planted = [SFTExample([Message("user", r.messages[0].content.replace("What", "Whatt")), r.messages[1]],
                          origin=f"p[{i}]") for i, r in enumerate(records[:30])]
    data = records + planted
    lsh_kept, lsh = near_dedup(data)
    ref_kept, ref = near_dedup_exact(data)
    assert [r.origin for r in lsh_kept] == [r.origin for r in ref_kept]
    assert lsh.removed == ref.removed and lsh.removed["near duplicate"] >= 1


EVALS = [
    ("gsm[0]", "Tom has 12 marbles and gives 5 of them to his sister. How many marbles does Tom have left?"),  # 21 words
    ("gsm[1]", "A train travels 60 miles in 1.5 hours. What is its average speed in miles per hour?"),        # 21 words
    ("gsm[2]", "Sara buys 3 boxes of pencils with 8 pencils in each box. How many pencils does she buy in total?"),  # 22
    ("add[0]", "What is 12 + 7?"),                                                                             # 6 words
]


def _sft(prompt: str, origin: str) -> SFTExample:
    return SFTExample([Message("user", prompt), Message("assistant", "Let me work it out.")], origin=origin)


def test_decontamination_removes_planted_eval_prompts_and_keeps_unrelated_ones():
    index = eval_index(EVALS)  # n = 5, threshold 0.5
    planted = {
        "exact": EVALS[0][1],                                                   # coverage 21/21 = 1
        "spacing+casing": "  a TRAIN travels 60 miles   in 1.5 hours.\nWhat is its AVERAGE speed in miles per hour?",  # 1
        # word 6 of 22 changed (pencils → crayons): 5 words before it, 16 after, both ≥ n: 21/22 = 0.95
        "word changed": EVALS[2][1].replace("of pencils", "of crayons"),
        # word 5 of 21 changed (and → or): the 4 words before it are in no shared 5-gram, the 16 after
        # are: 16/21 = 0.76 — the worst place for a change to land in a 21-word prompt is still caught
        "word changed early": EVALS[0][1].replace("and gives", "or gives"),
        "embedded": "Please help me with this one: " + EVALS[0][1] + " Thanks a lot!",  # 21/21
        "short exact": "what is 12 + 7 ?",                                      # 6 words ≥ n: both 5-grams, 6/6
    }
    unrelated = {
        "other sum": "What is 12 + 8?",       # a different problem: no 5-gram of "what is 12 + 7 ?" — 0
        "same names": "Tom has 3 dogs and 2 cats. How many pets does Tom have?",  # shares no 5-gram: 0
        # shares "how many marbles does tom have" (6 words in two 5-grams) with gsm[0]: 6/21 = 0.29 < 0.5
        "shared phrase": "How many marbles does Tom have in his pocket today?",
        "haiku": "Write a haiku about autumn leaves falling on a quiet pond.",
    }
    records = [_sft(p, k) for k, p in {**planted, **unrelated}.items()]
    assert coverage(index, unrelated["shared phrase"]) == {0: pytest.approx(6 / 21)}
    assert coverage(index, planted["word changed early"])[0] == pytest.approx(16 / 21)
    kept, report = decontaminate(records, index)
    assert [r.origin for r in kept] == list(unrelated)  # 10 records − 6 planted = 4 kept
    assert (report.seen, report.kept, report.removed) == (10, 4, {"eval overlap": 6})
    assert "gsm[0]" in report.examples[0].detail and "100%" in report.examples[0].detail
    assert len(report.examples) == EXAMPLES  # 6 removed for one reason, only the first 3 shown


def test_decontamination_searches_responses_unless_asked_not_to():
    index = eval_index(EVALS)
    pair = PreferencePair("Ask me a word problem.", chosen=EVALS[1][1], rejected="No.")
    assert decontaminate([pair], index).report.removed == {"eval overlap": 1}
    assert decontaminate([pair], index, part="prompt").report.removed == {}


def test_arithmetic_world_splits_are_clean_and_planted_eval_problems_are_caught(world):
    from posttrain.tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask(world=world)
    evals = [(f"arithmetic[{lv}][{i}]", p) for lv in task.levels for i, p in enumerate(task.eval_problems(lv)[:50])]
    index = eval_index(evals)
    train = task.records("problem", 300)
    planted = [Problem(p.prompt, p.answer, level=p.level, origin=f"planted[{i}]") for i, (_, p) in enumerate(evals[::20])]
    # the world holds eval problems out of every training split (by fact, in any phrasing): 0 of the
    # 300 training problems overlap; the 200 / 20 = 10 planted eval problems all do
    kept, report = decontaminate(train + planted, index)
    assert report.removed == {"eval overlap": 10} and len(kept) == 300


def test_shingles():
    assert shingles("abcdef", n=5, shingle="char") == {"abcde", "bcdef"}  # 6 − 5 + 1 = 2 grams
    assert shingles("What is 2+2?") == {"what is 2", "is 2 +", "2 + 2", "+ 2 ?"}  # 6 words → 4 word 3-grams
    assert shingles("Hi there") == {"hi there"}  # fewer words than n: one shingle, the whole text


def test_normalize_and_words():
    assert normalize("  Ｈello\t\nWORLD  ") == "hello world"  # NFKC turns the fullwidth Ｈ into H
    assert words("12+7=19, done.") == ["12", "+", "7", "=", "19", ",", "done", "."]


def test_length_filter_bounds_every_response():
    recs = [PreferencePair("q", chosen="a" * 10, rejected="b" * 3, origin="ok"),
            PreferencePair("q", chosen="a" * 10, rejected="b", origin="short"),      # rejected is 1 char < 2
            PreferencePair("q", chosen="a" * 30, rejected="b" * 3, origin="long"),   # chosen is 30 chars > 20
            Problem("q", answer="1", origin="problem")]                              # no response: passes
    kept, report = length_filter(recs, min_len=2, max_len=20)
    assert [r.origin for r in kept] == ["ok", "problem"]
    assert report.removed == {"response too short": 1, "response too long": 1}
    assert report.examples[0].detail == "1 chars < 2"
    kept, report = length_filter(recs, max_len=1, unit="words", part="prompt")  # every prompt is 1 word
    assert len(kept) == 4


def test_format_filter_reasons():
    def ex(reply, origin):
        return SFTExample([Message("user", "2+2?"), Message("assistant", reply)], origin=origin)

    recs = [ex("<think>2+2=4</think> 4", "clean"), ex("4<|im_end|>", "leak"), ex("4 \ufffd", "bytes"),
            ex("<think>2+2=4 4", "unclosed"), ex("four", "no number")]
    kept, report = format_filter(recs)
    assert [r.origin for r in kept] == ["clean", "no number"]
    assert report.removed == {"leaked control token": 1, "undecodable bytes": 1, "unbalanced <think>": 1}
    kept, report = format_filter(recs, require=r"\d+\s*$")
    assert [r.origin for r in kept] == ["clean"] and report.removed["required format missing"] == 1
    assert report.summary().startswith("format: kept 1 of 5; removed 1 leaked control token")
