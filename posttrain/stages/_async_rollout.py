"""Asynchronous rollouts with bounded, deterministic staleness: a rollout thread produces the batches the
learner trains on, sampling rollout i with the policy after max(0, i − k) rollout updates.

References: the generate/update overlap of asynchronous RL systems — AReaL (Fu et al. 2025, §4, a
staleness bound η on how many versions a rollout's policy may lag), TRL's asynchronous GRPO, veRL's
fully-async mode, prime-rl — with the off-policy correction of `losses.decoupled_ppo_loss`.

Departures (numbered):
1. Staleness is *exact*, not "at most": the producer waits for version i − k and never samples with a
   newer one, even when it exists. A run is then a deterministic function of its seed — the same
   weights whatever the timing, resumable bit for bit — at the price of idling the producer when the
   learner is slow (a bounded-staleness system would sample with the newest version instead).
   AReaL and the others take the newest allowed version; their runs depend on timing.
2. Versions count rollout updates (μ optimizer steps each), not optimizer steps: staleness k is k·μ
   optimizer steps.
3. The producer is a thread of the learner's process, not a process: the engine-agnostic part is that it
   only calls `engine.generate` (through the stage's `produce`), `engine.sync_weights` and
   `engine.release_memory`, so a Ray-actor or vLLM engine can take its place. torch releases the GIL in
   its kernels, so the two threads overlap on a multi-core CPU; Python-heavy decode steps do not.
4. Every published version is kept until the producer has synced it: at most k snapshots are held at
   once (the learner publishes version v + 1 only after training on rollout v, which the producer has
   already made; it takes version j − k before rollout j).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.telemetry.costs import Cost

ROLLOUT_WORKER = "rollout0"  # the producer thread, when it runs the engine itself
DISPATCH_WORKER = "dispatch"  # the producer thread, when the engine's workers are elsewhere (Ray actors: rollout<k>)


def producer_worker(engine: Any) -> str:
    """The worker name of the producer thread's phases: it is the rollout worker when the engine decodes in
    this process; when the engine is placed elsewhere (`engine.remote`), its phases are the waits for the
    remote workers, whose own phases arrive as `rollout<k>`."""
    return DISPATCH_WORKER if getattr(engine, "remote", False) else ROLLOUT_WORKER


def behaviour_version(index: int, max_staleness: int) -> int:
    """The policy version rollout `index` (0-based) is sampled with: max(0, index − k)."""
    return max(0, index - max_staleness)


def snapshot(model: nn.Module) -> tuple[dict[str, Tensor], int]:
    """A detached copy of the weights the engine loads (the model's own dtype) and its bytes. This copy is
    the learner's whole share of the weight move; the engine's load is timed on the producer."""
    with torch.no_grad():
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, sum(t.nbytes for t in state.values())


@dataclass
class RolloutItem:
    """One rollout batch as the producer hands it over."""

    index: int                   # 0-based: the rollout update `index` trains on
    version: int                 # the policy version that sampled it (rollout updates before it)
    batch: Any                   # the stage's batch (GroupBatch), None when no group was usable
    metrics: dict[str, float]    # its rollout metrics (reward, lengths, groups)
    data_state: dict[str, Any]   # the data sampler's state after it was drawn (what a resume continues from)
    wait_s: float = 0.0          # seconds the producer idled for its policy version

    def to_state(self) -> dict[str, Any]:
        b = self.batch
        return {"index": self.index, "version": self.version, "metrics": dict(self.metrics),
                "data_state": self.data_state, "wait_s": self.wait_s,
                "batch": None if b is None else {f: getattr(b, f) for f in b.__dataclass_fields__}}

    @staticmethod
    def from_state(obj: dict[str, Any], batch_type: type) -> RolloutItem:
        b = obj["batch"]
        return RolloutItem(int(obj["index"]), int(obj["version"]), None if b is None else batch_type(**b),
                           dict(obj["metrics"]), obj["data_state"], float(obj.get("wait_s", 0.0)))


@dataclass
class AsyncRollouts:
    """The rollout thread and its two hand-overs: weight snapshots in (learner → producer), batches out.

    produce(index, version): the stage's collection of rollout `index` (phases `generate`, `score` on the
    worker `ROLLOUT_WORKER`) → (batch, metrics). data_state(): the sampler's state, read after each rollout.
    phase(name, step): a phase context on the rollout worker. step_of(index): the step a rollout's phases
    and metrics are logged under. Rollouts `first_index` … `n_rollouts − 1` are produced; `pending` are
    rollouts made before a resume, handed out first."""

    engine: Any
    max_staleness: int
    n_rollouts: int
    first_index: int
    engine_version: int
    produce: Callable[[int, int], tuple[Any, dict[str, float]]]
    data_state: Callable[[], dict[str, Any]]
    phase: Callable[..., AbstractContextManager[Any]]
    step_of: Callable[[int], int]
    release_memory: bool = True
    pending: list[RolloutItem] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_staleness < 1:
            raise ValueError(f"AsyncRollouts: max_staleness must be ≥ 1 (0 is the synchronous loop), got {self.max_staleness}")
        self._cond = threading.Condition()
        self._ready: dict[int, RolloutItem] = {p.index: p for p in self.pending}
        self._snapshots: dict[int, dict[str, Tensor]] = {}
        self._made = self.first_index  # rollouts [.., _made) exist
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=ROLLOUT_WORKER, daemon=True)
        self._thread.start()

    # ---- the producer thread --------------------------------------------------------------------
    def _take(self, version: int) -> tuple[dict[str, Tensor] | None, float]:
        t0 = time.perf_counter()
        with self._cond:
            while version not in self._snapshots and not self._stop:
                self._cond.wait()
            return (None if self._stop else self._snapshots.pop(version)), time.perf_counter() - t0

    def _run(self) -> None:
        try:
            for j in range(self.first_index, self.n_rollouts):
                v, waited = behaviour_version(j, self.max_staleness), 0.0
                if v != self.engine_version:
                    state, waited = self._take(v)
                    if state is None:
                        return
                    with self.phase("sync", self.step_of(j)) as ph:  # the load into the engine (its copies rebuilt)
                        ph.cost = Cost(bytes=self.engine.sync_weights(state))
                    self.engine_version = v
                    del state
                batch, metrics = self.produce(j, v)
                if self.release_memory:  # the engine's copies leave memory while the producer waits
                    self.engine.release_memory()
                item = RolloutItem(j, v, batch, metrics, self.data_state(), waited)
                with self._cond:
                    self._ready[j] = item
                    self._made = j + 1
                    self._cond.notify_all()
                if self._stop:
                    return
        except BaseException as e:  # handed to the learner, which raises it at its next wait
            with self._cond:
                self._error = e
                self._cond.notify_all()

    # ---- the learner's side ---------------------------------------------------------------------
    def _wait(self, until: Callable[[], bool]) -> float:
        t0 = time.perf_counter()
        with self._cond:
            while not until():
                if self._error is not None:
                    raise RuntimeError(f"the rollout thread failed: {type(self._error).__name__}: {self._error}") from self._error
                if not self._thread.is_alive():
                    raise RuntimeError("the rollout thread stopped before producing the rollout the learner waits for")
                self._cond.wait(timeout=1.0)
        return time.perf_counter() - t0

    def get(self, index: int) -> tuple[RolloutItem, float]:
        """Rollout `index` (blocks until it exists) and the seconds the learner waited for it."""
        waited = self._wait(lambda: index in self._ready)
        with self._cond:
            return self._ready.pop(index), waited

    def publish(self, version: int, model: nn.Module) -> int:
        """Hand the producer the weights of `version` (a copy: the learner keeps training). Returns the bytes
        copied. Versions no rollout will sample with are not copied (0 bytes)."""
        first_use = version + self.max_staleness  # the rollout that samples with it
        if first_use >= self.n_rollouts or first_use < self._made:
            return 0
        state, nbytes = snapshot(model)
        with self._cond:
            self._snapshots[version] = state
            if len(self._snapshots) > self.max_staleness + 1:  # departure 4: a bug, not a load condition
                raise RuntimeError(f"AsyncRollouts: {len(self._snapshots)} weight snapshots held, more than k + 1")
            self._cond.notify_all()
        return nbytes

    def drain(self, version: int) -> tuple[list[RolloutItem], float]:
        """Wait until every rollout whose policy version exists (≤ `version`) is made; return the ones not yet
        handed out (in order: what a checkpoint saves) and the seconds waited."""
        last = min(self.n_rollouts, version + self.max_staleness + 1)  # rollouts [.., last) sample versions ≤ version
        waited = self._wait(lambda: self._made >= last)
        with self._cond:
            return [self._ready[i] for i in sorted(self._ready)], waited

    def close(self) -> None:
        """Stop the producer (it finishes the rollout it is making) and join it."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()


# ---- what a stage logs and saves of it (GRPO's and PPO's loops) ------------------------------------
def staleness_metrics(index: int, item: RolloutItem, waited: float) -> dict[str, float]:
    """Staleness of rollout `index`'s samples (all sampled by one version: mean = max) and who idled:
    the learner `waited` s for it, the producer `item.wait_s` s for its version."""
    stale = float(index - item.version)
    return {"async/staleness_mean": stale, "async/staleness_max": stale, "async/version": float(item.version),
            "async/wait_learner_s": waited, "async/wait_rollout_s": item.wait_s}


def pending_state(max_staleness: int, pending: list[RolloutItem]) -> dict[str, Any]:
    """What an asynchronous checkpoint saves beside the weights (under `async`): every rollout already made
    and not yet trained on — their policy versions are gone once the learner moves on."""
    return {"max_staleness": max_staleness, "pending": [p.to_state() for p in pending]}


def restore_pending(folder: str, max_staleness: int, saved: dict[str, Any] | None, batch_type: type) -> list[RolloutItem]:
    """The rollouts an asynchronous checkpoint saved (`saved`: its `async` entry, None for a synchronous
    one). Another `max_staleness` than the checkpoint's cannot resume it exactly: an error naming both."""
    was = 0 if saved is None else int(saved["max_staleness"])
    if was != max_staleness:
        raise ValueError(f"{folder}: the checkpoint was saved with max_staleness {was}, the recipe says "
                         f"{max_staleness}; an exact resume needs the same (or start the stage afresh)")
    return [] if saved is None else [RolloutItem.from_state(o, batch_type) for o in saved["pending"]]
