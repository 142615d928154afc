"""The vLLM backend (optional extra `posttrain[vllm]`, CUDA GPU only) — NOT TESTED ON THIS PROJECT'S CI.

vLLM (Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention") serves the rollout on a GPU; the learner pushes its weights into it after each update.
This module cannot run on a CPU-only machine and has not been executed here: it is written against the
vLLM ≥ 0.8 offline API (`LLM.generate`, `SamplingParams`, `TokensPrompt`, `LLM.collective_rpc`,
`LLM.reset_prefix_cache`) to be checked when a GPU is available — see docs/rollout.md, "Checking the
vLLM backend on a GPU", for the script.

Departures from the other backends (numbered):
1. `policy_logprobs` are vLLM's returned log-probs, which by default (V1 engine, `logprobs_mode=
   "raw_logprobs"`) are the raw model's at T = 1 — the PPO/GRPO ratio's. vLLM returns one kind per
   engine, so `logprobs` (under the sampling distribution) is filled only where it equals them
   (T = 1 and no filter) or is known (0 for greedy); otherwise it is NaN, loudly.
2. vLLM computes in its own kernels (bf16 by default): its log-probs differ from a teacher-forced fp32
   forward by the bf16 rounding, not by ≤ 1e-4. Recompute `policy_logprobs` with the learner when the
   ratio must be exact at step 0.
3. Weights are pushed in place (`load_weights` on the worker's model) and the prefix cache is reset;
   with `VLLM_ENABLE_V1_MULTIPROCESSING=0` (set here unless the caller set it) the worker lives in
   this process and no tensor is pickled.
"""

from __future__ import annotations

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


def _load_weights_on_worker(worker: Any, weights: list[tuple[str, Tensor]]) -> None:
    """Runs inside a vLLM worker (via `collective_rpc`): load HF-named weights into its model."""
    worker.model_runner.model.load_weights(weights=weights)


class VLLMEngine:
    """`vllm.LLM` behind the rollout interface. `model` is an HF folder or an in-memory HF model."""

    name = "vllm"

    def __init__(self, model: nn.Module | str | Path, tokenizer: PreTrainedTokenizerBase | None = None, *,
                 gpu_memory_utilization: float = 0.5, dtype: str = "auto", enable_prefix_caching: bool = True,
                 eos_token_ids: Sequence[int] | None = None, **llm_kwargs: Any):
        try:
            import vllm
        except ImportError as e:
            raise ImportError("the vLLM backend needs a CUDA GPU and `pip install 'posttrain[vllm]'`") from e
        if not torch.cuda.is_available():
            raise RuntimeError("the vLLM backend needs a CUDA GPU; use make_engine('native', ...) on CPU")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
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
        self.tokenizer = tokenizer
        self.config = source.config if source is not None else AutoConfig.from_pretrained(path)  # for decode_cost
        self.eos_ids = list(eos_token_ids) if eos_token_ids is not None else (
            eos_ids_of(source, tokenizer) if source is not None else [int(tokenizer.eos_token_id)])
        self.pad_id = pad_id_of(source, tokenizer, self.eos_ids) if source is not None else int(
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0])
        self.llm = vllm.LLM(model=path, tokenizer=path if tokenizer is not None or source is None else None,
                            dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                            enable_prefix_caching=enable_prefix_caching, **llm_kwargs)

    def update_weights(self, model_or_state_dict: nn.Module | dict[str, Tensor]) -> None:
        """Push the learner's weights into the vLLM engine, then drop its now-stale prefix cache."""
        sd = model_or_state_dict if isinstance(model_or_state_dict, dict) else model_or_state_dict.state_dict()
        weights = [(k, v.detach()) for k, v in sd.items()]
        try:  # in-process worker (VLLM_ENABLE_V1_MULTIPROCESSING=0): no pickling
            runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
            runner.model.load_weights(weights=weights)
        except AttributeError:  # multiprocess engine: ship the weights to every worker
            self.llm.collective_rpc(_load_weights_on_worker, args=(weights,))
        self.llm.reset_prefix_cache()

    def decode_cost(self, *, batch: int, prompt_len: int, new_tokens: int) -> costs.Cost:
        """FLOPs and bytes of one generation on this engine's model (`telemetry.costs.decode`)."""
        return costs.decode(self.config, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens)
    def release_memory(self) -> int:
        """0: the engine's memory lives on the GPU in vLLM's own pool. Colocated on one GPU, vLLM's sleep
        mode (`LLM.sleep`) is what would free it; not wired (docs/distributed.md)."""
        return 0

    def sync_weights(self, model_or_state_dict: nn.Module | dict[str, Tensor]) -> int:
        """`update_weights` (already eager); the bytes of the weights pushed."""
        sd = model_or_state_dict if isinstance(model_or_state_dict, dict) else model_or_state_dict.state_dict()
        self.update_weights(sd)
        return sum(t.nbytes for t in sd.values())

    def _sampling_params(self, params: SamplingParams) -> Any:
        import vllm

        return vllm.SamplingParams(
            n=params.n, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1, min_p=params.min_p,
            max_tokens=params.max_new_tokens, stop=list(params.stop) or None, include_stop_str_in_output=True,
            stop_token_ids=self.eos_ids, seed=params.seed, logprobs=0, skip_special_tokens=True)

    def generate(self, prompts: Sequence[Sequence[int]] | Sequence[str], params: SamplingParams) -> Rollout:
        from vllm.inputs import TokensPrompt

        if params.shard is not None:
            raise ValueError("the vllm backend cannot sample a shard of a batch (SamplingParams.shard); use the native backend")
        ids = encode_prompts(prompts, self.tokenizer)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], self._sampling_params(params),
                                 use_tqdm=False)
        rows = [c for o in outs for c in o.outputs]                       # prompt-major, n per prompt
        width = max(len(c.token_ids) for c in rows)
        tokens = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        policy = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, c in enumerate(rows):
            toks = list(c.token_ids)
            tokens[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            policy[i, : len(toks)] = torch.tensor([c.logprobs[t][tok].logprob for t, tok in enumerate(toks)])
        if params.greedy:
            logprobs = torch.zeros_like(policy)
        elif params.is_identity:
            logprobs = policy.clone()
        else:
            logprobs = torch.full_like(policy, float("nan"))  # departure 1: vLLM returns one kind of log-prob
        prompt_ids, prompt_mask = left_pad(ids, self.pad_id)
        return assemble(prompt_ids=prompt_ids, prompt_mask=prompt_mask, n=params.n, tokens=tokens, logprobs=logprobs,
                        policy_logprobs=policy, lengths=torch.tensor([len(c.token_ids) for c in rows]),
                        stopped=torch.tensor([c.finish_reason == "stop" for c in rows]), pad_id=self.pad_id,
                        tokenizer=self.tokenizer, stops=StopStrings(params.stop, self.tokenizer))
