"""Chat templates and response-only masks: hand-checked spans, marker path == diff path, truncation."""

from __future__ import annotations

import json

import pytest

from posttrain.data import (
    IGNORE_INDEX,
    DataError,
    Message,
    PreferencePair,
    SFTExample,
    TemplateError,
    UnpairedExample,
    encode_completion,
    encode_preference,
    encode_preference_dataset,
    encode_prompt,
    encode_sft,
    encode_sft_dataset,
    encode_unpaired,
    has_generation_markers,
    read_jsonl,
    response_mask,
)
from posttrain.models import CHAT_TEMPLATE, train_tokenizer

CORPUS = [
    "what is 12 + 7? the answer is 19. <think>2 + 7 = 9</think> so 19.",
    "Question: how many legs does a cat have? Answer: four legs.",
    "héllo wörld, naïve café — unicode text",
] * 20


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS)


@pytest.fixture(scope="module")
def tok_no_markers():
    """Our tokenizer with the {% generation %} markers stripped: only the diff path can mask it."""
    t = train_tokenizer(CORPUS)
    t.chat_template = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    return t


def u(text: str) -> Message:
    return Message("user", text)


def a(text: str) -> Message:
    return Message("assistant", text)


def labelled(tok, enc) -> str:
    return tok.decode([t for t in enc.labels if t != IGNORE_INDEX])


def test_mask_hand_checked(tok):
    enc = encode_sft(SFTExample([u("2+3?"), a("5")]), tok, 64)
    # rendered: "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
    # the labelled tokens are exactly "5" and "<|im_end|>", the 3rd- and 2nd-last; the final "\n" is not
    tokens = tok.convert_ids_to_tokens(enc.input_ids)
    assert tokens[-3:] == ["5", "<|im_end|>", "Ċ"]
    assert enc.labels[-3:] == enc.input_ids[-3:-1] + [IGNORE_INDEX]
    assert all(x == IGNORE_INDEX for x in enc.labels[:-3])
    assert tok.decode(enc.input_ids[:-3]) == "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert len(enc.labels) == len(enc.input_ids) and not enc.truncated


def test_multi_turn_labels_every_assistant_turn_and_nothing_else(tok):
    ex = SFTExample([Message("system", "be brief"), u("12 + 7?"), a("<think>2 + 7 = 9</think> 19"), u("and 3?"),
                     a("four legs")])
    enc = encode_sft(ex, tok, 256)
    # labelled text = each assistant content + its <|im_end|>, concatenated; no role headers, no user text
    assert labelled(tok, enc) == "<think>2 + 7 = 9</think> 19<|im_end|>four legs<|im_end|>"
    # and the masked-in tokens form exactly two contiguous runs
    runs = sum(1 for i, x in enumerate(enc.labels) if x != IGNORE_INDEX and (i == 0 or enc.labels[i - 1] == IGNORE_INDEX))
    assert runs == 2


CHATS = [
    [u("2+3?"), a("5")],
    [Message("system", "you are terse"), u("what is 12 + 7?"), a("<think>2 + 7 = 9, carry 1</think> 19")],
    [u("héllo"), a(" leading space and trailing newline\n"), u("naïve café?"), a("wörld — ok")],
    [u("a"), a("b"), u("c"), a("d"), Message("tool", "result 4"), a("so 4")],
    [a("assistant speaks first"), u("then the user")],
]


@pytest.mark.parametrize("chat", CHATS, ids=range(len(CHATS)))
def test_marker_path_equals_diff_path(tok, tok_no_markers, chat):
    ids_m, mask_m = response_mask(chat, tok, mask="markers")
    ids_d, mask_d = response_mask(chat, tok, mask="diff")
    ids_s, mask_s = response_mask(chat, tok_no_markers)  # auto picks diff when the template has no markers
    assert ids_m == ids_d == ids_s
    assert mask_m == mask_d == mask_s
    assert sum(mask_m) > 0


def test_auto_picks_markers_and_markers_require_them(tok, tok_no_markers):
    assert has_generation_markers(tok) and not has_generation_markers(tok_no_markers)
    with pytest.raises(TemplateError, match=r"mask='markers' needs a chat template with \{% generation %\} markers"):
        response_mask([u("q"), a("r")], tok_no_markers, mask="markers")


def test_diff_path_on_a_plain_template(tok):
    """A non-ChatML template without markers or an EOS in the turn: the span is trimmed of trailing space."""
    t = train_tokenizer(CORPUS)
    t.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}Question: {{ m['content'] }}\n"
                       "{% else %}Answer:{{ m['content'] }}\n\n{% endif %}{% endfor %}"
                       "{% if add_generation_prompt %}Answer:{% endif %}")
    t.eos_token = None  # no EOS string to end the span on
    enc = encode_sft(SFTExample([u("how many legs?"), a(" four legs")]), t, 64)
    # rendered "Question: how many legs?\nAnswer: four legs\n\n"; the span is " four legs" (the "\n\n" trimmed)
    assert labelled(t, enc) == " four legs"
    assert t.decode([x for x, y in zip(enc.input_ids, enc.labels) if y == IGNORE_INDEX]) == \
        "Question: how many legs?\nAnswer:\n\n"


def test_template_that_is_not_prefix_stable_is_an_error(tok):
    t = train_tokenizer(CORPUS)
    # drops earlier assistant turns' content once a later turn exists (as some reasoning templates do)
    t.chat_template = ("{% for m in messages %}{{ m['role'] }}: "
                       "{% if m['role'] == 'assistant' and not loop.last %}[hidden]{% else %}{{ m['content'] }}{% endif %}"
                       "\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(TemplateError, match="does not render turn 1 as a prefix of the full chat"):
        response_mask([u("q"), a("r"), u("q2"), a("r2")], t, mask="diff")


def test_no_template_is_an_error():
    t = train_tokenizer(CORPUS)
    t.chat_template = None
    with pytest.raises(TemplateError, match="has no chat template"):
        encode_prompt("q", t)


def test_encode_prompt_adds_the_generation_prompt(tok):
    ids = encode_prompt("2+3?", tok)
    assert tok.decode(ids) == "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
    # a message list and a record with .prompt give the same ids
    assert encode_prompt([u("2+3?")], tok) == ids
    assert encode_prompt(PreferencePair("2+3?", "5", "6"), tok) == ids


def test_encode_prompt_too_long(tok):
    n = len(encode_prompt("what is 12 + 7?", tok))
    with pytest.raises(DataError) as e:
        encode_prompt(PreferencePair("what is 12 + 7?", "19", "18", origin="p.jsonl:4"), tok, max_len=5)
    assert str(e.value) == (f"p.jsonl:4: prompt is {n} tokens, longer than max_len 5; expected ≤ 5 "
                            "(shorten it, raise max_len, or set truncation='left')")
    assert encode_prompt("what is 12 + 7?", tok, max_len=5, truncation="left") == encode_prompt("what is 12 + 7?", tok)[-5:]


# --- truncation -----------------------------------------------------------------------------------

def test_too_long_example_names_file_and_line(tok, tmp_path):
    path = tmp_path / "sft.jsonl"
    rows = [{"prompt": "2+3?", "completion": "5"}, {"prompt": "what is 12 + 7? " * 10, "completion": "19"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    records, _ = read_jsonl(path, "sft")
    n = len(encode_sft(records[1], tok, 10_000).input_ids)
    assert n > 40
    with pytest.raises(DataError) as e:
        encode_sft_dataset(records, tok, 40)
    assert str(e.value) == (f"{path}:2: example is {n} tokens, longer than max_len 40; expected ≤ 40 "
                            "(shorten it, raise max_len, or set truncation='left' or 'right')")


def test_left_and_right_truncation_and_count(tok):
    long = SFTExample([u("what is 12 + 7? " * 10), a("19")], origin="x:1")
    short = SFTExample([u("2+3?"), a("5")], origin="x:2")
    full = encode_sft(long, tok, 10_000)
    assert len(encode_sft(short, tok, 10_000).input_ids) <= 30 < len(full.input_ids)
    out, n_truncated = encode_sft_dataset([long, short], tok, 30, truncation="left")
    assert n_truncated == 1 and out[0].truncated and not out[1].truncated
    assert out[0].input_ids == full.input_ids[-30:] and out[0].labels == full.labels[-30:]
    assert labelled(tok, out[0]) == "19<|im_end|>"  # the response survives left truncation
    # right truncation of this example cuts the whole response away: an error, never an all-ignored row
    with pytest.raises(DataError, match="^x:1: after right truncation to 20 tokens no response token is left"):
        encode_sft(long, tok, 20, truncation="right")
    room = len(encode_prompt("2+3?", tok)) + 3  # the prompt and 3 response tokens
    kept = encode_sft(SFTExample([u("2+3?"), a("four legs " * 5)]), tok, room, truncation="right")
    assert kept.truncated and len(kept.input_ids) == room
    assert sum(x != IGNORE_INDEX for x in kept.labels) == 3 and kept.labels[-1] != IGNORE_INDEX


def test_bad_options():
    with pytest.raises(ValueError, match=r"truncation='middle'; expected one of \['error', 'left', 'right'\]"):
        encode_sft(SFTExample([u("q"), a("r")]), None, 10, truncation="middle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_len must be a positive integer, got 0"):
        encode_sft(SFTExample([u("q"), a("r")]), None, 0)


# --- completions and preference pairs -------------------------------------------------------------

def test_preference_shares_the_prompt_and_labels_only_the_reply(tok):
    pair = PreferencePair([u("12 + 7?"), a("19"), u("and 2+3?")], "5", "four legs")
    enc = encode_preference(pair, tok, 128)
    p = enc.prompt_len
    assert enc.chosen.input_ids[:p] == enc.rejected.input_ids[:p] == encode_prompt(pair.prompt, tok)
    # the earlier assistant turn "19" is context in a preference prompt, not a target
    assert labelled(tok, enc.chosen) == "5<|im_end|>" and labelled(tok, enc.rejected) == "four legs<|im_end|>"
    assert all(x == IGNORE_INDEX for x in enc.chosen.labels[:p] + enc.rejected.labels[:p])


def test_preference_left_truncation_drops_the_same_prompt_head(tok):
    pair = PreferencePair("what is 12 + 7? " * 6, "19", "four legs four legs", origin="p:3")
    full = encode_preference(pair, tok, 10_000)
    longest = max(len(full.chosen.input_ids), len(full.rejected.input_ids))
    with pytest.raises(DataError, match=rf"^p:3: prompt \+ longer reply is {longest} tokens, longer than max_len 30"):
        encode_preference(pair, tok, 30)
    out, n = encode_preference_dataset([pair], tok, 30, truncation="left")
    enc, drop = out[0], longest - 30
    assert n == 1 and enc.truncated and max(len(enc.chosen.input_ids), len(enc.rejected.input_ids)) == 30
    assert enc.prompt_len == full.prompt_len - drop
    assert enc.chosen.input_ids == full.chosen.input_ids[drop:]
    assert enc.rejected.labels == full.rejected.labels[drop:]
    # a reply longer than max_len leaves no prompt at all: an error naming the record
    reply = len(full.rejected.input_ids) - full.prompt_len  # the longer reply, "<|im_end|>\n" included
    with pytest.raises(DataError, match=rf"^p:3: the reply alone is {reply} tokens and the prompt {full.prompt_len}; "
                                        "left truncation to max_len 6 would remove the whole prompt"):
        encode_preference(pair, tok, 6, truncation="left")


def test_unpaired_and_completion(tok):
    ex = UnpairedExample("2+3?", "5", True, origin="k:1")
    enc = encode_unpaired(ex, tok, 64)
    assert labelled(tok, enc) == "5<|im_end|>" and enc.origin == "k:1"
    assert enc == encode_completion("2+3?", "5", tok, 64, origin="k:1")


def test_prompt_merging_with_reply_is_detected():
    """A generation prompt ending in a space merges with the reply's first word under byte-level BPE,
    so prompt tokens are not a prefix of prompt+reply tokens: refuse rather than mislabel."""
    t = train_tokenizer(CORPUS)
    t.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                       "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(TemplateError, match="the prompt's tokens change when the reply is appended"):
        encode_preference(PreferencePair("q", "legs", "cat"), t, 64)
