"""The native rollout backend: our own batched decode loop with a pre-allocated KV cache.

Autoregressive sampling as in Radford et al. 2019 (GPT-2), with the KV cache of Pope et al. 2022
("Efficiently Scaling Transformer Inference", §2): prefill the prompt once, then one forward per new
token attending to the cached keys/values.

Departures from `transformers` `generate` (numbered):
1. Prefill runs once per *prompt*, not for n identical copies. Where the C decode attention runs, the n
   samples of the prompt then read its keys and values from that one cache (`share_prompts`;
   `cpu/fused.py` departure 12); elsewhere it is copied to each of them (`KVCache.expand`).
2. The cache is allocated once for max_new_tokens (and the prompt, where it is copied) and written in
   place (no per-step concatenation); all rows share one write slot because prompts are left-padded.
3. Finished rows stop costing work: once at most `compact_below` of the running rows are still
   live, the batch (cache, masks, positions) is compacted to the live rows.
4. Sampling is one pure function on fp32 logits (`sampling.sample`; its buffer-writing twin
   `sample_into` on the hot path), no logits-processor objects. It draws by inversion, one uniform per
   row per step, drawn for all rows of all steps up front (`shard_uniforms`), so compaction never
   changes a sample.
5. Llama-family models run through `FusedDecoder` (fused weight copies in their fastest decode form, complex
   RoPE, fp32 attention over the cache, one pre-allocated `DecodePlan` per batch shape; see
   `fused.py`); any other HF causal LM runs its own forward (`HFForward`) on the same cache.
6. Outputs are written step-major, (steps, rows), so each step's tokens and log-probs are one
   contiguous row the sampler writes into; lengths come from the step each row stopped at.
7. A bounded prefix cache (`prefix_cache.py`): `generate(..., keep=)` keeps rows' keys and values after
   the call, and a later prompt that extends a kept sequence starts from them and prefills only its
   new tokens. The prefill cache is then laid out as [kept prefixes, left-padded to the longest]
   [new tokens, left-padded to the longest] — a hole of masked slots between a row's two parts; the
   positions and the key mask say where each token is, so RoPE and attention see the same sequence
   a full prefill would. Rows of one call may mix hits and misses (a miss is a row with no prefix).
Device sync points: one per step (the live-row count decides whether to stop or compact; the EOS
and stop-string checks read the sampled tokens). Stop strings cost one batched decode of a few tokens
per live row per step, only when stop strings are given.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from posttrain.models import lora
from posttrain.rollout.cpu import FusedDecoder, fused_unsupported_reason
from posttrain.rollout.kv_cache import KVCache
from posttrain.rollout.output import Rollout, assemble
from posttrain.rollout.prefix_cache import PrefixCache, PrefixEntry
from posttrain.rollout.sampling import SamplingParams, sample, sample_into, shard_uniforms
from posttrain.rollout.text import (
    StopStrings,
    encode_prompts,
    left_pad,
    positions_from_mask,
)
from posttrain.telemetry import costs


def eos_ids_of(model: nn.Module, tokenizer: PreTrainedTokenizerBase | None) -> list[int]:
    """Token ids that end a sequence: the tokenizer's EOS and the model's generation-config EOS(s)."""
    ids: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_cfg = getattr(model, "generation_config", None)
    eos = getattr(gen_cfg, "eos_token_id", None)
    if eos is None:
        eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    ids.update([eos] if isinstance(eos, int) else list(eos or []))
    return sorted(ids)


def pad_id_of(model: nn.Module, tokenizer: PreTrainedTokenizerBase | None, eos_ids: list[int]) -> int:
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    if pad is not None:
        return int(pad)
    if eos_ids:
        return eos_ids[0]
    raise ValueError("no pad token: the tokenizer and the model config have neither a pad nor an EOS id")


class HFForward:
    """The naive step: the model's own forward on our cache (works for any HF causal LM, 5.x API)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.cache_dtype = next(model.parameters()).dtype

    def __call__(self, ids: Tensor, positions: Tensor, cache: KVCache, key_mask: Tensor,
                 decode_rows: int | None = None) -> Tensor:
        """Shapes: ids/positions (R, q); key_mask (R, ≥ cache.length + q) bool → logits (R, V) fp32.
        `decode_rows` (the fused step's matmul-form hint) has no use here."""
        out = self.model(input_ids=ids, attention_mask=key_mask[:, : cache.length + ids.shape[1]],
                         position_ids=positions, cache=cache.hf(), use_cache=True, logits_to_keep=1)
        cache.advance(ids.shape[1])
        return out.logits[:, -1].float()

    def plan(self, cache: KVCache, key_mask: Tensor) -> Callable[[Tensor, Tensor], Tensor]:
        """One new token per row: `step(tokens (R,), positions (R,))` → logits (R, V) (same as `FusedDecoder.plan`)."""
        return lambda tokens, positions: self(tokens[:, None], positions[:, None], cache, key_mask)


class NativeEngine:
    """Batched sampling over an HF causal LM. Shares the module: weight updates are seen at once.

    kernels: "auto" (fused for Llama-family, else HF forward), "fused", or "hf".
    dtype: weight dtype for generation (fused kernels only), e.g. torch.bfloat16 for a fp32 policy;
        None = the model's own. Log-probs are then those of the cast model.
    compact_below: compact the batch when live rows ≤ this fraction of running rows (1.0 = as soon as
        one row finishes, 0.0 = never).
    matmul: form of the fused path's decode matmuls: "auto" (`tuning.tuned_kind`: on a CPU, the form
        measured fastest on this machine — once per machine, then cached; else
        `projections.projection_kind`), or one of "mm", "mkl", "dnn", "mv", "c", "amx".
    compute: the dtype the fused path multiplies in: "auto" (`projections.compute_dtype`: fp32 for small
        bf16/fp16 weights on a CPU, holding their rounded values exactly; else the weight dtype) or a dtype.
    decode_ops: the fused decode step's work between its matmuls (norms, RoPE, attention, SwiGLU):
        "auto" (on a CPU, the C kernels of `ckernels.py`, built on first use with the machine's compiler,
        where they build; else PyTorch ops), "c" (the kernels or an error), "c-generic" (their plain-C
        loops, for tests) or "torch".
    Memory: the fused path keeps its own copy of the weights (fused, norm-folded; fp32 weights with nothing
    to fold are shared with the model), the decode form of each (a transposed copy for "mm", a packed
    one for "mkl"/"dnn"/"c"/"amx"; "mv" uses the copy itself) and a KV cache in fp32, or in bf16 where the step
    computes in bf16 and the C attention reads it (`FusedDecoder.cache_dtype`, set by `prepare`).
    prefix_cache_bytes: the most bytes of keys/values kept between calls for callers that ask
        (`generate(keep=)`, departure 7; 0 = keep nothing). A kept row of C tokens costs
        2·layers·kv_heads·head_dim·C·(4 or 2) bytes: tiny-30m (10 layers, 4 kv heads × 64), fp32, is
        20,480 bytes a token, 6.1 MB for 300 tokens; the default cap holds 43 such rows.
    share_prompts: where the C attention runs, the n samples of a prompt read its keys and values from
        the prefill's one copy (`cpu/fused.py` departure 12; the KV cache holds B·P + R·N positions, not
        R·(P + N)); False copies them into every sample's row, as the other paths do (an A/B setting).
    """

    name = "native"

    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase | None = None, *,
                 kernels: str = "auto", dtype: torch.dtype | None = None, compact_below: float = 0.875,
                 eos_token_ids: Sequence[int] | None = None, matmul: str = "auto", compute: torch.dtype | str = "auto",
                 decode_ops: str = "auto", prefix_cache_bytes: int = 256 * 2**20, share_prompts: bool = True):
        if kernels not in ("auto", "fused", "hf"):
            raise ValueError(f"NativeEngine: kernels={kernels!r}; expected 'auto', 'fused' or 'hf'")
        if not 0.0 <= compact_below <= 1.0:
            raise ValueError(f"NativeEngine: compact_below={compact_below}; expected a fraction in [0, 1]")
        self.model, self.tokenizer = model, tokenizer
        reason = fused_unsupported_reason(model)
        if kernels == "fused" and reason is not None:
            raise ValueError(f"NativeEngine: kernels='fused' but {reason}")
        use_fused = kernels == "fused" or (kernels == "auto" and reason is None)
        model_dtype = next(model.parameters()).dtype
        if not use_fused and dtype is not None and dtype != model_dtype:
            raise ValueError(f"NativeEngine: dtype={dtype} differs from the model's {model_dtype}, which needs "
                             f"the fused kernels ({reason or 'kernels=hf was asked for'}); cast the model instead")
        self.kernels = "fused" if use_fused else "hf"
        self.step = FusedDecoder(model, dtype, matmul=matmul, compute=compute, decode_ops=decode_ops) if use_fused else HFForward(model)
        self.dtype = dtype or model_dtype
        self.compact_below, self.share_prompts = compact_below, share_prompts
        self.eos_ids = list(eos_token_ids) if eos_token_ids is not None else eos_ids_of(model, tokenizer)
        self.pad_id = pad_id_of(model, tokenizer, self.eos_ids)
        cfg = model.config
        self.layers = cfg.num_hidden_layers
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._kv_bytes = 0
        self.prefix_cache = PrefixCache(prefix_cache_bytes)

    def update_weights(self, model_or_state_dict: nn.Module | dict[str, Tensor]) -> None:
        """Make the next `generate` sample from these weights. The engine shares the training module, so
        passing that module copies nothing; a state dict (or another module) is loaded into it. Either
        way the fused copies are rebuilt at the next `generate`: call this after every optimizer step,
        because fused optimizers (`AdamW(fused=True)`) write parameters without bumping the version
        counters the fused copies otherwise watch."""
        if isinstance(model_or_state_dict, dict):
            self.model.load_state_dict(model_or_state_dict)
        elif model_or_state_dict is not self.model:
            self.model.load_state_dict(model_or_state_dict.state_dict())
        if isinstance(self.step, FusedDecoder):
            self.step.weights.invalidate()
        self.prefix_cache.clear()  # kept keys/values were computed by the old weights

    def decode_cost(self, *, batch: int, prompt_len: int, new_tokens: int, samples: int = 1) -> costs.Cost:
        """FLOPs and bytes of one generation on this engine's model (`telemetry.costs.decode`): each prompt
        prefilled once (departure 1), its keys and values read once a step for its samples where they share
        its cache (`share_prompts` with the C attention)."""
        device = next(self.model.parameters()).device
        shared = self.share_prompts and isinstance(self.step, FusedDecoder) and self.step.gathers_rows(device)
        return costs.decode(self.model.config, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                            samples=samples, shared_reads=shared)

    def sync_weights(self, model_or_state_dict: nn.Module | dict[str, Tensor]) -> int:
        """`update_weights`, then rebuild the fused copies (and the decode forms the last generate used)
        now instead of lazily inside the next `generate`, so the stage can time the move as its `sync`
        phase. Returns the bytes moved: a loaded state dict's bytes, plus what the rebuild read and wrote."""
        moved = 0
        if isinstance(model_or_state_dict, dict):
            moved += sum(t.nbytes for t in model_or_state_dict.values())
        elif model_or_state_dict is not self.model:
            moved += sum(t.nbytes for t in model_or_state_dict.state_dict().values())
        self.update_weights(model_or_state_dict)
        if isinstance(self.step, FusedDecoder):
            with torch.inference_mode():  # the copies were made inside generate's inference mode: rebuild them there
                rebuilt = self.step.weights.rebuild()  # 0 when never built
                if self.step.weights.layers:
                    moved += rebuilt
                else:  # the first move: build the copies (the decode forms follow at the first generate)
                    self.step.prepare(1, next(self.model.parameters()).device)
                    moved += self.step.weights.moved_bytes
        return moved

    def release_memory(self) -> int:
        """Free the fused weight copies and decode forms before the update (`RolloutEngine.release_memory`);
        the next `sync_weights` rebuilds them. Returns the bytes freed (0 on the HF-forward path).

        The pages go back to the allocator, not to the OS: the update's activations are allocated into
        them. Handing them to the OS as well (glibc's `malloc_trim`) hands back the update's own freed
        pages too, which every update then faults in again — tiny-30m GRPO at 32 tokens, bf16, 1 thread:
        68,000 faults and ~0.1 s a step (update 0.71–0.77 s against 0.59–0.67), for a process peak only
        40–60 MiB lower (19 MiB at 512 tokens, 90 at SmolLM2-135M; docs/performance.md)."""
        freed = self.step.weights.release() if isinstance(self.step, FusedDecoder) else 0
        freed += self.prefix_cache.bytes
        self.prefix_cache.clear()  # kept rows are stale once the update changes the weights anyway
        return freed

    def memory_bytes(self) -> dict[str, int]:
        """What this engine holds beside the model: fused weight copies and the last KV cache (bytes)."""
        out = {"KV cache": self._kv_bytes, "prefix cache": self.prefix_cache.bytes}
        if isinstance(self.step, FusedDecoder):
            out["fused weights"] = self.step.weights.resident_bytes()
        return out

    def _cache(self, rows: int, capacity: int, device: torch.device) -> KVCache:
        self._kv_bytes = (2 * self.layers * rows * self.kv_heads * capacity * self.head_dim
                          * self.step.cache_dtype.itemsize)  # keys and values
        return KVCache.allocate(layers=self.layers, rows=rows, kv_heads=self.kv_heads, capacity=capacity,
                                head_dim=self.head_dim, dtype=self.step.cache_dtype, device=device)

    def release(self, keys: Sequence[Hashable]) -> None:
        """Drop the kept rows of `keys` (`generate(keep=)`); unknown keys are ignored."""
        self.prefix_cache.release(keys)

    def _weights_stamp(self) -> tuple:
        # each parameter's storage and in-place version (an optimizer step moves it), which adapters act, and
        # the cache dtype: what the kept keys/values were computed under (a fused AdamW step moves no version:
        # `update_weights`, called after every step, clears the cache for that)
        return (tuple((p.data_ptr(), p._version) for p in self.model.parameters()), lora.adapter_state(self.model),
                self.step.cache_dtype)

    def generate(self, prompts: Sequence[Sequence[int]] | Sequence[str], params: SamplingParams, *,
                 keep: Sequence[Hashable | None] | None = None) -> Rollout:
        """`keep`: one key or None per row (R = prompts × n): row j's keys/values (its prompt and all of its
        completion but the last token, which was never fed) are kept under `keep[j]` for later calls whose
        prompt extends them (departure 7); `release` them when done."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"generate: params must be a SamplingParams, got {type(params).__name__}")
        device = next(self.model.parameters()).device
        ids = encode_prompts(prompts, self.tokenizer)
        if keep is not None and len(keep) != len(ids) * params.n:
            raise ValueError(f"generate: keep has {len(keep)} keys; expected one per row "
                             f"({len(ids)} prompts × n={params.n} = {len(ids) * params.n})")
        was_training = self.model.training
        self.model.eval()  # dropout off; restored below
        try:
            with torch.inference_mode():
                raw = self._decode(ids, params, device, keep)
        finally:
            self.model.train(was_training)
        # Outside inference mode: the Rollout's tensors are ordinary tensors a training step may use.
        return assemble(**raw, pad_id=self.pad_id, tokenizer=self.tokenizer,
                        stops=StopStrings(params.stop, self.tokenizer))

    def _prefill(self, ids: list[list[int]], prompt_ids: Tensor, prompt_mask: Tensor, n: int, budget: int,
                 keep: Sequence[Hashable | None] | None, device: torch.device) -> tuple[KVCache, Tensor, Tensor]:
        """Prefill once per prompt, from a kept prefix where one extends it (departure 7). With n = 1 the
        prefill cache is the decode cache (no copy). Returns the cache, the last prompt token's logits (B, V)
        and the prompt's key mask (B, W): True on the slots holding a prompt token (W ≥ P: the hole)."""
        batch, rows = len(ids), len(ids) * n
        hits = [None] * batch
        if self.prefix_cache.entries:
            hits = [self.prefix_cache.lookup(p, None if keep is None else keep[i * n]) for i, p in enumerate(ids)]
        if not any(hits):
            width = prompt_ids.shape[1]
            cache = self._cache(batch, width + budget if n == 1 else width, device)
            logits = self.step(prompt_ids, positions_from_mask(prompt_mask), cache, prompt_mask, decode_rows=rows)
            return cache, logits, prompt_mask
        kept = [0 if h is None else len(h.ids) for h in hits]                   # C_i
        head = max(kept)                                                       # P0: the kept prefixes, left-padded
        new_ids, new_mask = left_pad([p[c:] for p, c in zip(ids, kept)], self.pad_id, device)  # (B, S)
        width = head + new_ids.shape[1]
        cache = self._cache(batch, width + budget if n == 1 else width, device)
        head_mask = torch.zeros(batch, head, dtype=torch.bool, device=device)
        for layer in range(self.layers):
            for buf in (cache.keys[layer], cache.values[layer]):
                buf[:, :, :head].zero_()                  # the hole: masked, but 0·garbage (a NaN) would leak
        for i, h in enumerate(hits):
            if h is not None:
                c = kept[i]
                head_mask[i, head - c:] = True
                for layer in range(self.layers):                               # one copy of the kept row
                    cache.keys[layer][i, :, head - c: head] = h.keys[layer]
                    cache.values[layer][i, :, head - c: head] = h.values[layer]
        cache.advance(head)
        key_mask = torch.cat([head_mask, new_mask], 1)                         # (B, W)
        positions = positions_from_mask(key_mask)[:, head:]                    # the new tokens' true positions
        logits = self.step(new_ids, positions, cache, key_mask, decode_rows=rows)
        return cache, logits, key_mask

    def _keep(self, key: Hashable, cache: KVCache, row: int, prompt: list[int], key_mask: Tensor,
              completion: list[int], prefix: KVCache | None = None, prefix_row: int = 0) -> None:
        """Copy one finished row's keys/values out of `cache` into the prefix cache: the prompt's slots
        (`key_mask` (W,) True) and the first len(completion) decode slots (its tokens but the last). With
        `prefix` (departure 12 of `cpu/fused.py`), the prompt's slots are row `prefix_row` of it and the
        decode slots start `cache`'s row."""
        width = key_mask.shape[0]
        prompt_slots = key_mask.nonzero()[:, 0]
        own = torch.arange(len(completion), device=key_mask.device) + (0 if prefix is not None else width)
        c = prompt_slots.numel() + own.numel()
        per = 2 * self.layers * self.kv_heads * c * self.head_dim * self.step.cache_dtype.itemsize
        if not self.prefix_cache.fits(per):                                    # never copy what cannot be kept
            self.prefix_cache.refuse(key)
            return
        held, at = (cache, row) if prefix is None else (prefix, prefix_row)   # where the prompt's slots are

        def rows_of(prompt_bufs: list[Tensor], own_bufs: list[Tensor]) -> list[Tensor]:  # (kv_heads, C, head_dim) each
            return [torch.cat([p[at].index_select(1, prompt_slots), b[row].index_select(1, own)], 1)
                    for p, b in zip(prompt_bufs, own_bufs)]

        keys, values = rows_of(held.keys, cache.keys), rows_of(held.values, cache.values)
        self.prefix_cache.store(key, PrefixEntry(tuple(prompt) + tuple(completion), keys, values))

    def _decode(self, ids: list[list[int]], params: SamplingParams, device: torch.device,
                keep: Sequence[Hashable | None] | None = None) -> dict:
        """The decode loop; returns the raw buffers `assemble` takes."""
        n, budget = params.n, params.max_new_tokens
        prompt_ids, prompt_mask = left_pad(ids, self.pad_id, device)          # (B, P)
        batch = prompt_ids.shape[0]
        if isinstance(self.step, FusedDecoder):  # positions reach P + budget whatever the layout
            self.step.prepare(prompt_ids.shape[1] + budget, device)
        if self.prefix_cache.entries or (keep is not None and any(k is not None for k in keep)):
            self.prefix_cache.check(self._weights_stamp())                # stale entries go before any lookup
        rows = batch * n
        stops = StopStrings(params.stop, self.tokenizer)
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=device)
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(params.seed)

        cache, logits, prompt_keys = self._prefill(ids, prompt_ids, prompt_mask, n, budget, keep, device)  # (B, V)
        plen = prompt_keys.shape[1]                                            # W: the cache slots before token 0
        if n > 1:
            logits = logits.repeat_interleave(n, 0)                              # (R, V)

        # Step-major outputs: step t's tokens are one contiguous row the sampler writes into.
        tokens = torch.full((budget, rows), self.pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((budget, rows), dtype=torch.float32, device=device)
        policy = torch.zeros((budget, rows), dtype=torch.float32, device=device)
        stop_step = torch.full((rows,), budget, dtype=torch.long, device=device)  # step a row stopped at
        key_mask = torch.cat([prompt_keys.repeat_interleave(n, 0),
                              torch.ones(rows, budget, dtype=torch.bool, device=device)], 1)  # (R, P + N)
        next_pos = prompt_mask.sum(-1).repeat_interleave(n)                    # (R,) position of token 0
        active = torch.arange(rows, device=device)   # original row of each running row
        live = torch.ones(rows, dtype=torch.bool, device=device)  # running rows not yet finished
        completions: list[list[int]] = [[] for _ in range(rows)] if stops.stops else []
        # A uniform for every original row every step: samples do not depend on compaction.
        uniforms = None if params.greedy else shard_uniforms(budget, rows, gen, device, params.shard)  # (N, R)
        scratch = (torch.empty(rows, dtype=torch.long, device=device),
                   torch.empty(rows, dtype=torch.float32, device=device),
                   torch.empty(rows, dtype=torch.float32, device=device))
        plan = None
        # Where the decode step's C attention runs, compaction leaves the cache in place and the plan reads
        # row r's keys and values at cache row cache_rows[r]: no copy of the cache; and a prompt's n samples
        # read its keys and values from the prefill's cache (`prefix`), each its own tokens' from `cache`.
        gathers = isinstance(self.step, FusedDecoder) and self.step.gathers_rows(device)
        cache_rows, prefix = None, None
        kept = [] if keep is None else [j for j, k in enumerate(keep) if k is not None]  # rows to keep (departure 7)
        selected = False                                                       # whether cache.select moved rows

        def keep_rows(orig: list[int], cache_row: Callable[[int], int]) -> None:
            for j in orig:  # the row's prompt and its tokens but the last (never fed, so not in the cache)
                k = int(stop_step[j]) + 1 if int(stop_step[j]) < budget else budget
                self._keep(keep[j], cache, cache_row(j), ids[j // n], prompt_keys[j // n], tokens[:k - 1, j].tolist(),
                           prefix, j // n)

        for t in range(budget):
            full = active.numel() == rows                                      # not compacted yet: plain rows
            r = active.numel()
            if params.greedy:
                tok, lp, plp = sample(logits, params, None)
            else:
                tok, lp, plp = (tokens[t], logprobs[t], policy[t]) if full else (s[:r] for s in scratch)
                sample_into(logits, params, uniforms[t] if full else uniforms[t][active], tok, lp, plp)
            if not full or params.greedy:
                tokens[t].index_copy_(0, active, tok)
                logprobs[t].index_copy_(0, active, lp)
                policy[t].index_copy_(0, active, plp)
            done = torch.isin(tok, eos).logical_and_(live)                     # rows finishing now
            if stops.stops:
                live_rows = live.nonzero()[:, 0].tolist()
                orig = active.tolist()
                tok_list = tok.tolist()
                for j in live_rows:
                    completions[orig[j]].append(tok_list[j])
                hits = stops.hits([completions[orig[j]] for j in live_rows])
                if any(hits):
                    done[[j for j, h in zip(live_rows, hits) if h]] = True
            if full:
                stop_step.masked_fill_(done, t)
            else:
                stop_step.index_fill_(0, active[done], t)
            live.logical_xor_(done)                                            # done ⊆ live
            n_live = int(live.sum())                                           # device sync point
            if n_live == 0 or t == budget - 1:
                break
            if t == 0 and n > 1:                                               # first decode step: share the prefill
                if gathers and self.share_prompts:                             # read in place (fused.py departure 12)
                    prefix, plan = cache, None
                    cache = self._cache(rows, budget, device)
                    self._kv_bytes += prefix.nbytes
                else:
                    cache, plan = cache.expand(n, plen + budget), None
                    self._kv_bytes = cache.nbytes
            if n_live <= self.compact_below * live.numel() and n_live < live.numel():
                alive = live.nonzero()[:, 0]                                    # compaction
                if gathers:
                    cache_rows = alive if cache_rows is None else cache_rows[alive]
                else:
                    if kept:                                                   # finished rows leave the cache: keep them first
                        leaving = set(active[~live].tolist())
                        at = {j: r for r, j in enumerate(active.tolist())}
                        keep_rows([j for j in kept if j in leaving], at.__getitem__)
                        kept = [j for j in kept if j not in leaving]
                    cache.select(alive)                                         # one copy of the live rows
                    selected = True
                active, live, tok = active[alive], live[alive], tok[alive]
                key_mask, next_pos, plan = key_mask[alive], next_pos[alive], None
            if plan is None:
                plan = (self.step.plan(cache, key_mask) if cache_rows is None and prefix is None else
                        self.step.plan(cache, key_mask, cache_rows, prefix=prefix, share=n))
            logits = plan(tok, next_pos + t)                                   # (r, V)

        if kept:  # where each row's keys are now
            if selected:                       # select moved the running rows to the front, in order
                at = {j: r for r, j in enumerate(active.tolist())}
            elif cache.rows == rows:           # in place: never compacted, or compacted through cache_rows
                at = {j: j for j in kept}
            else:                              # n > 1, all stopped at step 0: the per-prompt prefill cache
                at = {j: j // n for j in kept}
            keep_rows(kept, at.__getitem__)
        stopped = stop_step < budget
        lengths = torch.where(stopped, stop_step + 1, budget)                  # rows never stopped ran to the end
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "n": n, "tokens": tokens.T,
                "logprobs": logprobs.T, "policy_logprobs": policy.T, "lengths": lengths, "stopped": stopped}
