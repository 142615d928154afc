"""Chat-template application and response-only loss masks.

SFT trains on what the assistant says, never on the prompt (InstructGPT, Ouyang et al. 2022, §3.5
and Appendix C: the SFT loss is the LM loss on demonstration tokens; the "completion-only loss" of
common trainers). `labels` equal `input_ids` on response tokens and -100 (PyTorch's `ignore_index`)
everywhere else, *unshifted* — Hugging Face causal LMs shift them inside `forward`.

Where the response tokens are, two ways, chosen by `mask=`:

1. `"markers"` — the chat template wraps assistant turns in `{% generation %}…{% endgeneration %}`
   (ours does, see `posttrain.models.tokenizer`), and `transformers` returns `assistant_masks`.
2. `"diff"` — the fallback for templates without markers (most hub templates). For each assistant
   turn i, render the chat up to turn i with the generation prompt (`before`) and the chat through
   turn i (`through`); the response is the text `through` adds to `before`, ending just after the
   first EOS token that follows the message's content (so a template's trailing newline after
   `<|im_end|>` stays out, as with the markers; without an EOS there, trailing whitespace is
   trimmed). The full chat is tokenized once with offsets; a token is in the mask when its characters
   overlap a response span. A template that does not render turn prefixes as prefixes of the full
   chat (some drop earlier `<think>` blocks) cannot be diffed: that is an error, not a guess.

`"auto"` uses the markers when the template has them. A test checks both give the same ids and
labels on our tokenizer.

Departures / policies:

1. Length: an encoding longer than `max_len` is a `DataError` naming the record (its `origin`,
   file:line when read from a file) unless `truncation` says otherwise — SFT: `"left"` keeps the last
   `max_len` tokens (the end of the response), `"right"` the first; prompt+completion pairs: `"left"`
   drops tokens from the start of the shared prompt. Each encoding says `truncated`; the `*_dataset`
   helpers return how many were. An encoding left with no response token is always an error (it
   would give a 0/0 loss downstream).
2. Preference pairs: chosen and rejected share the prompt token-for-token (checked); only the final
   reply is labelled — assistant turns inside a multi-turn prompt are context, not targets, unlike
   in SFT where every assistant turn is trained.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from transformers import PreTrainedTokenizerBase

from posttrain.data.records import (
    DataError,
    Message,
    PreferencePair,
    Prompt,
    SFTExample,
    UnpairedExample,
    prompt_messages,
)

IGNORE_INDEX = -100

MaskMethod = Literal["auto", "markers", "diff"]
Truncation = Literal["error", "left", "right"]

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateError(ValueError):
    """The tokenizer's chat template cannot give what was asked (no template, not prefix-stable)."""


class _HasPrompt(Protocol):
    prompt: Prompt
    origin: str


@dataclass(frozen=True)
class EncodedSFT:
    """Shape: `input_ids` and `labels` both (T,), T ≤ max_len."""

    input_ids: list[int]
    labels: list[int]  # input_ids on response tokens, IGNORE_INDEX elsewhere; unshifted
    truncated: bool = False
    origin: str = ""


@dataclass(frozen=True)
class EncodedCompletion:
    """A prompt followed by one reply; `input_ids[:prompt_len]` is the prompt with the generation prompt."""

    input_ids: list[int]
    labels: list[int]  # IGNORE_INDEX on the first prompt_len tokens
    prompt_len: int
    truncated: bool = False
    origin: str = ""


@dataclass(frozen=True)
class EncodedPreference:
    """Chosen and rejected encodings; their first `prompt_len` tokens are the same prompt."""

    chosen: EncodedCompletion
    rejected: EncodedCompletion

    @property
    def prompt_len(self) -> int:
        return self.chosen.prompt_len

    @property
    def truncated(self) -> bool:
        return self.chosen.truncated

    @property
    def origin(self) -> str:
        return self.chosen.origin


# --------------------------------------------------------------------------------------------------
# Templates and masks


def has_generation_markers(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template marks assistant tokens with `{% generation %}`."""
    template = _template(tokenizer)
    return bool(_GENERATION_TAG.search(template))


def response_mask(
    messages: Sequence[Message], tokenizer: PreTrainedTokenizerBase, *, mask: MaskMethod = "auto"
) -> tuple[list[int], list[int]]:
    """Token ids of the rendered chat and a 0/1 mask (1 on assistant tokens). Shape: (T,), (T,)."""
    _check_choice("mask", mask, ("auto", "markers", "diff"))
    if mask == "auto":
        mask = "markers" if has_generation_markers(tokenizer) else "diff"
    if mask == "markers":
        if not has_generation_markers(tokenizer):
            raise TemplateError("mask='markers' needs a chat template with {% generation %} markers; "
                                "this one has none (use mask='diff' or 'auto')")
        out = tokenizer.apply_chat_template(
            [m.as_dict() for m in messages], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]
    return _diff_mask(messages, tokenizer)


def _diff_mask(messages: Sequence[Message], tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    if not tokenizer.is_fast:
        raise TemplateError("mask='diff' needs a fast tokenizer (character offsets)")
    full = _render(tokenizer, messages, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m.role != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else _generation_prompt(tokenizer)
        through = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (through.startswith(before) and full.startswith(through)):
            raise TemplateError(f"the chat template does not render turn {i} as a prefix of the full chat, so the "
                                "response span cannot be found by diffing; use a template with {% generation %} markers")
        added = through[len(before):]
        spans.append((len(before), len(before) + _response_end(added, m.content, tokenizer.eos_token)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s < hi and e > lo for lo, hi in spans)) for s, e in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def _generation_prompt(tokenizer: PreTrainedTokenizerBase) -> str:
    """The text `add_generation_prompt` appends, for a chat that opens with an assistant turn (templates
    refuse to render an empty chat). Found by diffing a one-message chat with and without it."""
    probe = [Message("user", "x")]
    without = _render(tokenizer, probe, add_generation_prompt=False)
    with_prompt = _render(tokenizer, probe, add_generation_prompt=True)
    if not with_prompt.startswith(without):
        raise TemplateError("the chat template's generation prompt is not appended at the end of the chat")
    return with_prompt[len(without):]


def _response_end(added: str, content: str, eos: str | None) -> int:
    """Where the response ends inside the text a turn adds: just after the first EOS that follows the content."""
    at = added.find(content)
    after_content = at + len(content) if at >= 0 else 0
    if eos:
        k = added.find(eos, after_content)
        if k >= 0:
            return k + len(eos)
    return len(added.rstrip())


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
    _template(tokenizer)
    return tokenizer.apply_chat_template(
        [m.as_dict() for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt
    )


def _template(tokenizer: PreTrainedTokenizerBase) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if not template:
        raise TemplateError(f"tokenizer {type(tokenizer).__name__} has no chat template; set tokenizer.chat_template")
    return template


# --------------------------------------------------------------------------------------------------
# Encoders


def encode_sft(
    example: SFTExample,
    tokenizer: PreTrainedTokenizerBase,
    max_len: int,
    *,
    truncation: Truncation = "error",
    mask: MaskMethod = "auto",
) -> EncodedSFT:
    """Render `example` with the chat template; labels on every assistant turn only."""
    _check_choice("truncation", truncation, ("error", "left", "right"))
    _check_max_len(max_len)
    ids, m = response_mask(example.messages, tokenizer, mask=mask)
    labels = [t if k else IGNORE_INDEX for t, k in zip(ids, m)]
    _check_has_response(labels, example.origin, "the chat has no assistant tokens after templating")
    truncated = len(ids) > max_len
    if truncated:
        if truncation == "error":
            raise _too_long(example.origin, "example", len(ids), max_len, "'left' or 'right'")
        cut = slice(len(ids) - max_len, None) if truncation == "left" else slice(0, max_len)
        ids, labels = ids[cut], labels[cut]
        _check_has_response(labels, example.origin, f"after {truncation} truncation to {max_len} tokens no response token is left")
    return EncodedSFT(ids, labels, truncated, example.origin)


def encode_prompt(
    prompt: Prompt | _HasPrompt,
    tokenizer: PreTrainedTokenizerBase,
    max_len: int | None = None,
    *,
    truncation: Literal["error", "left"] = "error",
    origin: str = "",
) -> list[int]:
    """Token ids of a prompt ready for generation (the template's generation prompt appended).
    Accepts a string, a message list, or a record with `.prompt` (whose `.origin` names it in errors)."""
    if hasattr(prompt, "prompt"):
        origin = origin or getattr(prompt, "origin", "")
        prompt = prompt.prompt  # type: ignore[union-attr]
    _check_choice("truncation", truncation, ("error", "left"))
    if max_len is not None:
        _check_max_len(max_len)
    _template(tokenizer)
    out = tokenizer.apply_chat_template(
        [m.as_dict() for m in prompt_messages(prompt)], tokenize=True, add_generation_prompt=True, return_dict=True
    )
    ids = list(out["input_ids"])
    if max_len is not None and len(ids) > max_len:
        if truncation == "error":
            raise _too_long(origin, "prompt", len(ids), max_len, "'left'")
        ids = ids[len(ids) - max_len:]
    return ids


def encode_completion(
    prompt: Prompt,
    completion: str,
    tokenizer: PreTrainedTokenizerBase,
    max_len: int,
    *,
    truncation: Literal["error", "left"] = "error",
    mask: MaskMethod = "auto",
    origin: str = "",
) -> EncodedCompletion:
    """A prompt and one assistant reply; labels on the reply only (KTO examples, ranking responses)."""
    _check_choice("truncation", truncation, ("error", "left"))
    _check_max_len(max_len)
    full = _completion(prompt, completion, tokenizer, mask, origin)
    if len(full.input_ids) <= max_len:
        return full
    if truncation == "error":
        raise _too_long(origin, "prompt + completion", len(full.input_ids), max_len, "'left'")
    return _drop_prompt_head(full, len(full.input_ids) - max_len, max_len)


def encode_unpaired(
    example: UnpairedExample,
    tokenizer: PreTrainedTokenizerBase,
    max_len: int,
    *,
    truncation: Literal["error", "left"] = "error",
    mask: MaskMethod = "auto",
) -> EncodedCompletion:
    return encode_completion(example.prompt, example.completion, tokenizer, max_len,
                             truncation=truncation, mask=mask, origin=example.origin)


def encode_preference(
    pair: PreferencePair,
    tokenizer: PreTrainedTokenizerBase,
    max_len: int,
    *,
    truncation: Literal["error", "left"] = "error",
    mask: MaskMethod = "auto",
) -> EncodedPreference:
    """Chosen and rejected, each `prompt + reply`, sharing the same prompt tokens. With
    `truncation="left"` the same number of prompt tokens is dropped from both so the longer fits."""
    _check_choice("truncation", truncation, ("error", "left"))
    _check_max_len(max_len)
    chosen = _completion(pair.prompt, pair.chosen, tokenizer, mask, pair.origin)
    rejected = _completion(pair.prompt, pair.rejected, tokenizer, mask, pair.origin)
    if chosen.input_ids[: chosen.prompt_len] != rejected.input_ids[: rejected.prompt_len]:
        raise TemplateError(f"{pair.origin}: chosen and rejected render different prompt tokens")
    longest = max(len(chosen.input_ids), len(rejected.input_ids))
    if longest <= max_len:
        return EncodedPreference(chosen, rejected)
    if truncation == "error":
        raise _too_long(pair.origin, "prompt + longer reply", longest, max_len, "'left'")
    drop = longest - max_len
    if drop >= chosen.prompt_len:
        raise _whole_prompt_removed(pair.origin, longest - chosen.prompt_len, chosen.prompt_len, max_len)
    return EncodedPreference(_drop_prompt_head(chosen, drop, max_len), _drop_prompt_head(rejected, drop, max_len))


def encode_sft_dataset(
    examples: Iterable[SFTExample], tokenizer: PreTrainedTokenizerBase, max_len: int, *,
    truncation: Truncation = "error", mask: MaskMethod = "auto",
) -> tuple[list[EncodedSFT], int]:
    """`encode_sft` over a dataset; returns the encodings and how many were truncated."""
    out = [encode_sft(e, tokenizer, max_len, truncation=truncation, mask=mask) for e in examples]
    return out, sum(e.truncated for e in out)


def encode_preference_dataset(
    pairs: Iterable[PreferencePair], tokenizer: PreTrainedTokenizerBase, max_len: int, *,
    truncation: Literal["error", "left"] = "error", mask: MaskMethod = "auto",
) -> tuple[list[EncodedPreference], int]:
    """`encode_preference` over a dataset; returns the encodings and how many were truncated."""
    out = [encode_preference(p, tokenizer, max_len, truncation=truncation, mask=mask) for p in pairs]
    return out, sum(e.truncated for e in out)


def _completion(
    prompt: Prompt, completion: str, tokenizer: PreTrainedTokenizerBase, mask: MaskMethod, origin: str
) -> EncodedCompletion:
    prompt_ids = encode_prompt(prompt, tokenizer)
    ids, m = response_mask(prompt_messages(prompt) + [Message("assistant", completion)], tokenizer, mask=mask)
    p = len(prompt_ids)
    if ids[:p] != prompt_ids:
        raise TemplateError(f"{origin}: the prompt's tokens change when the reply is appended (the template or "
                            "tokenizer merges across the boundary), so prompt and reply cannot be separated")
    labels = [IGNORE_INDEX] * p + [t if k else IGNORE_INDEX for t, k in zip(ids[p:], m[p:])]
    _check_has_response(labels, origin, "the reply has no tokens after templating")
    return EncodedCompletion(ids, labels, p, False, origin)


def _drop_prompt_head(enc: EncodedCompletion, drop: int, max_len: int) -> EncodedCompletion:
    if drop >= enc.prompt_len:
        raise _whole_prompt_removed(enc.origin, len(enc.input_ids) - enc.prompt_len, enc.prompt_len, max_len)
    return EncodedCompletion(enc.input_ids[drop:], enc.labels[drop:], enc.prompt_len - drop, True, enc.origin)


def _whole_prompt_removed(origin: str, reply: int, prompt: int, max_len: int) -> DataError:
    return DataError(origin or "<record>", f"the reply alone is {reply} tokens and the prompt {prompt}; left truncation "
                                           f"to max_len {max_len} would remove the whole prompt; expected a shorter "
                                           "reply or a larger max_len", expected=f"≤ {max_len} tokens")


def _too_long(origin: str, what: str, n: int, max_len: int, options: str) -> DataError:
    return DataError(origin or "<record>", f"{what} is {n} tokens, longer than max_len {max_len}; expected ≤ {max_len} "
                                           f"(shorten it, raise max_len, or set truncation={options})",
                     expected=f"≤ {max_len} tokens")


def _check_has_response(labels: list[int], origin: str, why: str) -> None:
    if all(x == IGNORE_INDEX for x in labels):
        raise DataError(origin or "<record>", f"{why}; expected at least one response token to train on",
                        expected="a response token")


def _check_max_len(max_len: int) -> None:
    if not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive integer, got {max_len!r}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}; expected one of {list(choices)}")
