"""Readers: every validation error names file, line and field; skip policy; meta; HF datasets."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest

from posttrain.data import (
    DataError,
    Message,
    PreferencePair,
    Problem,
    Ranking,
    SFTExample,
    UnpairedExample,
    from_hf_dataset,
    parse_record,
    read_jsonl,
)
from posttrain.data import readers

GOOD = {
    "sft": {"messages": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]},
    "preference": {"prompt": "2+3?", "chosen": "5", "rejected": "6"},
    "unpaired": {"prompt": "2+3?", "completion": "5", "label": True},
    "ranking": {"prompt": "2+3?", "responses": ["5", "five", "6"]},
    "problem": {"prompt": "2+3?", "answer": "5"},
}


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def error_for(tmp_path: Path, kind: str, bad_line: str) -> str:
    """The message of reading a file whose line 1 is good, line 2 blank and line 3 `bad_line`."""
    path = write(tmp_path / "d.jsonl", [json.dumps(GOOD[kind]), "", bad_line])
    with pytest.raises(DataError) as e:
        read_jsonl(path, kind)
    msg = str(e.value)
    assert "\n" not in msg  # one line
    return msg.replace(str(path), "F")


# --- one good file per kind -----------------------------------------------------------------------

def test_reads_every_kind_with_meta(tmp_path):
    rows = {
        "sft": [{"prompt": "2+3?", "completion": "5", "level": "1 digit"}, GOOD["sft"]],
        "preference": [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3?"}],
                        "chosen": "5", "rejected": "6", "gold_margin": 1.0}],
        "unpaired": [{"prompt": "2+3?", "completion": "6", "label": False}],
        "ranking": [{"prompt": "2+3?", "responses": ["5", "6"]}],
        "problem": [{"prompt": "2+3?", "answer": 5, "level": 1, "id": "p0"},
                    {"prompt": "write f", "tests": ["assert f() == 1"], "answer": None}],
    }
    got = {k: read_jsonl(write(tmp_path / f"{k}.jsonl", [json.dumps(r) for r in v]), k) for k, v in rows.items()}
    u, a = Message("user", "2+3?"), Message("assistant", "5")
    # prompt/completion becomes [user, assistant]; the unknown column `level` lands in meta
    assert got["sft"].records == [SFTExample([u, a], meta={"level": "1 digit"}), SFTExample([u, a])]
    assert got["sft"].records[0].origin == f"{tmp_path / 'sft.jsonl'}:1"
    assert got["preference"].records == [
        PreferencePair([Message("system", "be brief"), u], "5", "6", meta={"gold_margin": 1.0})]
    assert got["unpaired"].records == [UnpairedExample("2+3?", "6", False)]
    assert got["ranking"].records == [Ranking("2+3?", ["5", "6"])]
    # an integer answer and level are kept as their decimal text; `id` goes to meta; null answer = absent
    assert got["problem"].records == [Problem("2+3?", "5", None, "1", meta={"id": "p0"}),
                                      Problem("write f", None, ["assert f() == 1"], None)]
    assert got["sft"].report.rows == 2 and got["sft"].report.records == 2 and got["sft"].report.n_skipped == 0


# --- file-level errors ----------------------------------------------------------------------------

def test_missing_path(tmp_path):
    with pytest.raises(DataError) as e:
        read_jsonl(tmp_path / "nope.jsonl", "sft")
    assert str(e.value) == f"{tmp_path / 'nope.jsonl'}: file does not exist; expected a JSONL file of sft records"


def test_directory(tmp_path):
    with pytest.raises(DataError, match="is a directory; expected a JSONL file"):
        read_jsonl(tmp_path, "sft")


@pytest.mark.parametrize("content", ["", "\n  \n\n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "e.jsonl"
    path.write_text(content)
    with pytest.raises(DataError) as e:
        read_jsonl(path, "preference")
    assert str(e.value) == f"{path}: file is empty; expected one JSON object per line"


def test_unknown_kind(tmp_path):
    with pytest.raises(ValueError, match=r"unknown record kind 'dpo'; expected one of \['sft', 'preference'"):
        read_jsonl(tmp_path / "x.jsonl", "dpo")


def test_invalid_utf8(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_bytes(json.dumps(GOOD["sft"]).encode() + b"\n" + b'{"prompt": "\xff"}\n')
    with pytest.raises(DataError) as e:
        read_jsonl(path, "sft")
    # '{"prompt": "' is 12 bytes, so the bad byte is the 13th
    assert str(e.value) == f"{path}:2: not valid UTF-8 (byte 13 of the line); expected UTF-8 text"


def test_utf8_bom_is_dropped(tmp_path):
    # what Notepad writes: EF BB BF, then the text; the records equal those of the same file without it
    rows = [json.dumps(GOOD["problem"]), json.dumps({"prompt": "3+4?", "answer": "7"})]
    plain = write(tmp_path / "plain.jsonl", rows)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert read_jsonl(bom, "problem").records == read_jsonl(plain, "problem").records
    assert read_jsonl(bom, "problem").report.records == 2


def test_a_bom_after_line_1_is_still_an_error(tmp_path):
    # only the start of the file may carry a mark; one mid-file is a stray character before the JSON
    path = tmp_path / "mid.jsonl"
    path.write_bytes(json.dumps(GOOD["sft"]).encode() + b"\n\xef\xbb\xbf" + json.dumps(GOOD["sft"]).encode() + b"\n")
    with pytest.raises(DataError, match=r"mid.jsonl:2: malformed JSON"):
        read_jsonl(path, "sft")


def test_utf16_file_is_named(tmp_path):
    path = tmp_path / "u16.jsonl"
    path.write_bytes(json.dumps(GOOD["sft"]).encode("utf-16"))  # Python writes the FF FE mark first
    with pytest.raises(DataError) as e:
        read_jsonl(path, "sft")
    assert str(e.value) == (f"{path}: file is UTF-16 (little-endian) (it starts with a byte-order mark); "
                            "expected UTF-8 text, e.g. re-save it as UTF-8")


def _refused_within(path: Path, seconds: float = 5.0) -> str:
    """Read `path` in a daemon thread: a reader that blocks in open() fails the test instead of hanging it."""
    out: dict[str, BaseException] = {}

    def read() -> None:
        try:
            read_jsonl(path, "sft")
        except BaseException as e:  # noqa: BLE001 — handed to the test thread
            out["error"] = e

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"read_jsonl({path}) still blocked after {seconds} s"
    assert isinstance(out.get("error"), DataError), out
    msg = str(out["error"])
    assert "\n" not in msg
    return msg


def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    assert _refused_within(fifo) == (f"{fifo}: is a named pipe (FIFO), not a regular file; "
                                     "expected a JSONL file of sft records")
    link = tmp_path / "link.jsonl"  # a symlink is followed: what it points to is judged
    link.symlink_to(fifo)
    assert _refused_within(link).startswith(f"{link}: is a named pipe (FIFO), not a regular file")


def test_socket_and_device_are_refused(tmp_path):
    sock_path = tmp_path / "s.jsonl"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock_path))
        assert _refused_within(sock_path) == f"{sock_path}: is a socket, not a regular file; expected a JSONL file of sft records"
    assert _refused_within(Path("/dev/null")) == ("/dev/null: is a character device, not a regular file; "
                                                  "expected a JSONL file of sft records")


def test_fifo_swapped_in_after_the_stat_is_caught_on_the_descriptor(tmp_path, monkeypatch):
    # the race: the path is regular when stat'ed, a FIFO when opened. The non-blocking open returns at
    # once and the descriptor's own fstat refuses it.
    regular = write(tmp_path / "r.jsonl", [json.dumps(GOOD["sft"])])
    fifo = tmp_path / "swapped.jsonl"
    os.mkfifo(fifo)
    real_stat = os.stat
    monkeypatch.setattr(readers.os, "stat", lambda p, *a, **k: real_stat(regular) if Path(p) == fifo else real_stat(p, *a, **k))
    assert _refused_within(fifo).startswith(f"{fifo}: is a named pipe (FIFO), not a regular file")


# --- row-level errors: (kind, line 3, expected message with F = the file) ------------------------

ROW_ERRORS = [
    ("sft", '{"messages": [', "F:3: malformed JSON (Expecting value at column 15); expected one JSON object per line"),
    ("sft", "[1, 2]", "F:3: expected a JSON object, got array"),
    ("sft", '{"text": "hi"}',
     "F:3: missing field 'messages'; an sft record needs 'messages' (a list of {role, content}) or 'prompt' + 'completion'"),
    ("sft", '{"prompt": "hi"}', ("F:3: missing field 'completion'; an sft record needs 'messages' (a list of {role, "
                                "content}) or 'prompt' + 'completion'")),
    ("sft", '{"messages": "hi"}',
     'F:3: field \'messages\': expected a non-empty array of {role, content} objects, got string "hi"'),
    ("sft", '{"messages": []}', "F:3: field 'messages': expected a non-empty array of {role, content} objects, got array []"),
    ("sft", '{"messages": [{"role": "human", "content": "hi"}]}',
     "F:3: field 'messages[0].role': unknown role \"human\"; expected one of ['system', 'user', 'assistant', 'tool']"),
    ("sft", '{"messages": [{"role": "user"}]}',
     "F:3: missing field 'messages[0].content'; a message needs 'role' and 'content'"),
    ("sft", '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]}',
     "F:3: field 'messages[1].content': expected a non-empty string, got \"  \""),
    ("sft", '{"messages": [{"role": "user", "content": 7}]}',
     "F:3: field 'messages[0].content': expected a non-empty string, got number 7"),
    ("sft", '{"messages": [{"role": "user", "content": "hi"}]}',
     ("F:3: field 'messages': expected at least one assistant turn (the loss falls on assistant tokens only), "
     "found roles [user]")),
    ("sft", '{"messages": [{"role": "user", "content": "a"}], "prompt": "b", "completion": "c"}',
     "F:3: has both 'messages' and 'prompt'/'completion'; expected one form"),
    ("preference", '{"prompt": "p", "chosen": "a"}',
     "F:3: missing field 'rejected'; a preference record needs 'prompt', 'chosen', 'rejected'"),
    ("preference", '{"prompt": "p", "chosen": "", "rejected": "b"}',
     "F:3: field 'chosen': expected a non-empty string, got \"\""),
    ("preference", '{"prompt": "p", "chosen": ["a"], "rejected": "b"}',
     "F:3: field 'chosen': expected a non-empty string, got array [\"a\"]"),
    ("preference", '{"prompt": null, "chosen": "a", "rejected": "b"}',
     "F:3: field 'prompt': expected a string or an array of {role, content} objects, got null"),
    ("preference", ('{"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], '
                   '"chosen": "a", "rejected": "b"}'),
     ("F:3: field 'prompt': the last message is from the assistant; expected the prompt to end with a user "
     "(or system/tool) turn")),
    ("unpaired", '{"prompt": "p", "completion": "a", "label": 1}',
     "F:3: field 'label': expected true or false, got number 1"),
    ("ranking", '{"prompt": "p", "responses": ["only"]}',
     "F:3: field 'responses': expected at least 2 responses (best first), got 1"),
    ("ranking", '{"prompt": "p", "responses": ["a", ""]}',
     "F:3: field 'responses[1]': expected a non-empty string, got \"\""),
    ("ranking", '{"prompt": "p", "responses": "a"}',
     "F:3: field 'responses': expected an array of at least 2 strings, best first, got string \"a\""),
    ("problem", '{"prompt": "p"}',
     "F:3: missing field 'answer'; a problem record needs 'prompt' and 'answer' and/or 'tests' (optional 'level')"),
    ("problem", '{"prompt": "p", "answer": 0.5}',
     ("F:3: field 'answer': expected a string or an integer (write decimals as strings to keep their exact form), "
     "got number 0.5")),
    ("problem", '{"prompt": "p", "tests": []}', "F:3: field 'tests': expected a non-empty array of test cases, got array []"),
]


@pytest.mark.parametrize("kind,line,expected", ROW_ERRORS, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(ROW_ERRORS)])
def test_row_errors_name_file_line_field(tmp_path, kind, line, expected):
    assert error_for(tmp_path, kind, line) == expected


def test_error_attributes(tmp_path):
    path = write(tmp_path / "d.jsonl", ['{"prompt": "p", "chosen": "a"}'])
    with pytest.raises(DataError) as e:
        read_jsonl(path, "preference")
    assert (e.value.where, e.value.field) == (f"{path}:1", "rejected")
    assert isinstance(e.value, ValueError)


def test_long_values_are_shortened_in_messages(tmp_path):
    msg = error_for(tmp_path, "unpaired", json.dumps({"prompt": "p", "completion": "a", "label": "x" * 500}))
    # json.dumps of the value is cut to 40 characters: '"' + 38 x's + '…'
    assert msg == "F:3: field 'label': expected true or false, got string \"" + "x" * 38 + "…"


# --- skip policy ----------------------------------------------------------------------------------

def test_identical_pairs_and_duplicate_rankings_are_skipped_and_counted(tmp_path):
    pref = write(tmp_path / "p.jsonl", [
        json.dumps({"prompt": "p", "chosen": "5", "rejected": "6"}),
        json.dumps({"prompt": "p", "chosen": "5", "rejected": "5 "}),  # same after stripping
        json.dumps({"prompt": "q", "chosen": "7", "rejected": "8"}),
        json.dumps({"prompt": "q", "chosen": "x", "rejected": "x"}),
    ])
    records, report = read_jsonl(pref, "preference")
    assert [r.chosen for r in records] == ["5", "7"]
    assert report.rows == 4 and report.records == 2 and report.n_skipped == 2
    assert report.skipped == {"identical chosen and rejected": [f"{pref}:2", f"{pref}:4"]}
    assert report.summary() == f"{pref}: 2 preference records from 4 rows; skipped 2 with identical chosen and rejected (lines 2, 4)"

    rank = write(tmp_path / "r.jsonl", [json.dumps({"prompt": "p", "responses": ["a", "b", "a"]}),
                                        json.dumps({"prompt": "p", "responses": ["a", "b"]})])
    records, report = read_jsonl(rank, "ranking")
    assert len(records) == 1 and report.skipped == {"duplicate responses in a ranking": [f"{rank}:1"]}


def test_all_rows_skipped_is_an_error(tmp_path):
    path = write(tmp_path / "p.jsonl", [json.dumps({"prompt": "p", "chosen": "5", "rejected": "5"})])
    with pytest.raises(DataError) as e:
        read_jsonl(path, "preference")
    assert str(e.value) == (f"{path}: no usable preference records: all 1 rows were skipped "
                            "(1 with identical chosen and rejected (lines 1))")


def test_parse_record_raises_on_a_row_the_reader_would_skip():
    with pytest.raises(DataError, match="row1: row would be skipped: identical chosen and rejected"):
        parse_record({"prompt": "p", "chosen": "a", "rejected": "a"}, "preference", "row1")


def test_ignored_message_keys_are_reported(tmp_path):
    row = {"messages": [{"role": "user", "content": "q", "name": "bob"}, {"role": "assistant", "content": "a"}]}
    _, report = read_jsonl(write(tmp_path / "s.jsonl", [json.dumps(row)]), "sft")
    assert report.ignored_message_keys == {"name"}
    assert report.summary().endswith("; ignored message keys ['name']")


# --- Hugging Face datasets ------------------------------------------------------------------------

def test_hf_dataset_gives_the_same_records_as_jsonl(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": "2+3?", "answer": "5", "level": "1", "tests": None},
            {"prompt": "f?", "answer": None, "level": None, "tests": ["assert f() == 1"]}]
    ds = datasets.Dataset.from_list(rows)
    from_hf, report = from_hf_dataset(ds, "problem", name="arith")
    from_file, _ = read_jsonl(write(tmp_path / "p.jsonl", [json.dumps(r) for r in rows]), "problem")
    assert from_hf == from_file == [Problem("2+3?", "5", None, "1"), Problem("f?", None, ["assert f() == 1"], None)]
    assert from_hf[1].origin == "arith[1]" and report.source == "arith" and report.records == 2


def test_hf_dataset_chat_rows_and_errors():
    datasets = pytest.importorskip("datasets")
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    bad = {"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]}
    records, _ = from_hf_dataset(datasets.Dataset.from_list([good]), "sft", name="chats")
    assert records == [SFTExample([Message("user", "q"), Message("assistant", "a")])]
    with pytest.raises(DataError) as e:
        from_hf_dataset(datasets.Dataset.from_list([good, bad]), "sft", name="chats")
    assert str(e.value) == ("chats[1]: field 'messages[1].role': unknown role \"robot\"; "
                            "expected one of ['system', 'user', 'assistant', 'tool']")
    with pytest.raises(DataError) as e:
        from_hf_dataset(datasets.DatasetDict({"train": datasets.Dataset.from_list([good])}), "sft")
    assert str(e.value) == "dataset: is a dict of splits ['train']; expected one split, e.g. ds['train']"


def test_hf_dataset_empty_and_default_name():
    datasets = pytest.importorskip("datasets")
    with pytest.raises(DataError, match=r"^dataset: dataset is empty; expected at least one row$"):
        from_hf_dataset(datasets.Dataset.from_list([]), "sft")
    # no name given: the dataset's own name (none here) falls back to 'dataset'
    _, report = from_hf_dataset(datasets.Dataset.from_list([GOOD["preference"]]), "preference")
    assert report.source == "dataset"


def test_recipe_fifo_is_refused_without_blocking(tmp_path):
    # the recipe is the other user file the CLI opens; `is_file()` is False for a FIFO, so it never blocks
    from posttrain.runtime.config import RecipeError
    from posttrain.runtime.recipe_file import load_recipe

    fifo = tmp_path / "recipe.yaml"
    os.mkfifo(fifo)
    with pytest.raises(RecipeError) as e:
        load_recipe(fifo)
    assert str(e.value) == f"{fifo}: is not a regular file; expected a recipe YAML file"
