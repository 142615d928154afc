"""An episode as one token sequence: the model's tokens as sampled, the environment's as the template renders them.

The model's tokens are never re-tokenized: what it sampled is what the update forwards (decoding and
re-encoding a turn can give different ids, and then the log-probs recorded at sampling time would
belong to another sequence). Only the text the *environment* adds is rendered and tokenized, as the
difference between two renderings of the chat by the tokenizer's own template:

    before = render(chat + [assistant turn])                          # no generation prompt
    after  = render(chat + [assistant turn] + new messages, add_generation_prompt=True)
    environment text = (the turn's closing text the model did not write) + after[len(before):]

The closing text is what the template puts after an assistant message's content (ChatML:
`<|im_end|>\n`), found once by rendering a sentinel; when the model ended its turn with the EOS
token the template's closing starts with, the environment writes only the rest (ChatML: `\n`), so
the EOS stays the model's token — it must learn to end its turns. A template that does not render
the shorter chat as a prefix of the longer (some drop earlier `<think>` blocks) cannot be diffed:
`TemplateError`, not a guess.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from posttrain.data import TemplateError, encode_prompt
from posttrain.data.records import Message

_SENTINEL = "\u2063posttrain-sentinel\u2063"


class Transcript:
    """Renders prompts and the environment's additions for one tokenizer's chat template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        probe = self._render([Message("user", "x"), Message("assistant", _SENTINEL)], add_generation_prompt=False)
        at = probe.find(_SENTINEL)
        if at < 0:
            raise TemplateError("the chat template does not render an assistant message's content verbatim")
        self.turn_close = probe[at + len(_SENTINEL):]  # ChatML: "<|im_end|>\n"

    def _render(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template([m.as_dict() for m in messages], tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The first prompt: the chat with the template's generation prompt. Shape: (P,)."""
        return encode_prompt(list(messages), self.tokenizer)

    def closing(self, last_token: int | None) -> str:
        """What the template puts after the turn's content that the model did not write itself."""
        if last_token is not None and last_token in self.eos_ids:
            eos_text = self.tokenizer.decode([last_token], skip_special_tokens=False)
            if self.turn_close.startswith(eos_text):
                return self.turn_close[len(eos_text):]
        return self.turn_close

    def environment_ids(self, chat: Sequence[Message], new: Sequence[Message], last_token: int | None) -> list[int]:
        """Token ids the environment writes after the model's turn: the turn's closing, `new` rendered,
        and the next generation prompt. `chat` ends with that assistant turn. Shape: (E,)."""
        before = self._render(chat, add_generation_prompt=False)
        after = self._render([*chat, *new], add_generation_prompt=True)
        if not after.startswith(before):
            raise TemplateError("the chat template does not render the chat so far as a prefix of the chat with "
                                "the environment's messages, so the environment's tokens cannot be found by diffing")
        text = self.closing(last_token) + after[len(before):]
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
