"""Rollout workers as Ray actors behind the `RolloutEngine` protocol (docs/placement.md).

The learner stays in the driver process; each worker is a Ray actor that builds its own copy of the
policy (the learner's class and architecture config, LoRA adapters re-injected where the learner has
them, the learner's weights through the object store) and a rollout engine over it (`make_engine`: the
native engine here; vLLM on a GPU later). `RayRolloutEngine` is what `RunContext.rollout_engine` hands a
stage when the recipe has a `placement:` block, so GRPO, PPO and rejection sampling use it unchanged.

- `generate` splits the prompts over the workers, contiguous and prompt-major, and gives worker k the
  random numbers its rows would get in one call over the whole batch (`SamplingParams.shard`, native
  engine): the gathered `Rollout` holds the samples the in-process engine draws (tested, 1 and 2 workers).
- `sync_weights` sends the learner's weights, full or as a delta (`weight_sync.py`), once into the object
  store and to every worker; it returns the bytes the workers received.
- A worker that dies (`RayActorError`, which `ActorDiedError` is) or does not answer within `timeout_s`
  is killed, restarted with the latest full weights, and its request re-issued — the same prompts and
  seed, so the same samples; past `max_restarts` (per worker) the run stops with `PlacementError` naming
  the worker and the cause. An exception raised by the engine inside a worker (a bad request) is not a
  death: it propagates as Ray raised it.
- Each worker times its `generate` and its `sync` (applying the weights and rebuilding its engine's
  copies) and returns the times; they go to `Telemetry.record_external` as worker `rollout<k>`, under the
  stage and step of the phase the call was made in, their start mapped onto the run's clock (below).

Clocks: a worker stamps its phases with `time.time()`. At start the driver asks each worker for its clock
between two readings of its own and takes the worker's offset as worker − midpoint (NTP's estimate: exact
on one machine up to the call's asymmetry, ~0.1 ms; across machines it is off by the one-way delay's
asymmetry, bounded by half the round trip, which the offset is measured with). A driver wall time is
mapped to the run's `time.perf_counter()` clock by the offset between the two clocks, read once.

Departures and limits (numbered):
1. Requests are gathered worker by worker, each `ray.get` with its own `timeout_s`, so a call that fails
   late can take up to (workers × timeout_s) to be noticed; the calls themselves run concurrently.
2. A restarted worker gets the weights of the last `sync_weights` source read again: a state dict (the
   async loop's snapshot) is exactly what was sent; a module (the synchronous loop) is read as it is now,
   which is what was sent because the synchronous loop syncs right after its update and changes nothing
   before the next rollout.
3. Colocated mode on a CPU: workers reserve no CPUs (they share the learner's) and release their engine's
   weight copies and KV cache after every rollout (`release_memory`: the "sleep"); the next sync rebuilds
   them. The worker's module stays in its process (vLLM's sleep level 1 keeps weights in host memory the
   same way). Moving weights off a GPU between rollouts is not done here (no GPU was used).
4. A worker built from the architecture config has the learner's tokenizer, EOS and pad ids (given, not
   re-read from a generation config it does not have).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.distributed.weight_sync import (
    SyncMode,
    SyncState,
    WeightPayload,
    apply_payload,
    fingerprint,
    full_payload,
    named_tensors,
    plan_sync,
    to_wire,
)
from posttrain.models import lora
from posttrain.models.cpu_math import use_threads
from posttrain.rollout import Rollout, SamplingParams, make_engine
from posttrain.rollout.native import eos_ids_of, pad_id_of
from posttrain.telemetry import costs
from posttrain.telemetry.phases import PhaseRecord, Telemetry


class PlacementError(RuntimeError):
    """The placement cannot go on: a worker failed past its restart budget, or the cluster cannot hold it."""


@dataclass(frozen=True)
class Placement:
    """The recipe's `placement:` block (runtime.config.PlacementConfig), as this module reads it."""

    mode: str = "split"              # "split" | "colocated"
    rollout_workers: int = 1
    sync: str = "full"               # "full" | "delta"
    num_cpus_per_worker: float = 1.0
    max_restarts: int = 2
    timeout_s: float = 600.0
    num_cpus_per_learner: float = 1.0  # read by `--launcher ray` (ray_learners.py), not by this engine

    def __post_init__(self) -> None:
        if self.mode not in ("split", "colocated"):
            raise ValueError(f"placement.mode={self.mode!r}: expected 'split' or 'colocated'")
        SyncMode(self.sync)
        if self.rollout_workers < 1 or self.num_cpus_per_worker <= 0 or self.max_restarts < 0 or self.timeout_s <= 0:
            raise ValueError(f"placement: {self}: expected rollout_workers ≥ 1, num_cpus_per_worker > 0, "
                             "max_restarts ≥ 0, timeout_s > 0")

    @property
    def cpus(self) -> float:
        """CPUs one worker reserves: its own in split mode, none (the learner's) colocated."""
        return self.num_cpus_per_worker if self.mode == "split" else 0.0


# ---- the policy a worker builds ------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """What a worker needs to build the learner's module without its weights."""

    cls: type                     # the HF class (e.g. LlamaForCausalLM); LoRA layers are injected into it
    config: Any                   # its PretrainedConfig
    dtype: torch.dtype            # the learner's parameter dtype
    lora: dict[str, Any] | None   # `lora.wrap`'s arguments when the learner has adapters


def model_spec(model: nn.Module) -> ModelSpec:
    adapters = None
    if lora.is_lora(model):
        c = lora.peft_of(model).peft_config["default"]
        adapters = {"r": c.r, "alpha": c.lora_alpha, "dropout": c.lora_dropout,
                    "target_modules": sorted(c.target_modules), "heads": tuple(sorted(c.modules_to_save or ()))}
    return ModelSpec(type(model), model.config, next(model.parameters()).dtype, adapters)


def build_model(spec: ModelSpec) -> nn.Module:
    """The learner's module, randomly initialised (the first sync overwrites every tensor), in eval mode."""
    model = spec.cls(spec.config).to(spec.dtype)
    if spec.lora is not None:
        model = lora.wrap(model, **spec.lora)
    return model.eval()


# ---- the actor -----------------------------------------------------------------------------------
START_TIMEOUT_S = 300.0  # a worker's start (a new process importing torch, building the model) may take this long
Timing = tuple[float, float]  # (start, worker's time.time(); seconds)


class RolloutWorker:
    """The body of one Ray actor: a policy copy and a rollout engine over it (`ray.remote` is applied when
    it is started, with the placement's resources)."""

    def __init__(self, spec: ModelSpec, weights: WeightPayload, tokenizer: Any, backend: str,
                 options: dict[str, Any], threads: int, sleep_after_generate: bool):
        use_threads(threads)  # and the vector math primed before the first forward (models/cpu_math.py)
        self.model = build_model(spec)
        self.targets = self.model.state_dict(keep_vars=True)
        apply_payload(self.targets, weights)
        self.engine = make_engine(backend, self.model, tokenizer, **options)
        self.sleep_after_generate = sleep_after_generate

    def clock(self) -> float:
        return time.time()

    def sync(self, payload: WeightPayload) -> Timing:
        start, t0 = time.time(), time.perf_counter()
        apply_payload(self.targets, payload)
        self.engine.sync_weights(self.model)  # the engine's copies (fused, decode forms) rebuilt now
        return start, time.perf_counter() - t0

    def generate(self, prompts: Sequence[Any], params: SamplingParams) -> tuple[Rollout, Timing]:
        start, t0 = time.time(), time.perf_counter()
        out = self.engine.generate(prompts, params)
        if self.sleep_after_generate:  # colocated: give the memory back until the next sync
            self.engine.release_memory()
        return out, (start, time.perf_counter() - t0)

    def digest(self) -> dict[str, bytes]:
        """Each tensor's fingerprint (tests compare a delta-synced worker with a fully synced one)."""
        return {k: fingerprint(v.detach()) for k, v in named_tensors(self.model).items()}


# ---- pure helpers --------------------------------------------------------------------------------
def split_prompts(n_prompts: int, workers: int) -> list[range]:
    """Contiguous shares of the prompts, sizes differing by at most one, the larger first; empty ones
    dropped. `split_prompts(5, 2)` → [range(0, 3), range(3, 5)]."""
    base, extra = divmod(n_prompts, workers)
    out, start = [], 0
    for k in range(workers):
        size = base + (k < extra)
        out.append(range(start, start + size))
        start += size
    return [r for r in out if len(r)]


def shard_params(params: SamplingParams, share: range, n_prompts: int) -> SamplingParams:
    """The parameters of one worker's share: its rows' place in the whole batch (`SamplingParams.shard`,
    composed with a shard the caller already gave). The whole batch in one share: unchanged."""
    if len(share) == n_prompts:
        return params
    first, total = params.shard if params.shard is not None else (0, n_prompts * params.n)
    return dataclasses.replace(params, shard=(first + share.start * params.n, total))


def concat_rollouts(parts: Sequence[Rollout], firsts: Sequence[int], pad_id: int) -> Rollout:
    """One `Rollout` from the workers' parts, in order: prompts re-left-padded and completions
    re-right-padded to the longest, `prompt_index` offset by each part's first prompt."""
    if len(parts) == 1 and firsts[0] == 0:
        return parts[0]
    p = max(r.prompt_ids.shape[1] for r in parts)
    n = max(r.completion_ids.shape[1] for r in parts)

    def left(t: Tensor, width: int, value: Any) -> Tensor:
        return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)

    def right(t: Tensor, width: int, value: Any) -> Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    return Rollout(
        prompt_ids=torch.cat([left(r.prompt_ids, p, pad_id) for r in parts]),
        prompt_mask=torch.cat([left(r.prompt_mask, p, False) for r in parts]),
        completion_ids=torch.cat([right(r.completion_ids, n, pad_id) for r in parts]),
        completion_mask=torch.cat([right(r.completion_mask, n, False) for r in parts]),
        logprobs=torch.cat([right(r.logprobs, n, 0.0) for r in parts]),
        policy_logprobs=torch.cat([right(r.policy_logprobs, n, 0.0) for r in parts]),
        finish_reason=[f for r in parts for f in r.finish_reason],
        prompt_index=torch.cat([r.prompt_index + first for r, first in zip(parts, firsts)]),
        texts=[t for r in parts for t in r.texts],
    )


def _ray():
    try:
        import ray
    except ImportError:
        raise PlacementError("placement: needs the ray package (pip install 'posttrain[ray]'); "
                             "remove the recipe's `placement:` block to run in one process") from None
    return ray


def ensure_ray(placement: Placement) -> None:
    """Start a local Ray cluster if none is running, and check it can hold the workers' CPUs."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(include_dashboard=False, configure_logging=False, log_to_driver=True)
    need = placement.rollout_workers * placement.cpus
    have = float(ray.cluster_resources().get("CPU", 0.0))
    if need > have:
        raise PlacementError(f"placement: {placement.rollout_workers} rollout workers × {placement.num_cpus_per_worker:g} "
                             f"CPUs need {need:g} CPUs; the Ray cluster has {have:g} (lower rollout_workers or "
                             "num_cpus_per_worker, or use mode: colocated)")


@dataclass
class _Slot:
    actor: Any
    offset: float                 # worker clock − driver clock (s)
    restarts: int = 0


@dataclass
class _Stats:
    bytes: int = 0
    bytes_full: int = 0
    seconds: float = 0.0
    syncs: int = 0
    restarts: int = 0


def _kill(actors: list[Any]) -> None:
    try:
        import ray
        for a in actors:
            ray.kill(a, no_restart=True)
    except Exception:  # noqa: BLE001 — at exit or after shutdown there may be nothing left to kill
        pass


class RayRolloutEngine:
    """A `RolloutEngine` whose rollouts run on `placement.rollout_workers` Ray actors (module docstring).

    model: the learner's policy (its weights are read at start and at every `sync_weights`).
    backend, options: the engine each worker builds (`make_engine(backend, model, tokenizer, **options)`);
    `options["dtype"]` is also the dtype the weights travel in (a bf16-sampling engine gets bf16).
    worker_cls: the actor body (tests pass a subclass that is slow on purpose)."""

    remote = True  # the decode runs in other processes: a caller's phases around it are waits

    def __init__(self, model: nn.Module, tokenizer: Any, *, placement: Placement, backend: str = "native",
                 options: dict[str, Any] | None = None, worker_cls: type = RolloutWorker):
        self._ray = _ray()
        ensure_ray(placement)
        self.name = backend
        self.placement = placement
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids_of(model, tokenizer)
        self.pad_id = pad_id_of(model, tokenizer, self.eos_ids)
        self._config = model.config
        self._options = {"eos_token_ids": self.eos_ids, **(options or {})}
        self._backend, self._spec, self._worker_cls = backend, model_spec(model), worker_cls
        self._wire_dtype: torch.dtype | None = self._options.get("dtype")
        self._state = SyncState(SyncMode(placement.sync))
        self._source: nn.Module | dict[str, Tensor] = model
        self._lock = threading.RLock()  # one request at a time, from whichever thread calls
        self._telemetry: Telemetry | None = None
        self._stats = _Stats()
        self._clock_offset = time.time() - time.perf_counter()  # driver wall − driver perf
        wire = to_wire(named_tensors(model), self._wire_dtype)
        plan_sync(self._state, wire)  # the workers start from these weights: the first delta is against them
        weights = self._ray.put(full_payload(wire))
        self._slots: list[_Slot] = []
        try:
            for k in range(placement.rollout_workers):
                self._slots.append(self._start(k, weights))
        except BaseException:
            _kill([s.actor for s in self._slots])  # the ones that did start
            raise
        self._finalizer = weakref.finalize(self, _kill, [s.actor for s in self._slots])

    # ---- workers ---------------------------------------------------------------------------------
    def _start(self, k: int, weights: Any) -> _Slot:
        p = self.placement
        actor_cls = self._ray.remote(self._worker_cls).options(num_cpus=p.cpus, max_restarts=0, max_concurrency=1)
        actor = actor_cls.remote(self._spec, weights, self.tokenizer, self._backend, self._options,
                                 max(1, int(p.num_cpus_per_worker)), p.mode == "colocated")
        try:  # the first answer waits for the actor to start Python, import torch, build its model and engine
            self._ray.get(actor.clock.remote(), timeout=max(p.timeout_s, START_TIMEOUT_S))
            before = time.time()
            theirs = self._ray.get(actor.clock.remote(), timeout=p.timeout_s)  # a round trip to a ready actor
            after = time.time()
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError) as err:
            _kill([actor])
            raise PlacementError(f"placement: rollout worker rollout{k} did not start: {_cause(err)}") from err
        return _Slot(actor, theirs - (before + after) / 2)

    def _restart(self, k: int, err: Exception) -> None:
        slot = self._slots[k]
        slot.restarts += 1
        self._stats.restarts += 1
        what = "timed out" if isinstance(err, self._ray.exceptions.GetTimeoutError) else "died"
        if slot.restarts > self.placement.max_restarts:
            raise PlacementError(
                f"placement: rollout worker rollout{k} {what} and has used its {self.placement.max_restarts} "
                f"restarts (max_restarts); the run stops. Cause: {_cause(err)}") from err
        _kill([slot.actor])
        wire = to_wire(named_tensors(self._source), self._wire_dtype)  # the latest weights (departure 2)
        restarts = slot.restarts
        self._slots[k] = self._start(k, self._ray.put(full_payload(wire)))
        self._slots[k].restarts = restarts
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _kill, [s.actor for s in self._slots])

    def _get(self, k: int, ref: Any, reissue: Callable[[Any], Any] | None) -> Any:
        """The answer of worker k's call `ref`; a dead or silent worker is restarted and, with `reissue`,
        asked again (the same request: the same samples). None when a restart made the call moot."""
        while True:
            try:
                return self._ray.get(ref, timeout=self.placement.timeout_s)
            except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError) as err:
                self._restart(k, err)
                if reissue is None:
                    return None
                ref = reissue(self._slots[k].actor)

    # ---- the protocol ----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]] | Sequence[str], params: SamplingParams) -> Rollout:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"generate: params must be a SamplingParams, got {type(params).__name__}")
        with self._lock:
            shares = split_prompts(len(prompts), len(self._slots))
            requests = [([prompts[i] for i in share], shard_params(params, share, len(prompts))) for share in shares]
            refs = [self._slots[k].actor.generate.remote(*req) for k, req in enumerate(requests)]
            parts, timings = [], []
            for k, (ref, req) in enumerate(zip(refs, requests)):
                part, timing = self._get(k, ref, lambda actor, req=req: actor.generate.remote(*req))
                parts.append(part)
                timings.append(timing)
            for k, (part, timing) in enumerate(zip(parts, timings)):
                cost = self.decode_cost(batch=len(part), prompt_len=part.prompt_ids.shape[1],
                                        new_tokens=max(1, part.completion_ids.shape[1]), samples=params.n)
                self._record(k, "generate", timing, cost)
            return concat_rollouts(parts, [s.start for s in shares], self.pad_id)

    def sync_weights(self, model_or_state_dict: nn.Module | dict[str, Tensor]) -> int:
        """Send the weights to every worker now (full or delta); returns the bytes the workers received."""
        with self._lock:
            t0 = time.perf_counter()
            self._source = model_or_state_dict
            payload = plan_sync(self._state, to_wire(named_tensors(model_or_state_dict), self._wire_dtype))
            ref = self._ray.put(payload)
            refs = [s.actor.sync.remote(ref) for s in self._slots]
            for k, r in enumerate(refs):
                timing = self._get(k, r, None)  # a restarted worker already has these weights, in full
                if timing is not None:
                    self._record(k, "sync", timing, costs.Cost(bytes=payload.nbytes))
            workers = len(self._slots)
            self._stats.bytes += payload.nbytes * workers
            self._stats.bytes_full += payload.full_bytes * workers
            self._stats.seconds += time.perf_counter() - t0
            self._stats.syncs += 1
            return payload.nbytes * workers

    def update_weights(self, model_or_state_dict: nn.Module | dict[str, Tensor]) -> None:
        """The workers are other processes: the weights move now (`sync_weights`)."""
        self.sync_weights(model_or_state_dict)

    def release_memory(self) -> int:
        """Nothing is held in this process (colocated workers release their own after every rollout)."""
        return 0

    def decode_cost(self, *, batch: int, prompt_len: int, new_tokens: int, samples: int = 1) -> costs.Cost:
        """The workers' engines prefill a prompt once for its samples (native and vLLM alike); whether they
        read its keys once is theirs to know, so this counts a read per sample (`shared_reads=False`)."""
        return costs.decode(self._config, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, samples=samples,
                            shared_reads=False)

    # ---- telemetry, metrics, shutdown ------------------------------------------------------------
    def attach(self, telemetry: Telemetry) -> None:
        """Workers' phases go to this telemetry (`RunContext.rollout_engine` attaches the run's)."""
        self._telemetry = telemetry

    def _record(self, k: int, name: str, timing: Timing, cost: costs.Cost) -> None:
        tele = self._telemetry
        # the stage and step are those of the phase this thread is in (the stage's `generate` or `sync`);
        # outside any phase (an eval's generate) the worker's time is not recorded
        frames = tele._frames() if tele is not None and tele.enabled else []
        if not frames:
            return
        start, seconds = timing
        on_driver = start - self._slots[k].offset                      # driver wall clock
        run_clock = on_driver - self._clock_offset - tele.started       # seconds since the run started
        tele.record_external(PhaseRecord(stage=frames[-1].stage, step=frames[-1].step, name=name, start=run_clock,
                                         seconds=seconds, flops=float(cost.flops), bytes=float(cost.bytes),
                                         busy=None, parent=None, worker=f"rollout{k}"))

    def take_metrics(self) -> dict[str, float]:
        """The sync and restart metrics since the last call (metrics.jsonl keys): `sync/bytes`,
        `sync/bytes_full` (what full sends would have moved), `sync/seconds` (the driver's wall time of the
        syncs, workers' apply included), and `placement/worker_restarts` (cumulative)."""
        s = self._stats
        out: dict[str, float] = {"placement/worker_restarts": float(s.restarts)}
        if s.syncs:
            out.update({"sync/bytes": float(s.bytes), "sync/bytes_full": float(s.bytes_full), "sync/seconds": s.seconds})
        s.bytes = s.bytes_full = s.syncs = 0
        s.seconds = 0.0
        return out

    @property
    def restarts(self) -> int:
        return self._stats.restarts

    def workers(self) -> list[Any]:
        """The live actor handles, in worker order (tests kill them)."""
        return [s.actor for s in self._slots]

    def close(self) -> None:
        """Kill the workers (also done when the engine is garbage-collected)."""
        self._finalizer()


def _cause(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:400]
