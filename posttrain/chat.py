"""`posttrain chat CHECKPOINT`: talk to any Hugging Face chat checkpoint in the terminal.

The conversation is rendered with the checkpoint's own chat template every turn (the whole history,
so a template that treats earlier turns differently is honoured) and continued by our rollout engine
(`make_engine("native", ...)`: the fused decode path where it serves the model, else the model's own
forward). `/reset` forgets the history (the system prompt stays), `/exit` or end of input ends the
session. When the history no longer fits the model's context with room for a reply, the oldest turns
are dropped, and the session says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.models.loading import ModelLoadError, load_model, load_tokenizer
from posttrain.rollout.engine import RolloutEngine, make_engine
from posttrain.rollout.sampling import SamplingParams

COMMANDS = {"/reset": "forget the conversation (the system prompt stays)", "/exit": "end the session"}


@dataclass
class Reply:
    text: str
    tokens: int          # generated tokens, the end-of-turn token included
    finished: bool       # False: cut by max_new_tokens
    dropped_turns: int   # earlier messages dropped to fit the context


@dataclass
class ChatSession:
    """A conversation with one model: history in, the next assistant turn out."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    engine: RolloutEngine
    params: SamplingParams
    system: str | None = None
    history: list[dict[str, str]] = field(default_factory=list)  # user/assistant turns, oldest first

    @property
    def context(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history

    def prompt_ids(self) -> tuple[list[int], int]:
        """The rendered conversation with the generation prompt, and how many oldest messages were dropped
        to leave `max_new_tokens` of room in the context."""
        dropped = 0
        while True:
            ids = list(self.tokenizer.apply_chat_template(self.messages(), tokenize=True, add_generation_prompt=True,
                                                          return_dict=True)["input_ids"])
            if self.context is None or len(ids) + self.params.max_new_tokens <= self.context or len(self.history) <= 1:
                return ids, dropped
            del self.history[:2]  # the oldest user turn and the reply to it
            dropped += 2

    def send(self, text: str) -> Reply:
        self.history.append({"role": "user", "content": text})
        ids, dropped = self.prompt_ids()
        r = self.engine.generate([ids], self.params)
        answer = r.texts[0].strip()
        self.history.append({"role": "assistant", "content": answer})
        return Reply(answer, int(r.completion_lengths[0]), r.finish_reason[0] == "stop", dropped)

    def reset(self) -> None:
        self.history.clear()


def open_session(checkpoint: str | Path, *, system: str | None = None, temperature: float = 0.7,
                 max_new_tokens: int = 256, seed: int | None = None) -> ChatSession:
    """Load `checkpoint` (any HF causal-LM folder with a tokenizer that has a chat template) for chatting."""
    path = Path(checkpoint)
    model = load_model(path).eval()
    tokenizer = load_tokenizer(path)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError(f"{path}: the tokenizer has no chat template (tokenizer_config.json 'chat_template' "
                             "or chat_template.jinja); expected a chat model")
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    return ChatSession(model, tokenizer, make_engine("native", model, tokenizer), params, system)


@torch.no_grad()
def chat_loop(session: ChatSession, console: Console, read: Callable[[], str] | None = None) -> int:
    """Read user lines until `/exit` or end of input; print each reply. Returns the number of replies.

    `read` returns the next line (raises EOFError at the end); default: `console.input` with a prompt."""
    read = read or (lambda: console.input("[bold cyan]you>[/] "))
    engine = getattr(session.engine, "kernels", session.engine.name)
    console.print(f"[dim]chat with {getattr(session.model.config, '_name_or_path', '') or 'the model'} "
                  f"({engine} decode, temperature {session.params.temperature:g}, ≤ {session.params.max_new_tokens} "
                  f"new tokens); commands: " + ", ".join(f"{c} {w}" for c, w in COMMANDS.items()) + "[/]",
                  highlight=False)
    replies = 0
    while True:
        try:
            line = read().strip()
        except (EOFError, KeyboardInterrupt):
            console.print()
            break
        if not line:
            continue
        if line == "/exit":
            break
        if line == "/reset":
            session.reset()
            console.print("[dim](conversation reset)[/]")
            continue
        if line.startswith("/") and " " not in line:
            console.print(f"[dim]unknown command {line}; commands: {', '.join(COMMANDS)}[/]", highlight=False)
            continue
        reply = session.send(line)
        if reply.dropped_turns:
            console.print(f"[dim](dropped the {reply.dropped_turns} oldest messages to fit the context)[/]")
        console.print("[bold green]model>[/] ", end="")
        console.print(reply.text, highlight=False, markup=False)  # the model's text is never rich markup
        if not reply.finished:
            console.print(f"[dim](cut at {reply.tokens} tokens; raise --max-new-tokens)[/]")
        replies += 1
    return replies
