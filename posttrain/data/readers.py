"""Read JSONL files and Hugging Face `datasets` into typed records, validating every row.

The schemas are documented in docs/data.md. Validation policy, one rule per case:

* **Error** (one `DataError`, one line naming file:line, the field and what was expected): path that
  does not exist, is a directory or is any other non-regular file (a FIFO, socket or device: refused
  before it is opened, since opening a FIFO blocks forever); a UTF-16 file; empty file (or only blank lines); a line that is not valid UTF-8
  or not valid JSON or not a JSON object; a missing required field; a field of the wrong type; an
  unknown chat role; empty (or whitespace-only) text; an SFT chat with no assistant turn; a ranking
  with fewer than 2 responses; a problem with neither `answer` nor `tests`; a file in which every row
  was skipped.
* **Skip and count** (in `ReadReport.skipped`, by reason, with each row's location): a preference
  pair whose chosen and rejected are identical (it carries no preference; the DPO-family losses would
  spend compute on a zero gradient), and a ranking with two identical responses (its order is
  contradictory). Both occur in real preference datasets as ties.
* **Kept**: columns a schema does not name go into the record's `meta` dict. Keys of a chat message
  other than `role` and `content` (e.g. `name`) are dropped and listed in `ReadReport.ignored_message_keys`.
* A UTF-8 byte-order mark at the start of a file is dropped (editors on Windows write one).
* Blank lines are skipped and counted (`ReadReport.blank_lines`). A JSON `null` in an optional field
  means absent (HF datasets fill missing columns with None); in a required field it is a wrong type.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from posttrain.data.records import (
    KINDS,
    ROLES,
    DataError,
    Message,
    PreferencePair,
    Problem,
    Prompt,
    Ranking,
    Record,
    SFTExample,
    UnpairedExample,
)

# What each kind needs, as said in error messages.
SCHEMAS: dict[str, str] = {
    "sft": "'messages' (a list of {role, content}) or 'prompt' + 'completion'",
    "preference": "'prompt', 'chosen', 'rejected'",
    "unpaired": "'prompt', 'completion', 'label'",
    "ranking": "'prompt', 'responses' (at least 2, best first)",
    "problem": "'prompt' and 'answer' and/or 'tests' (optional 'level')",
}

_FIELDS: dict[str, frozenset[str]] = {
    "sft": frozenset({"messages", "prompt", "completion"}),
    "preference": frozenset({"prompt", "chosen", "rejected"}),
    "unpaired": frozenset({"prompt", "completion", "label"}),
    "ranking": frozenset({"prompt", "responses"}),
    "problem": frozenset({"prompt", "answer", "tests", "level"}),
}

_ARTICLE = {"sft": "an", "preference": "a", "unpaired": "an", "ranking": "a", "problem": "a"}

SKIP_IDENTICAL_PAIR = "identical chosen and rejected"
SKIP_DUPLICATE_RESPONSES = "duplicate responses in a ranking"


@dataclass
class ReadReport:
    """What a reader did besides returning records: rows seen, rows skipped (by reason), notes."""

    source: str
    kind: str
    rows: int = 0
    records: int = 0
    blank_lines: int = 0
    skipped: dict[str, list[str]] = field(default_factory=dict)  # reason -> locations of the rows
    ignored_message_keys: set[str] = field(default_factory=set)

    @property
    def n_skipped(self) -> int:
        return sum(len(v) for v in self.skipped.values())

    def skipped_text(self) -> str:
        """e.g. '2 with identical chosen and rejected (lines 3, 7)'."""
        return ", ".join(f"{len(locs)} with {reason} ({_list_locations(locs)})" for reason, locs in self.skipped.items())

    def summary(self) -> str:
        """One line for the run log."""
        line = f"{self.source}: {self.records} {self.kind} records from {self.rows} rows"
        if self.skipped:
            line += "; skipped " + self.skipped_text()
        if self.ignored_message_keys:
            line += f"; ignored message keys {sorted(self.ignored_message_keys)}"
        return line


class ReadResult(NamedTuple):
    records: list[Record]
    report: ReadReport


class _Skip(Exception):
    def __init__(self, reason: str):
        self.reason = reason


# --------------------------------------------------------------------------------------------------
# Public readers


def read_jsonl(path: str | Path, kind: str) -> ReadResult:
    """Read a JSONL file of `kind` records (see `KINDS`). Raises `DataError` on the first bad row."""
    _check_kind(kind)
    path = Path(path)
    report = ReadReport(source=str(path), kind=kind)
    records: list[Record] = []
    with open_data_file(path, f"a JSONL file of {kind} records") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            if lineno == 1:
                raw = _strip_bom(raw, str(path))
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(where, f"not valid UTF-8 (byte {e.start + 1} of the line); expected UTF-8 text",
                                expected="UTF-8") from None
            if not text.strip():
                report.blank_lines += 1
                continue
            try:
                row = json.loads(text.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                raise DataError(where, f"malformed JSON ({e.msg} at column {e.colno}); "
                                       "expected one JSON object per line", expected="a JSON object") from None
            _add(row, kind, where, records, report)
    if report.rows == 0:
        raise DataError(str(path), "file is empty; expected one JSON object per line", expected="a JSON object per line")
    _check_not_all_skipped(report)
    return ReadResult(records, report)


def from_hf_dataset(ds: Iterable[Mapping[str, Any]], kind: str, *, name: str | None = None) -> ReadResult:
    """Read a `datasets.Dataset` (or any iterable of dict rows) with the same validation as
    `read_jsonl`. Locations read `name[i]` with `i` the 0-based row index (`ds[i]`)."""
    _check_kind(kind)
    if isinstance(ds, Mapping):  # a DatasetDict (or a plain dict) holds splits, not rows
        raise DataError(name or "dataset", f"is a dict of splits {sorted(map(str, ds.keys()))}; "
                                           "expected one split, e.g. ds['train']", expected="one split")
    if name is None:
        info = getattr(ds, "info", None)
        name = getattr(info, "dataset_name", None) or "dataset"
        split = getattr(ds, "split", None)
        if split is not None:
            name = f"{name}/{split}"
    report = ReadReport(source=name, kind=kind)
    records: list[Record] = []
    for i, row in enumerate(ds):
        _add(row, kind, f"{name}[{i}]", records, report)
    if report.rows == 0:
        raise DataError(name, "dataset is empty; expected at least one row", expected="at least one row")
    _check_not_all_skipped(report)
    return ReadResult(records, report)


def parse_record(row: Any, kind: str, where: str = "") -> Record:
    """Validate one row (a dict) into a record. Raises `DataError`; rows the policy skips raise too,
    naming the reason, since there is no report to count them in."""
    _check_kind(kind)
    report = ReadReport(source=where, kind=kind)
    try:
        return _PARSERS[kind](_as_object(row, where), where, report)
    except _Skip as s:
        raise DataError(where, f"row would be skipped: {s.reason}") from None


# --------------------------------------------------------------------------------------------------
# Opening a user's file


def open_data_file(path: Path, expected: str) -> BinaryIO:
    """Open a user's data file for binary reading, refusing anything that is not a regular file.

    A FIFO given as a data file would block `open()` until a writer appears (forever, in practice);
    a character device such as /dev/zero never ends; a socket cannot be opened at all. So the path is
    stat'ed first (following symlinks) and refused in one line naming what it is. The open itself is
    non-blocking and the opened descriptor is checked again, so a path swapped for a FIFO between the
    two checks cannot hang us either."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DataError(str(path), f"file does not exist; expected {expected}", expected="an existing file") from None
    except OSError as e:
        raise DataError(str(path), f"cannot read ({e.strerror}); expected {expected}", expected="a readable file") from None
    _check_regular(st.st_mode, path, expected)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise DataError(str(path), f"cannot open ({e.strerror}); expected {expected}", expected="a readable file") from None
    try:
        _check_regular(os.fstat(fd).st_mode, path, expected)
        os.set_blocking(fd, True)  # no effect on a regular file's reads; restores the ordinary mode
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def _check_regular(mode: int, path: Path, expected: str) -> None:
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise DataError(str(path), f"is a directory; expected {expected}", expected="a regular file")
    what = _FILE_TYPES.get(stat.S_IFMT(mode), "not a regular file")
    raise DataError(str(path), f"is {what}, not a regular file; expected {expected}", expected="a regular file")


_FILE_TYPES = {
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}

_UTF8_BOM = b"\xef\xbb\xbf"
_UTF16_BOMS = {b"\xff\xfe": "UTF-16 (little-endian)", b"\xfe\xff": "UTF-16 (big-endian)"}


def _strip_bom(first_line: bytes, where: str) -> bytes:
    """Drop a UTF-8 byte-order mark (what Notepad and some Windows tools write at the start of a file);
    name a UTF-16 one, whose file is not UTF-8 at all."""
    if first_line.startswith(_UTF8_BOM):
        return first_line[len(_UTF8_BOM):]
    for bom, name in _UTF16_BOMS.items():
        if first_line.startswith(bom):
            raise DataError(where, f"file is {name} (it starts with a byte-order mark); expected UTF-8 text, "
                                   "e.g. re-save it as UTF-8", expected="UTF-8")
    return first_line


# --------------------------------------------------------------------------------------------------
# Per-kind parsers


def _parse_sft(row: dict[str, Any], where: str, report: ReadReport) -> SFTExample:
    if _present(row, "messages"):
        if _present(row, "prompt") or _present(row, "completion"):
            raise DataError(where, "has both 'messages' and 'prompt'/'completion'; expected one form",
                            field="messages", expected="one form")
        messages = _messages(row["messages"], where, "messages", report)
    elif _present(row, "prompt") or _present(row, "completion"):
        prompt = _prompt(_required(row, "prompt", where, "sft"), where, "prompt", report)
        completion = _text(_required(row, "completion", where, "sft"), where, "completion")
        messages = _as_messages(prompt) + [Message("assistant", completion)]
    else:
        raise DataError(where, f"missing field 'messages'; an sft record needs {SCHEMAS['sft']}",
                        field="messages", expected=SCHEMAS["sft"])
    if not any(m.role == "assistant" for m in messages):
        roles = ", ".join(m.role for m in messages)
        raise DataError(where, f"field 'messages': expected at least one assistant turn (the loss falls on "
                               f"assistant tokens only), found roles [{roles}]",
                        field="messages", expected="an assistant turn")
    return SFTExample(messages=messages, meta=_meta(row, "sft"), origin=where)


def _parse_preference(row: dict[str, Any], where: str, report: ReadReport) -> PreferencePair:
    prompt = _prompt(_required(row, "prompt", where, "preference"), where, "prompt", report)
    chosen = _text(_required(row, "chosen", where, "preference"), where, "chosen")
    rejected = _text(_required(row, "rejected", where, "preference"), where, "rejected")
    if chosen.strip() == rejected.strip():
        raise _Skip(SKIP_IDENTICAL_PAIR)
    return PreferencePair(prompt, chosen, rejected, meta=_meta(row, "preference"), origin=where)


def _parse_unpaired(row: dict[str, Any], where: str, report: ReadReport) -> UnpairedExample:
    prompt = _prompt(_required(row, "prompt", where, "unpaired"), where, "prompt", report)
    completion = _text(_required(row, "completion", where, "unpaired"), where, "completion")
    label = _required(row, "label", where, "unpaired")
    if not isinstance(label, bool):
        raise _wrong_type(where, "label", "true or false", label)
    return UnpairedExample(prompt, completion, label, meta=_meta(row, "unpaired"), origin=where)


def _parse_ranking(row: dict[str, Any], where: str, report: ReadReport) -> Ranking:
    prompt = _prompt(_required(row, "prompt", where, "ranking"), where, "prompt", report)
    responses = _required(row, "responses", where, "ranking")
    if not isinstance(responses, list):
        raise _wrong_type(where, "responses", "an array of at least 2 strings, best first", responses)
    if len(responses) < 2:
        raise DataError(where, f"field 'responses': expected at least 2 responses (best first), got {len(responses)}",
                        field="responses", expected="at least 2 responses")
    texts = [_text(r, where, f"responses[{i}]") for i, r in enumerate(responses)]
    if len({t.strip() for t in texts}) < len(texts):
        raise _Skip(SKIP_DUPLICATE_RESPONSES)
    return Ranking(prompt, texts, meta=_meta(row, "ranking"), origin=where)


def _parse_problem(row: dict[str, Any], where: str, report: ReadReport) -> Problem:
    prompt = _prompt(_required(row, "prompt", where, "problem"), where, "prompt", report)
    answer = row.get("answer")
    if answer is not None:
        if isinstance(answer, int) and not isinstance(answer, bool):
            answer = str(answer)
        elif isinstance(answer, float):
            raise _wrong_type(where, "answer", "a string or an integer (write decimals as strings to keep "
                                               "their exact form)", answer)
        answer = _text(answer, where, "answer")
    tests = row.get("tests")
    if tests is not None and (not isinstance(tests, list) or not tests):
        raise _wrong_type(where, "tests", "a non-empty array of test cases", tests)
    if answer is None and tests is None:
        raise DataError(where, f"missing field 'answer'; a problem record needs {SCHEMAS['problem']}",
                        field="answer", expected=SCHEMAS["problem"])
    level = row.get("level")
    if level is not None:
        if isinstance(level, int) and not isinstance(level, bool):
            level = str(level)
        level = _text(level, where, "level")
    return Problem(prompt, answer, tests, level, meta=_meta(row, "problem"), origin=where)


_PARSERS: dict[str, Callable[[dict[str, Any], str, ReadReport], Record]] = {
    "sft": _parse_sft,
    "preference": _parse_preference,
    "unpaired": _parse_unpaired,
    "ranking": _parse_ranking,
    "problem": _parse_problem,
}


# --------------------------------------------------------------------------------------------------
# Field checks


def _add(row: Any, kind: str, where: str, records: list[Record], report: ReadReport) -> None:
    report.rows += 1
    try:
        records.append(_PARSERS[kind](_as_object(row, where), where, report))
        report.records += 1
    except _Skip as s:
        report.skipped.setdefault(s.reason, []).append(where)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown record kind {kind!r}; expected one of {list(KINDS)}")


def _check_not_all_skipped(report: ReadReport) -> None:
    if report.records == 0:
        raise DataError(report.source, f"no usable {report.kind} records: all {report.rows} rows were skipped "
                                       f"({report.skipped_text()})", expected="a usable row")


def _as_object(row: Any, where: str) -> dict[str, Any]:
    if not isinstance(row, Mapping):
        raise DataError(where, f"expected a JSON object, got {_type_name(row)}", expected="a JSON object")
    return dict(row)


def _present(row: dict[str, Any], name: str) -> bool:
    return row.get(name) is not None


def _required(row: dict[str, Any], name: str, where: str, kind: str) -> Any:
    if name not in row:
        raise DataError(where, f"missing field '{name}'; {_ARTICLE[kind]} {kind} record needs {SCHEMAS[kind]}",
                        field=name, expected=SCHEMAS[kind])
    return row[name]


def _text(value: Any, where: str, name: str) -> str:
    if not isinstance(value, str):
        raise _wrong_type(where, name, "a non-empty string", value)
    if not value.strip():
        raise DataError(where, f"field '{name}': expected a non-empty string, got {_short(value)}",
                        field=name, expected="a non-empty string")
    return value


def _messages(value: Any, where: str, name: str, report: ReadReport) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise _wrong_type(where, name, "a non-empty array of {role, content} objects", value)
    out = []
    for i, m in enumerate(value):
        here = f"{name}[{i}]"
        if not isinstance(m, Mapping):
            raise _wrong_type(where, here, "an object {role, content}", m)
        for key in ("role", "content"):
            if key not in m:
                raise DataError(where, f"missing field '{here}.{key}'; a message needs 'role' and 'content'",
                                field=f"{here}.{key}", expected="'role' and 'content'")
        role = m["role"]
        if not isinstance(role, str) or role not in ROLES:
            raise DataError(where, f"field '{here}.role': unknown role {_short(role)}; expected one of {list(ROLES)}",
                            field=f"{here}.role", expected=f"one of {list(ROLES)}")
        out.append(Message(role, _text(m["content"], where, f"{here}.content")))
        report.ignored_message_keys.update(k for k, v in m.items() if k not in ("role", "content") and v is not None)
    return out


def _prompt(value: Any, where: str, name: str, report: ReadReport) -> Prompt:
    """A prompt is a string or a list of messages that does not end with an assistant turn."""
    if isinstance(value, str):
        return _text(value, where, name)
    if not isinstance(value, list):
        raise _wrong_type(where, name, "a string or an array of {role, content} objects", value)
    messages = _messages(value, where, name, report)
    if messages[-1].role == "assistant":
        raise DataError(where, f"field '{name}': the last message is from the assistant; expected the prompt "
                               "to end with a user (or system/tool) turn", field=name, expected="a non-assistant last turn")
    return messages


def _as_messages(prompt: Prompt) -> list[Message]:
    return [Message("user", prompt)] if isinstance(prompt, str) else list(prompt)


def _meta(row: dict[str, Any], kind: str) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in _FIELDS[kind]}


def _wrong_type(where: str, name: str, expected: str, value: Any) -> DataError:
    found = "null" if value is None else f"{_type_name(value)} {_short(value)}"
    return DataError(where, f"field '{name}': expected {expected}, got {found}",
                     field=name, expected=expected)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    return type(value).__name__


def _short(value: Any, limit: int = 40) -> str:
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _list_locations(locations: list[str], limit: int = 5) -> str:
    # "x.jsonl:3, x.jsonl:7" -> "lines 3, 7" when they share a file; dataset rows stay as they are.
    prefix = locations[0].rsplit(":", 1)[0] + ":"
    if all(loc.startswith(prefix) and loc[len(prefix):].isdigit() for loc in locations):
        shown = ", ".join(loc[len(prefix):] for loc in locations[:limit])
        shown = f"lines {shown}"
    else:
        shown = ", ".join(locations[:limit])
    return shown + (f", … {len(locations) - limit} more" if len(locations) > limit else "")
