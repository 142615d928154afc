"""Multi-turn episodes with the KV cache kept across turns (`run_episodes(keep_kv=True)`, the native
engine's prefix cache) against the same episodes prefilled from scratch every turn: the same tokens, the
same log-probs up to fp32 round-off, the prefill saved counted exactly, each entry freed when its
episode ends."""

from __future__ import annotations


import pytest
import torch

from posttrain.data.records import Message, Problem
from posttrain.envs import Budget, StepResult, run_episodes
from posttrain.models import build_tiny
from posttrain.rollout import NativeEngine, SamplingParams, make_engine

pytestmark = pytest.mark.usefixtures("one_thread")

# fp32 round-off, as in test_rollout_prefix_cache.py: the kept keys/values were computed in other batch
# shapes (a prefill of the previous prompt, one-token decode steps) than a full prefill, so sums run in
# another order; measured ≤ 1e-5 per log-prob. It could fail if a greedy step met a near-tie (top-2
# logits within ~1e-6): the paths would then pick different tokens; the fixed seeds here have none.
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def model(tok):
    m = build_tiny("tiny-1m", vocab_size=len(tok), seed=0, pad_token_id=tok.pad_token_id,
                   eos_token_id=tok.eos_token_id).eval()
    with torch.no_grad():  # <|im_end|> frequent: some turns end with the model's EOS, others at the turn budget
        m.model.embed_tokens.weight[tok.convert_tokens_to_ids("<|im_end|>")] *= 45
    return m


class FixedText:
    """Answers every turn with the same tool message; done after 1 + (problem number % 4) turns, so rows
    finish at turns 1, 2, 3 and 4. `seen` records, per turn, what the engine's prefix cache holds."""

    def __init__(self, seen: list | None = None, engine=None):
        self.k, self.turns, self.seen, self.engine = 0, 1, seen, engine

    def reset(self, problem):
        self.turns = 1 + int(problem.prompt.split()[0]) % 4
        return [Message("system", "be brief"), Message("user", problem.prompt)]

    def step(self, text):
        self.k += 1
        if self.seen is not None:
            self.seen.append((self.k, len(self.engine.prefix_cache)))
        if self.k >= self.turns:
            return StepResult([], 1.0, done=True)
        return StepResult([Message("tool", "result 42")], None, done=False, tool_calls=1)


PROBLEMS = [Problem(f"{i} + {2 * i} =") for i in range(6)]  # done after turns 1, 2, 3, 4, 1, 2


def _play(model, tok, keep_kv, params, **engine_options):
    engine = make_engine("native", model, tok, **engine_options)
    run = run_episodes(engine, tok, FixedText, PROBLEMS, budget=Budget(max_turns=6, max_tokens=300, turn_tokens=10),
                       params=params, keep_kv=keep_kv)
    return engine, run


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=7)],
                         ids=["greedy", "sampled"])
def test_kept_kv_gives_the_same_episodes(model, tok, params):
    engine, kept = _play(model, tok, True, params)
    _, fresh = _play(model, tok, False, params)
    assert [e.turns for e in fresh.episodes] == [1, 2, 3, 4, 1, 2]      # rows finish at different turns
    for a, b in zip(kept.episodes, fresh.episodes):
        assert torch.equal(a.token_ids, b.token_ids)
        assert torch.equal(a.model_mask, b.model_mask)
        assert float((a.policy_logprobs - b.policy_logprobs).abs().max()) <= LOGPROB_TOL
        assert float((a.logprobs - b.logprobs).abs().max()) <= LOGPROB_TOL
    # turn k + 1 starts from the row turn k kept: every token up to turn k's end but its last
    saved = sum(end - 1 for e in kept.episodes for _, end in e.turn_spans[:-1])
    assert kept.prefill_tokens_saved == saved > 0 and fresh.prefill_tokens_saved == 0
    assert kept.prompt_tokens == fresh.prompt_tokens
    assert len(engine.prefix_cache) == 0 and engine.prefix_cache.bytes == 0  # all released at the end


def test_kept_kv_in_bf16_gives_the_same_tokens(model, tok, monkeypatch):
    # a bf16 cache (bf16 arithmetic, C attention): kept values are the bf16 numbers the earlier turn wrote,
    # a full prefill rounds its own (1 bf16 ulp apart at most per value); tokens are expected to agree.
    # The matmul forms are the static ones: the tuner times each row bucket apart, and where its timings give
    # one bucket another kernel (another summation order) than the next, the kept and the fresh run, which
    # multiply a turn's tokens in different row counts, differ by more than the cache's rounding (a log-prob
    # 0.073 apart on the AMX Xeon, 7 Dec)
    monkeypatch.setenv("POSTTRAIN_MATMUL_TUNE", "0")
    opts = dict(dtype=torch.bfloat16, compute=torch.bfloat16)
    params = SamplingParams(temperature=0.0)
    _, kept = _play(model, tok, True, params, **opts)
    _, fresh = _play(model, tok, False, params, **opts)
    assert kept.prefill_tokens_saved > 0
    for a, b in zip(kept.episodes, fresh.episodes):
        assert torch.equal(a.token_ids, b.token_ids)
        assert float((a.policy_logprobs - b.policy_logprobs).abs().max()) <= 5e-2


def test_an_episode_frees_its_entry_when_it_ends(model, tok):
    engine = NativeEngine(model, tok)
    seen: list = []
    run = run_episodes(engine, tok, lambda: FixedText(seen, engine), PROBLEMS, params=SamplingParams(temperature=0.0),
                       budget=Budget(max_turns=6, max_tokens=300, turn_tokens=10))
    # during turn k's environment step the cache holds one entry per episode still playing turn k:
    # 6 episodes at turn 1, then those with ≥ 2, 3, 4 turns: 4, 2, 1 (ended ones were released)
    held = {k: n for k, n in seen}
    assert held == {1: 6, 2: 4, 3: 2, 4: 1}
    assert [e.turns for e in run.episodes] == [1, 2, 3, 4, 1, 2]
    assert len(engine.prefix_cache) == 0


def test_the_last_turn_by_budget_keeps_nothing_and_keep_kv_off_keeps_nothing(model, tok):
    engine = NativeEngine(model, tok)
    run_episodes(engine, tok, FixedText, PROBLEMS, budget=Budget(max_turns=1, max_tokens=300, turn_tokens=10),
                 params=SamplingParams(temperature=0.0))
    assert engine.prefix_cache.stats.stored == 0                     # one turn allowed: nothing to keep it for
    run_episodes(engine, tok, FixedText, PROBLEMS, budget=Budget(max_turns=6, max_tokens=300, turn_tokens=10),
                 params=SamplingParams(temperature=0.0), keep_kv=False)
    assert engine.prefix_cache.stats.stored == 0 and engine.prefix_cache.stats.lookups == 0


def test_the_hf_backend_runs_episodes_unchanged(model, tok):
    engine = make_engine("hf", model, tok)
    run = run_episodes(engine, tok, FixedText, PROBLEMS[:2], budget=Budget(max_turns=6, max_tokens=300, turn_tokens=6),
                       params=SamplingParams(temperature=0.0))
    assert run.prefill_tokens_saved == 0 and [e.turns for e in run.episodes] == [1, 2]


def test_the_recipe_key():
    from posttrain.runtime.config import EnvSpec

    assert EnvSpec(name="tools").keep_kv is True                      # on by default
    assert EnvSpec(name="tools", keep_kv=False).keep_kv is False
    with pytest.raises(ValueError, match="keep_kvs"):                 # a typo is named, not ignored
        EnvSpec(name="tools", keep_kvs=False)
