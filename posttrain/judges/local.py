"""A local Hugging Face chat model as a judge's backend, generating through our rollout engine.

Each request is rendered with the checkpoint's own chat template (generation prompt appended) and
continued by `make_engine("native", ...)` (as `posttrain chat` does). Requests sharing sampling
settings are batched `batch_size` at a time (the engine left-pads them); greedy by default, so a
judgement is repeatable. SmolLM2-135M-Instruct (`posttrain.models.smollm2_135m_instruct()`) works
offline.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from posttrain.judges.backend import ChatRequest, JudgeBackendError
from posttrain.models.loading import load_model, load_tokenizer
from posttrain.rollout.engine import RolloutEngine, make_engine
from posttrain.rollout.sampling import SamplingParams


class LocalChatBackend:
    name = "local"

    def __init__(self, model: Any, tokenizer: PreTrainedTokenizerBase, *, engine: RolloutEngine | None = None,
                 batch_size: int = 8, seed: int = 0):
        if not getattr(tokenizer, "chat_template", None):
            raise JudgeBackendError("the judge's tokenizer has no chat template; expected a chat model")
        self.tokenizer = tokenizer
        self.engine = engine or make_engine("native", model, tokenizer)
        self.batch_size = batch_size
        self.seed = seed
        self.generated = 0  # replies generated so far

    @classmethod
    def from_checkpoint(cls, folder: str | Path, **options: Any) -> LocalChatBackend:
        return cls(load_model(Path(folder)).eval(), load_tokenizer(Path(folder)), **options)

    def _ids(self, request: ChatRequest) -> list[int]:
        chat = [m.as_dict() for m in request.messages]
        return list(self.tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True,
                                                       return_dict=True)["input_ids"])

    def complete(self, requests: Sequence[ChatRequest]) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[tuple[int, float], list[int]] = {}
        for i, r in enumerate(requests):  # one SamplingParams per group of like requests
            groups.setdefault((r.max_tokens, r.temperature), []).append(i)
        for (max_tokens, temperature), idx in groups.items():
            params = SamplingParams(temperature=temperature, max_new_tokens=max_tokens, seed=self.seed)
            for k in range(0, len(idx), self.batch_size):
                chunk = idx[k:k + self.batch_size]
                rollout = self.engine.generate([self._ids(requests[i]) for i in chunk], params)
                for i, text in zip(chunk, rollout.texts):
                    out[i] = text.strip()
                self.generated += len(chunk)
        return [t or "" for t in out]
