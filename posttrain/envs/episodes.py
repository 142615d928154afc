"""Multi-turn rollouts: a batch of episodes advanced together over any `RolloutEngine`.

    run = run_episodes(engine, tokenizer, factory, problems, budget=Budget(max_turns=4),
                       params=SamplingParams(temperature=1.0, seed=0))
    run.episodes[i].token_ids / .model_mask / .policy_logprobs       # (T,) each

The loop: generate one turn for every ready episode in one `engine.generate` call → each episode's
environment `step`s on its turn (in a thread pool, so a turn's tools run side by side) → the
environment's messages are rendered to tokens and appended → the episode is ready again, or over.
Finished episodes leave the batch. Per episode the result is one token sequence — the first prompt,
then model turns and environment text alternating — with `model_mask` True exactly on the tokens the
model sampled (every turn's EOS included) and False on everything the environment wrote, and the
sampling-time log-probs of the model's tokens (0 elsewhere).

Who waits for whom (`tool_wait_s`):
- None (default): lockstep — each round waits for every environment step of the round, so the rows of
  every `generate` call, and with a seed every sample, are reproducible. A row without a tool call
  waits for the round's slowest tool (at most the tool's timeout).
- a number: a round waits at most that long for its steps; the rows ready by then generate their next
  turn at once, and rows still waiting on a tool join a later `generate` call. Rows that wait on nothing
  are not blocked, at the price of reproducibility: which rows share a call depends on timing.

Departures from the designs of the frameworks that do this (veRL's agent loop, TRL, verifiers):
1. The KV cache is kept across turns where the engine keeps rows on request (`keep_kv`, on by default;
   the native engine, `rollout/prefix_cache.py`): each turn's `generate` keeps its rows under the
   episode's key, the next turn's prompt extends the kept tokens, so only the turn's last token and the
   environment's text are prefilled; an episode's entry is released when it ends. Elsewhere (HF
   `generate`) each turn prefills the whole episode so far; vLLM finds the shared prefix itself
   (automatic prefix caching). The cache never spans a weight update (the engine clears it).
2. The environment's text is tokenized as the template's rendering difference (`transcript.py`), the
   model's never re-tokenized; the importance ratio therefore reads exactly the sampled tokens.
3. A turn never runs past the episode's token budget: one `generate` call samples up to the longest
   room among its rows, and a row with less room keeps only its first `room` tokens (a prefix of a
   sample is a sample: its log-probs stay valid), ending its episode at the budget.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from enum import Enum

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from posttrain.data.records import Message, Problem
from posttrain.envs.base import Budget, EnvFactory, Environment, StepResult, close_environment
from posttrain.envs.transcript import Transcript
from posttrain.rollout import RolloutEngine, SamplingParams, prefix_cache_of
from posttrain.rollout.text import positions_from_mask

# `phase("generate")` / `phase("tool")` around each generate call and each wait on environments: a stage
# passes its telemetry (`ctx.phase`); a handle with `add(cost)` gets the generate call's decode cost.
PhaseHook = Callable[[str], AbstractContextManager]


class EpisodeEnd(str, Enum):  # str-valued (StrEnum is 3.11+; the project supports 3.10)
    DONE = "done"                  # the environment said so
    TURN_BUDGET = "turn_budget"    # Budget.max_turns assistant turns were taken
    TOKEN_BUDGET = "token_budget"  # the sequence reached Budget.max_tokens (or the environment's text would pass it)


@dataclass
class Episode:
    """One finished episode. T = the episode's tokens; P = its first prompt's."""

    problem_index: int
    messages: list[Message]     # the whole chat: reset messages, assistant turns, environment messages
    token_ids: Tensor           # (T,) long: prompt, then model and environment tokens as the model saw them
    model_mask: Tensor          # (T,) bool: True exactly on tokens the model sampled
    logprobs: Tensor            # (T,) fp32: log q(token) under the sampling distribution; 0 off the mask
    policy_logprobs: Tensor     # (T,) fp32: log π(token), raw model at T = 1 (the importance ratio's); 0 off the mask
    prompt_len: int             # P: tokens of the first prompt
    turn_spans: list[tuple[int, int]]  # [start, end) of each model turn in token_ids
    rewards: list[float | None]  # the environment's reward at each step (None: none at that step)
    end: EpisodeEnd
    tool_calls: int = 0
    tool_errors: int = 0
    hidden_probes: int = 0      # programs' attempts to read what they were not given (StepResult.hidden_probes), summed
    env_seconds: float = 0.0    # time inside the environment's `step` (tools included), summed
    finish: str = "stop"        # the last turn's finish: "stop" (the model ended it) or "length" (cut at a token budget)

    @property
    def turns(self) -> int:
        return len(self.turn_spans)

    @property
    def reward(self) -> float | None:
        """Sum of the step rewards; None when no step gave one (the caller's verifiers judge the episode)."""
        given = [r for r in self.rewards if r is not None]
        return sum(given) if given else None

    @property
    def final_text(self) -> str:
        """The last assistant turn's text (what a verifier of the final answer reads)."""
        return next((m.content for m in reversed(self.messages) if m.role == "assistant"), "")


@dataclass
class EpisodeRun:
    episodes: list[Episode]
    generate_calls: int
    generate_seconds: float  # wall time inside engine.generate
    wait_seconds: float      # wall time the loop spent waiting on environment steps and rendering their answers
    prompt_tokens: int = 0   # prompt tokens over all generate calls (what a prefill of everything would run)
    prefill_tokens_saved: int = 0  # of those, the tokens a kept KV cache covered (not prefilled again)


@dataclass
class _Live:
    index: int
    env: Environment
    messages: list[Message]
    ids: list[int]
    mask: list[bool]
    lps: list[float]
    plps: list[float]
    prompt_len: int
    spans: list[tuple[int, int]] = field(default_factory=list)
    rewards: list[float | None] = field(default_factory=list)
    end: EpisodeEnd | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    hidden_probes: int = 0
    env_seconds: float = 0.0
    last_text: str = ""
    last_token: int | None = None
    last_finish: str = "stop"

    @property
    def turns(self) -> int:
        return len(self.spans)


def _timed_step(env: Environment, text: str) -> tuple[StepResult, float]:
    t0 = time.perf_counter()
    result = env.step(text)
    return result, time.perf_counter() - t0


def run_episodes(engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase, factory: EnvFactory,
                 problems: Sequence[Problem], *, budget: Budget = Budget(), params: SamplingParams = SamplingParams(),
                 tool_wait_s: float | None = None, workers: int = 8, keep_kv: bool = True,
                 phase: PhaseHook = lambda name: nullcontext()) -> EpisodeRun:
    """One episode per problem (repeat a problem G times for a GRPO group). `params.n` must be 1;
    `params.max_new_tokens` is replaced by the budget's room each turn; with a seed, generate call k
    uses seed + k. Raises ValueError if a first prompt leaves no room in the token budget.

    `phase` times the loop's two kinds of work (see `PhaseHook`): `generate`, and `tool` — the time the
    loop waits on environment steps (in lockstep, the tools' whole wall time; with `tool_wait_s`, only
    what generation did not hide).

    `keep_kv`: keep each episode's KV cache across its turns where the engine can (`prefix_cache_of`;
    departure 1), prefilling only the new tokens: in fp32 the same tokens and log-probs up to round-off
    (in bf16, seeded samples may part where a draw meets a rounding shift: docs/rollout.md). A turn that
    is the episode's last by the turn budget keeps nothing."""
    if params.n != 1:
        raise ValueError(f"run_episodes: params.n={params.n}; repeat the problem instead (one episode per row)")
    transcript = Transcript(tokenizer, engine.eos_ids)
    live: list[_Live] = []
    for i, problem in enumerate(problems):
        env = factory()
        messages = list(env.reset(problem))
        ids = transcript.prompt_ids(messages)
        if len(ids) >= budget.max_tokens:
            raise ValueError(f"run_episodes: problem {i} ({problem.origin or 'no origin'}): its first prompt is "
                             f"{len(ids)} tokens, leaving no room in Budget.max_tokens={budget.max_tokens}")
        live.append(_Live(i, env, messages, ids, [False] * len(ids), [0.0] * len(ids), [0.0] * len(ids), len(ids)))

    ready: list[int] = list(range(len(live)))
    pending: dict[Future, int] = {}
    calls, gen_s, wait_s, prompt_tokens = 0, 0.0, 0.0, 0
    kv = prefix_cache_of(engine) if keep_kv else None
    run_key = object()  # this run's prefix-cache keys are (run_key, episode index): no clash with another caller
    saved0 = kv.stats.hit_tokens if kv is not None else 0

    def absorb(done: set[Future]) -> list[int]:
        finishing = [pending[f] for f in done]
        again = _absorb(done, pending, live, transcript, budget)
        if kv is not None:  # an episode over: its kept rows are garbage now
            engine.release([(run_key, i) for i in set(finishing) - set(again)])
        return again

    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="env-step") as pool, \
            _releasing(engine if kv is not None else None, [(run_key, i) for i in range(len(live))]):
        while ready or pending:
            if not ready:  # every live episode waits on its environment
                t0 = time.perf_counter()
                with phase("tool"):
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    ready += absorb(done)
                wait_s += time.perf_counter() - t0
                continue
            rows, ready = sorted(ready), []
            rooms = [min(budget.turn_tokens, budget.max_tokens - len(live[r].ids)) for r in rows]
            call_params = dataclasses.replace(params, max_new_tokens=max(rooms),
                                              seed=None if params.seed is None else params.seed + calls)
            prompts = [live[r].ids for r in rows]
            prompt_tokens += sum(len(p) for p in prompts)
            t0 = time.perf_counter()
            with phase("generate") as handle:
                if kv is None:
                    ro = engine.generate(prompts, call_params)
                else:  # keep the rows of episodes that may take another turn
                    keep = [(run_key, r) if live[r].turns + 1 < budget.max_turns else None for r in rows]
                    ro = engine.generate(prompts, call_params, keep=keep)
                if hasattr(handle, "add"):
                    handle.add(engine.decode_cost(batch=len(ro), prompt_len=ro.prompt_ids.shape[1],
                                                  new_tokens=max(1, ro.completion_ids.shape[1])))
            gen_s += time.perf_counter() - t0
            calls += 1
            lengths = ro.completion_lengths.tolist()
            for j, (r, room) in enumerate(zip(rows, rooms)):
                ep, k = live[r], min(lengths[j], room)
                toks = ro.completion_ids[j, :k].tolist()
                ep.spans.append((len(ep.ids), len(ep.ids) + k))
                ep.ids += toks
                ep.mask += [True] * k
                ep.lps += ro.logprobs[j, :k].tolist()
                ep.plps += ro.policy_logprobs[j, :k].tolist()
                ep.last_text = ro.texts[j] if k == lengths[j] else tokenizer.decode(toks, skip_special_tokens=True)
                ep.last_finish = ro.finish_reason[j] if k == lengths[j] else "length"
                ep.last_token = toks[-1] if toks and ep.last_finish == "stop" else None
                pending[pool.submit(_timed_step, ep.env, ep.last_text)] = r
            # Lockstep: wait for the whole round. Overlap: wait at most tool_wait_s; late rows join later calls.
            t0 = time.perf_counter()
            with phase("tool"):  # the environments' answers rendered to tokens are billed here too
                done, _ = wait(pending, timeout=tool_wait_s)
                ready += absorb(done)
            wait_s += time.perf_counter() - t0

    episodes = [Episode(ep.index, ep.messages, torch.tensor(ep.ids, dtype=torch.long), torch.tensor(ep.mask),
                        torch.tensor(ep.lps, dtype=torch.float32), torch.tensor(ep.plps, dtype=torch.float32),
                        ep.prompt_len, ep.spans, ep.rewards, ep.end or EpisodeEnd.DONE, ep.tool_calls,
                        ep.tool_errors, ep.hidden_probes, ep.env_seconds, ep.last_finish) for ep in live]
    saved = kv.stats.hit_tokens - saved0 if kv is not None else 0
    return EpisodeRun(episodes, calls, gen_s, wait_s, prompt_tokens, saved)


@contextmanager
def _releasing(engine: RolloutEngine | None, keys: list) -> Iterator[None]:
    """On the way out (an environment's exception included), release every key this run may have kept."""
    try:
        yield
    finally:
        if engine is not None:
            engine.release(keys)


def _absorb(done: set[Future], pending: dict[Future, int], live: list[_Live], transcript: Transcript,
            budget: Budget) -> list[int]:
    """Fold finished environment steps into their episodes; the rows that go on to another turn.
    An environment that raises is a bug in it (the protocol answers the model, never raises): re-raised."""
    again = []
    for fut in sorted(done, key=lambda f: pending[f]):
        ep = live[pending.pop(fut)]
        result, seconds = fut.result()
        ep.env_seconds += seconds
        ep.rewards.append(result.reward)
        ep.tool_calls += result.tool_calls
        ep.tool_errors += result.tool_errors
        ep.hidden_probes += result.hidden_probes
        ep.messages.append(Message("assistant", ep.last_text))
        chat = list(ep.messages)
        ep.messages += result.new_messages
        if result.done:
            ep.end = EpisodeEnd.DONE
        elif ep.turns >= budget.max_turns:
            ep.end = EpisodeEnd.TURN_BUDGET
        else:
            env_ids = transcript.environment_ids(chat, result.new_messages, ep.last_token)
            if len(ep.ids) + len(env_ids) >= budget.max_tokens:  # no room for the text and one model token
                ep.end = EpisodeEnd.TOKEN_BUDGET
            else:
                ep.ids += env_ids
                ep.mask += [False] * len(env_ids)
                ep.lps += [0.0] * len(env_ids)
                ep.plps += [0.0] * len(env_ids)
                again.append(ep.index)
        if ep.end is not None:  # over, whatever ended it: the environment's own resources go now
            close_environment(ep.env)
    return again


# ---- episodes as a training batch ----------------------------------------------------------------
@dataclass
class EpisodeBatch:
    """Episodes re-padded as one batch: first prompts left-padded to P, the rest right-padded to N.
    The loss and the KL fall only where `mask` is True (the model's tokens)."""

    input_ids: Tensor       # (R, P + N)
    attention_mask: Tensor  # (R, P + N) bool
    position_ids: Tensor    # (R, P + N)
    mask: Tensor            # (R, N) bool: model-sampled tokens after the first prompt
    old_logprobs: Tensor    # (R, N) fp32: sampling-time log π_old on the mask, 0 elsewhere
    prompt_len: int         # P


def pad_episodes(episodes: Sequence[Episode], pad_id: int) -> EpisodeBatch:
    """Shape: R = len(episodes) rows of P + N tokens (see `EpisodeBatch`)."""
    p = max(e.prompt_len for e in episodes)
    n = max(len(e.token_ids) - e.prompt_len for e in episodes)
    rows = len(episodes)
    ids = torch.full((rows, p + n), pad_id, dtype=torch.long)
    attn = torch.zeros((rows, p + n), dtype=torch.bool)
    mask = torch.zeros((rows, n), dtype=torch.bool)
    old = torch.zeros((rows, n))
    for i, e in enumerate(episodes):
        rest = len(e.token_ids) - e.prompt_len
        ids[i, p - e.prompt_len: p + rest] = e.token_ids
        attn[i, p - e.prompt_len: p + rest] = True
        mask[i, :rest] = e.model_mask[e.prompt_len:]
        old[i, :rest] = e.policy_logprobs[e.prompt_len:]
    return EpisodeBatch(ids, attn, positions_from_mask(attn), mask, old, p)
