"""The vLLM backend's pure parts, on CPU without vllm (posttrain/rollout/vllm_backend.py): the engine and
sampling arguments, log-probs read out of outputs of vLLM's documented shape (`RequestOutput.outputs[i]`
a `CompletionOutput` with `token_ids`, `logprobs` — per token a dict token id → `Logprob(logprob=…)` —
and `finish_reason`), and the order of sleep, wake and weight loads against a fake `LLM`.
The real engine needs a CUDA GPU: benchmarks/gpu_check.sh (docs/gpu.md)."""

from __future__ import annotations

import math
from types import SimpleNamespace as NS

import pytest
import torch

from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.vllm_backend import (
    VLLMEngine,
    completion_tensors,
    env_llm_kwargs,
    llm_kwargs,
    sampling_kwargs,
    sampling_logprobs,
    token_logprobs,
    worker_model,
)


def lp(x: float) -> NS:
    return NS(logprob=x, rank=1, decoded_token=None)  # vllm.sequence.Logprob's fields


def completion(tokens: list[int], logps: list[float], finish: str, *, extra: dict | None = None) -> NS:
    entries = [{t: lp(v), **(extra or {})} for t, v in zip(tokens, logps)]
    return NS(token_ids=tuple(tokens), logprobs=entries, finish_reason=finish, text="")


def test_llm_kwargs():
    kw = llm_kwargs("/m", tokenizer=True, dtype="auto", gpu_memory_utilization=0.3, enable_prefix_caching=True,
                    sleep_mode=True, seed=7, max_model_len=512)
    assert kw == {"model": "/m", "tokenizer": "/m", "dtype": "auto", "gpu_memory_utilization": 0.3,
                  "enable_prefix_caching": True, "enable_sleep_mode": True, "seed": 7, "max_model_len": 512}
    kw = llm_kwargs("/m", tokenizer=False, dtype="bfloat16", gpu_memory_utilization=1.0, enable_prefix_caching=False,
                    sleep_mode=False, seed=None)
    assert "tokenizer" not in kw and "enable_sleep_mode" not in kw and "seed" not in kw
    with pytest.raises(ValueError, match="gpu_memory_utilization=1.5"):
        llm_kwargs("/m", tokenizer=False, dtype="auto", gpu_memory_utilization=1.5, enable_prefix_caching=True,
                   sleep_mode=False, seed=None)


def test_env_llm_kwargs(monkeypatch):
    monkeypatch.delenv("POSTTRAIN_VLLM_ARGS", raising=False)
    assert env_llm_kwargs() == {}
    monkeypatch.setenv("POSTTRAIN_VLLM_ARGS", '{"enforce_eager": true, "max_model_len": 1024}')
    assert env_llm_kwargs() == {"enforce_eager": True, "max_model_len": 1024}
    monkeypatch.setenv("POSTTRAIN_VLLM_ARGS", "[1]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        env_llm_kwargs()
    monkeypatch.setenv("POSTTRAIN_VLLM_ARGS", "{enforce_eager}")
    with pytest.raises(ValueError, match="not JSON"):
        env_llm_kwargs()


def test_sampling_kwargs():
    kw = sampling_kwargs(SamplingParams(n=4, temperature=0.7, top_k=0, max_new_tokens=32, stop=("\n",), seed=3), [2, 5])
    assert kw["n"] == 4 and kw["temperature"] == 0.7 and kw["max_tokens"] == 32 and kw["seed"] == 3
    assert kw["top_k"] == -1  # our 0 (off) is vLLM's −1
    assert kw["stop"] == ["\n"] and kw["stop_token_ids"] == [2, 5] and kw["include_stop_str_in_output"]
    assert kw["logprobs"] == 0  # the sampled token's log-prob alone
    assert sampling_kwargs(SamplingParams(top_k=20), [2])["top_k"] == 20
    assert sampling_kwargs(SamplingParams(), [2])["stop"] is None
    with pytest.raises(ValueError, match="cannot sample a shard"):
        sampling_kwargs(SamplingParams(shard=(0, 4)), [2])


def test_token_logprobs_read_the_sampled_token():
    # top-k extras in the dict (vLLM adds the sampled token to the top-k asked for) are ignored
    row = completion([11, 12], [-0.5, -1.25], "stop", extra={99: lp(-0.01)})
    assert token_logprobs(row) == [-0.5, -1.25]
    assert token_logprobs(NS(token_ids=[4], logprobs=[{4: -2.0}])) == [-2.0]  # a bare float is accepted
    with pytest.raises(ValueError, match="no log-probs returned"):
        token_logprobs(NS(token_ids=[4], logprobs=None))
    with pytest.raises(ValueError, match=r"token 0 \(4\) is not among its returned log-probs \[5\]"):
        token_logprobs(NS(token_ids=[4], logprobs=[{5: lp(-1.0)}]))
    with pytest.raises(ValueError, match="1 log-prob entries for 2 tokens"):
        token_logprobs(NS(token_ids=[4, 5], logprobs=[{4: lp(-1.0)}]))


def test_completion_tensors_prompt_major_and_padded():
    # 2 prompts × n = 2: rows in prompt-major order, padded with 0 to the longest (3 tokens)
    outs = [NS(outputs=[completion([1, 2, 3], [-0.1, -0.2, -0.3], "stop"), completion([4], [-1.0], "length")]),
            NS(outputs=[completion([5, 6], [-0.5, -0.6], "stop"), completion([], [], "length")])]
    tokens, policy, lengths, stopped = completion_tensors(outs, pad_id=0)
    assert tokens.tolist() == [[1, 2, 3], [4, 0, 0], [5, 6, 0], [0, 0, 0]]
    assert torch.allclose(policy, torch.tensor([[-0.1, -0.2, -0.3], [-1.0, 0, 0], [-0.5, -0.6, 0], [0, 0, 0]]))
    assert lengths.tolist() == [3, 1, 2, 0] and stopped.tolist() == [True, False, True, False]


def test_sampling_logprobs_by_params():
    policy = torch.tensor([[-0.5, -1.0]])
    assert torch.equal(sampling_logprobs(policy, SamplingParams(temperature=0)), torch.zeros(1, 2))  # greedy: log 1
    assert torch.equal(sampling_logprobs(policy, SamplingParams(temperature=1.0)), policy)  # T = 1, no filter
    assert sampling_logprobs(policy, SamplingParams(temperature=0.7)).isnan().all()  # unknown: NaN, loudly


# ---- the engine against a fake LLM ------------------------------------------------------------------------

class FakeLLM:
    """Records the calls the engine makes; `in_process`: the worker's model is reachable (V1 in-process)."""

    def __init__(self, in_process: bool = True):
        self.calls: list[tuple] = []
        self.loaded: list[list[str]] = []
        model = NS(load_weights=lambda weights: self.loaded.append([k for k, _ in weights]))
        if in_process:
            self.llm_engine = NS(model_executor=NS(driver_worker=NS(worker=NS(model_runner=NS(model=model)))))

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tuple(tags) if tags else None))

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))

    def collective_rpc(self, fn, args=()) -> None:
        self.calls.append(("collective_rpc", fn.__name__))


def fake_engine(llm: FakeLLM, *, sleep_mode: bool = True) -> VLLMEngine:
    engine = VLLMEngine.__new__(VLLMEngine)  # no vllm.LLM: everything else is the real setup
    tok = NS(eos_token_id=2, pad_token_id=0)
    cfg = NS(hidden_size=8)
    engine._setup(tok, NS(config=cfg, generation_config=NS(eos_token_id=2, pad_token_id=0)), "/unused", [2], sleep_mode, 1)
    engine.llm = llm
    return engine


def test_worker_model_found_in_process_else_none():
    assert worker_model(FakeLLM(in_process=True)) is not None
    assert worker_model(FakeLLM(in_process=False)) is None


def test_colocated_sleep_then_sync_wakes_weights_only_then_generate_wakes_the_cache():
    llm = FakeLLM()
    engine = fake_engine(llm)
    assert engine.release_memory() == 0  # no GPU here: the bytes freed are unknown, reported as 0
    assert llm.calls == [("sleep", 1)] and engine.asleep == {"weights", "kv_cache"}
    assert engine.release_memory() == 0 and llm.calls == [("sleep", 1)]  # asleep already: nothing
    n = engine.sync_weights({"w": torch.zeros(3, dtype=torch.float32), "b": torch.zeros(2, dtype=torch.bfloat16)})
    assert n == 3 * 4 + 2 * 2  # bytes pushed: 12 + 4
    # the weights woke (alone) before the load; the cache, still asleep, is reset when it wakes
    assert llm.calls[1:] == [("wake_up", ("weights",))] and llm.loaded == [["w", "b"]]
    engine._wake(("weights", "kv_cache"))  # what generate does first
    assert llm.calls[2:] == [("wake_up", ("kv_cache",)), ("reset_prefix_cache",)] and not engine.asleep


def test_awake_sync_resets_the_cache_at_once_and_multiprocess_uses_collective_rpc():
    llm = FakeLLM(in_process=False)
    engine = fake_engine(llm, sleep_mode=False)
    assert engine.release_memory() == 0 and llm.calls == []  # no sleep mode: release is a no-op
    engine.update_weights({"w": torch.zeros(1)})
    assert llm.calls == [("collective_rpc", "_load_weights_on_worker"), ("reset_prefix_cache",)]


def test_rollout_from_outputs():
    engine = fake_engine(FakeLLM())
    engine.tokenizer = None  # token-id prompts: no text needed
    outs = [NS(outputs=[completion([7, 2], [-0.25, -0.5], "stop"), completion([8, 9, 9], [-1.0, -2.0, -3.0], "length")])]
    ro = engine.rollout([[5, 6]], outs, SamplingParams(n=2, temperature=1.0, max_new_tokens=3))
    assert ro.completion_ids.tolist() == [[7, 2, 0], [8, 9, 9]]
    assert ro.finish_reason == ["stop", "length"]
    # T = 1, no filter: the sampling log-probs are the raw ones; Σ over the first row = −0.75
    assert math.isclose(float(ro.policy_logprobs[0].sum()), -0.75) and torch.equal(ro.logprobs, ro.policy_logprobs)
