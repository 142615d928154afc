"""The vLLM backend (optional extra `posttrain[vllm]`, CUDA GPU only) — NOT YET RUN ON A GPU.

vLLM (Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention") serves the rollout on a GPU, in this process, beside the learner; the learner pushes
its weights into it after each update (the `sync` phase). Written against the vLLM ≥ 0.8 offline API
(`LLM.generate`, `SamplingParams`, `TokensPrompt`, `LLM.sleep(level=…)`, `LLM.wake_up(tags=…)`,
`LLM.collective_rpc`, `LLM.reset_prefix_cache`) as its documentation describes it; the pure parts
(engine and sampling arguments, reading log-probs out of vLLM's outputs, the order of sleep, wake and
weight loads) are unit-tested on CPU with objects of vLLM's documented shape (tests/test_rollout_vllm.py).
The whole path is exercised by `benchmarks/gpu_check.sh` on a lent GPU (docs/gpu.md), which has not
happened yet.

Departures from the other backends (numbered):
1. `policy_logprobs` are vLLM's returned log-probs, which by default (V1 engine, `logprobs_mode=
   "raw_logprobs"`) are the raw model's at T = 1 — the PPO/GRPO ratio's. vLLM returns one kind per
   engine, so `logprobs` (under the sampling distribution) is filled only where it equals them
   (T = 1 and no filter) or is known (0 for greedy); otherwise it is NaN, loudly.
2. vLLM computes in its own kernels (bf16 by default for a fp32 checkpoint's `dtype="auto"`): its
   log-probs differ from the learner's by more than round-off — the sampler/learner mismatch that a
   truncated importance weight corrects (docs/gpu.md measures it per step).
3. Weights are pushed in place (`load_weights` on the worker's model, found in this process when
   `VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here unless the caller set it: no tensor is pickled), else
   through `collective_rpc` to every worker; then the prefix cache is reset (its blocks hold the old
   policy's keys and values).
4. Colocated on one GPU (the learner and vLLM in one process), `release_memory` puts the engine to
   sleep (`enable_sleep_mode=True`, `LLM.sleep(level=1)`: weights offloaded to CPU memory, KV cache
   discarded) so the update has the GPU's memory; `sync_weights` wakes only the weights
   (`wake_up(tags=["weights"])`) to load the new ones, and `generate` wakes the KV cache. Level 1
   copies the old weights back before they are overwritten; `sleep_level=2` skips that copy (and the
   CPU backup) and is what a run that always syncs after waking should use — level 1 is the default
   because it is the one that is safe when a wake is not followed by a sync.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoConfig, PreTrainedTokenizerBase

from posttrain.rollout.native import eos_ids_of, pad_id_of
from posttrain.rollout.output import Rollout, assemble
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.text import StopStrings, encode_prompts, left_pad
from posttrain.telemetry import costs

ENV_IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"
ENV_ARGS = "POSTTRAIN_VLLM_ARGS"  # more vllm.LLM arguments, a JSON object (env_llm_kwargs)
# Where the worker's model lives in an in-process engine, by vLLM version (first match wins)
WORKER_MODEL_PATHS = (
    "llm_engine.model_executor.driver_worker.worker.model_runner.model",  # V1, in-process (≥ 0.8)
    "llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model",  # V1, later layouts
    "llm_engine.model_executor.driver_worker.model_runner.model",  # V0
)
SLEEP_TAGS = ("weights", "kv_cache")


# ---- pure pieces: arguments in, arguments out -----------------------------------------------------------

def llm_kwargs(path: str, *, tokenizer: bool, dtype: str, gpu_memory_utilization: float, enable_prefix_caching: bool,
               sleep_mode: bool, seed: int | None, **extra: Any) -> dict[str, Any]:
    """The `vllm.LLM(...)` arguments. `tokenizer`: the folder holds one (else vLLM's default from the
    model's own files). `sleep_mode` turns on vLLM's sleep mode (departure 4)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"vllm backend: gpu_memory_utilization={gpu_memory_utilization}; expected a fraction in (0, 1]")
    out: dict[str, Any] = {"model": path, "dtype": dtype, "gpu_memory_utilization": gpu_memory_utilization,
                           "enable_prefix_caching": enable_prefix_caching}
    if tokenizer:
        out["tokenizer"] = path
    if sleep_mode:
        out["enable_sleep_mode"] = True
    if seed is not None:
        out["seed"] = seed
    out.update(extra)
    return out


def env_llm_kwargs() -> dict[str, Any]:
    """More `vllm.LLM` arguments from `POSTTRAIN_VLLM_ARGS`, a JSON object — how a recipe's run passes e.g.
    `{"enforce_eager": true, "max_model_len": 1024, "gpu_memory_utilization": 0.3}` (a stage builds its
    engine with no backend options)."""
    raw = os.environ.get(ENV_ARGS, "").strip()
    if not raw:
        return {}
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{ENV_ARGS}={raw!r}: not JSON ({e.msg}); expected an object of vllm.LLM arguments") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{ENV_ARGS}={raw!r}: expected a JSON object of vllm.LLM arguments")
    return obj


def sampling_kwargs(params: SamplingParams, eos_ids: Sequence[int]) -> dict[str, Any]:
    """The `vllm.SamplingParams(...)` arguments for one of our `SamplingParams`. `logprobs=0`: the
    sampled token's log-prob alone, per token (vLLM adds the sampled token to the top-k it is asked for)."""
    if params.shard is not None:
        raise ValueError("the vllm backend cannot sample a shard of a batch (SamplingParams.shard); use the native backend")
    return {"n": params.n, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1, "min_p": params.min_p,
            "max_tokens": params.max_new_tokens, "stop": list(params.stop) or None,
            "include_stop_str_in_output": True, "stop_token_ids": list(eos_ids), "seed": params.seed,
            "logprobs": 0, "skip_special_tokens": True}


def _logprob_value(entry: Any) -> float:
    return float(entry.logprob if hasattr(entry, "logprob") else entry)


def token_logprobs(row: Any, where: str = "vLLM output") -> list[float]:
    """The sampled tokens' log-probs of one `CompletionOutput`: `row.logprobs[t]` maps token id → `Logprob`
    (an object with `.logprob`; a bare float is accepted) and must hold the token sampled at t."""
    toks = list(row.token_ids)
    if row.logprobs is None:
        raise ValueError(f"{where}: no log-probs returned; the request must ask for them (SamplingParams(logprobs=0))")
    if len(row.logprobs) < len(toks):
        raise ValueError(f"{where}: {len(row.logprobs)} log-prob entries for {len(toks)} tokens")
    out = []
    for t, tok in enumerate(toks):
        entry = row.logprobs[t]
        if tok not in entry:
            raise ValueError(f"{where}: token {t} ({tok}) is not among its returned log-probs {sorted(entry)}")
        out.append(_logprob_value(entry[tok]))
    return out


def completion_tensors(outs: Sequence[Any], pad_id: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """vLLM's `RequestOutput`s (one per prompt, `.outputs` its n completions) → our buffers, prompt-major:
    tokens (R, N) long, policy log-probs (R, N) float32, lengths (R,), stopped (R,) bool, R = prompts × n.
    `stopped`: finish_reason "stop" (EOS, a stop token or string) — "length" is the budget running out."""
    rows = [c for o in outs for c in o.outputs]
    width = max((len(c.token_ids) for c in rows), default=0)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    policy = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, c in enumerate(rows):
        toks = list(c.token_ids)
        if toks:
            tokens[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            policy[i, : len(toks)] = torch.tensor(token_logprobs(c, where=f"vLLM output row {i}"))
    lengths = torch.tensor([len(c.token_ids) for c in rows], dtype=torch.long)
    stopped = torch.tensor([c.finish_reason == "stop" for c in rows], dtype=torch.bool)
    return tokens, policy, lengths, stopped


def sampling_logprobs(policy: Tensor, params: SamplingParams) -> Tensor:
    """`logprobs` (under the sampling distribution) from vLLM's raw ones (departure 1)."""
    if params.greedy:
        return torch.zeros_like(policy)
    if params.is_identity:
        return policy.clone()
    return torch.full_like(policy, float("nan"))


def worker_model(llm: Any) -> Any | None:
    """The model of an in-process engine's worker (`WORKER_MODEL_PATHS`), or None (a multiprocess engine)."""
    for path in WORKER_MODEL_PATHS:
        obj = llm
        for name in path.split("."):
            obj = getattr(obj, name, None)
            if obj is None:
                break
        if obj is not None and hasattr(obj, "load_weights"):
            return obj
    return None


def _load_weights_on_worker(worker: Any, weights: list[tuple[str, Tensor]]) -> None:
    """Runs inside a vLLM worker (via `collective_rpc`): load HF-named weights into its model."""
    worker.model_runner.model.load_weights(weights=weights)


# ---- the engine -----------------------------------------------------------------------------------------

class VLLMEngine:
    """`vllm.LLM` behind the rollout interface. `model` is an HF folder or an in-memory HF model."""

    name = "vllm"

    def __init__(self, model: nn.Module | str | Path, tokenizer: PreTrainedTokenizerBase | None = None, *,
                 gpu_memory_utilization: float | None = None, dtype: str = "auto", enable_prefix_caching: bool = True,
                 eos_token_ids: Sequence[int] | None = None, sleep_mode: bool = True, sleep_level: int = 1,
                 seed: int | None = None, **llm_kwargs_extra: Any):
        try:
            import vllm
        except ImportError as e:
            raise ImportError("the vLLM backend needs a CUDA GPU and `pip install 'posttrain[vllm]'`") from e
        if not torch.cuda.is_available():
            raise RuntimeError("the vLLM backend needs a CUDA GPU; use make_engine('native', ...) on CPU")
        if sleep_level not in (1, 2):
            raise ValueError(f"vllm backend: sleep_level={sleep_level}; expected 1 or 2 (vLLM's sleep levels)")
        os.environ.setdefault(ENV_IN_PROCESS, "0")
        self._tmp: tempfile.TemporaryDirectory | None = None
        if isinstance(model, nn.Module):
            # vLLM loads from a folder: write the current weights once; later updates go through update_weights.
            self._tmp = tempfile.TemporaryDirectory(prefix="posttrain-vllm-")
            model.save_pretrained(self._tmp.name, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(self._tmp.name)
            path, source = self._tmp.name, model
        else:
            path, source = str(model), None
        self._setup(tokenizer, source, path, eos_token_ids, sleep_mode, sleep_level)
        extra = {**env_llm_kwargs(), **llm_kwargs_extra}  # the caller's arguments over the environment's
        gpu_memory_utilization = float(extra.pop("gpu_memory_utilization", gpu_memory_utilization or 0.5))
        self.llm = vllm.LLM(**llm_kwargs(path, tokenizer=tokenizer is not None or source is None, dtype=dtype,
                                         gpu_memory_utilization=gpu_memory_utilization,
                                         enable_prefix_caching=enable_prefix_caching, sleep_mode=sleep_mode,
                                         seed=seed, **extra))

    def _setup(self, tokenizer: PreTrainedTokenizerBase | None, source: nn.Module | None, path: str,
               eos_token_ids: Sequence[int] | None, sleep_mode: bool, sleep_level: int) -> None:
        """Everything but the `vllm.LLM` (split out so the sleep/sync logic is testable with a fake LLM)."""
        self.tokenizer = tokenizer
        self.config = source.config if source is not None else AutoConfig.from_pretrained(path)  # for decode_cost
        self.eos_ids = list(eos_token_ids) if eos_token_ids is not None else (
            eos_ids_of(source, tokenizer) if source is not None else [int(tokenizer.eos_token_id)])
        self.pad_id = pad_id_of(source, tokenizer, self.eos_ids) if source is not None else int(
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0])
        self.sleep_mode, self.sleep_level = sleep_mode, sleep_level
        self.asleep: set[str] = set()    # the tags vLLM holds offloaded/discarded now
        self._stale_cache = False         # weights changed while the KV cache slept: reset it on waking

    # ---- memory: sleep and wake (departure 4) -----------------------------------------------------------
    def release_memory(self) -> int:
        """Colocated: put the engine to sleep before the update (weights to CPU, KV cache dropped); the
        GPU bytes freed (0 without sleep mode, or asleep already)."""
        if not self.sleep_mode or self.asleep:
            return 0
        before = _free_gpu_bytes()
        self.llm.sleep(level=self.sleep_level)
        self.asleep = set(SLEEP_TAGS)
        after = _free_gpu_bytes()
        return max(0, after - before) if before is not None and after is not None else 0

    def _wake(self, tags: Sequence[str]) -> None:
        todo = [t for t in tags if t in self.asleep]
        if not todo:
            return
        try:
            self.llm.wake_up(tags=todo)
        except TypeError:  # a vLLM without tagged wake-up: everything at once
            self.llm.wake_up()
            todo = list(self.asleep)
        self.asleep -= set(todo)
        if "kv_cache" in todo and self._stale_cache:
            self.llm.reset_prefix_cache()
            self._stale_cache = False

    # ---- weights (departure 3) -----------------------------------------------------------------------------
    def update_weights(self, model_or_state_dict: nn.Module | dict[str, Tensor]) -> None:
        """Push the learner's weights into the vLLM engine, then drop its now-stale prefix cache."""
        sd = model_or_state_dict if isinstance(model_or_state_dict, dict) else model_or_state_dict.state_dict()
        weights = [(k, v.detach()) for k, v in sd.items()]
        self._wake(["weights"])  # a sleeping engine's weight memory is unmapped: wake it (only it) first
        target = worker_model(self.llm)
        if target is not None:  # in-process worker: load straight from the learner's tensors
            target.load_weights(weights=weights)
        else:  # multiprocess engine: ship the weights to every worker
            self.llm.collective_rpc(_load_weights_on_worker, args=(weights,))
        if "kv_cache" in self.asleep:
            self._stale_cache = True
        else:
            self.llm.reset_prefix_cache()

    def sync_weights(self, model_or_state_dict: nn.Module | dict[str, Tensor]) -> int:
        """`update_weights` (already eager); the bytes of the weights pushed."""
        sd = model_or_state_dict if isinstance(model_or_state_dict, dict) else model_or_state_dict.state_dict()
        self.update_weights(sd)
        return sum(t.nbytes for t in sd.values())

    def decode_cost(self, *, batch: int, prompt_len: int, new_tokens: int, samples: int = 1) -> costs.Cost:
        """FLOPs and bytes of one generation on this engine's model (`telemetry.costs.decode`): a prompt's n
        samples share its prefill (their prompt blocks are one), and each reads those blocks in its own
        attention (`shared_reads=False`)."""
        return costs.decode(self.config, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, samples=samples,
                            shared_reads=False)

    # ---- generation ------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]] | Sequence[str], params: SamplingParams) -> Rollout:
        import vllm
        from vllm.inputs import TokensPrompt

        sp = vllm.SamplingParams(**sampling_kwargs(params, self.eos_ids))
        self._wake(SLEEP_TAGS)
        ids = encode_prompts(prompts, self.tokenizer)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], sp, use_tqdm=False)
        return self.rollout(ids, outs, params)

    def rollout(self, ids: list[list[int]], outs: Sequence[Any], params: SamplingParams) -> Rollout:
        """Our `Rollout` from vLLM's outputs for the token-id prompts `ids`."""
        tokens, policy, lengths, stopped = completion_tensors(outs, self.pad_id)
        prompt_ids, prompt_mask = left_pad(ids, self.pad_id)
        return assemble(prompt_ids=prompt_ids, prompt_mask=prompt_mask, n=params.n, tokens=tokens,
                        logprobs=sampling_logprobs(policy, params), policy_logprobs=policy, lengths=lengths,
                        stopped=stopped, pad_id=self.pad_id, tokenizer=self.tokenizer,
                        stops=StopStrings(params.stop, self.tokenizer))


def _free_gpu_bytes() -> int | None:
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info()[0])  # a device sync point
