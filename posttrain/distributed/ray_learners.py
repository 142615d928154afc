"""The learner as a torch.distributed group inside Ray actors (`posttrain run --nproc N --launcher ray`;
docs/placement.md, "The learner in Ray actors").

torchrun's job, done by Ray: start N processes, tell each its place in the environment torchrun sets
(`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), run the same entry in each (the
`posttrain run …` command, which reads that environment in `init_world` and joins a gloo / NCCL group),
and stop them all when one fails. Here each process is a Ray actor (`LearnerActor`) reserving
`num_cpus` CPUs (and `num_gpus` GPUs) in Ray's accounting, so the learner ranks are scheduled by the
same cluster as the rollout workers (`ray_engine.py`).

The driver (`launch_learners`):
1. starts the N actors and asks each where it runs (node id, IP); rank 0's actor finds a free TCP port on
   its node; the driver hands every rank MASTER_ADDR = rank 0's IP, that port, and LOCAL_RANK = its index
   among the ranks on its node;
2. calls `run` on every actor (the entry with the command's arguments, in the driver's working directory)
   and, while they run, prints rank 0's console output as it grows (the other ranks print nothing but
   their errors, as under torchrun);
3. joins them with `ray.wait` in rounds of `poll_s`: the first rank that raises, dies (`ray.kill`, a
   crash, out of memory: Ray resolves its call with `RayActorError`) or exits non-zero ends the run — the
   driver kills the others (a peer of a dead rank would otherwise sit in a collective until gloo's
   timeout) and raises `LearnerError` naming the rank and the cause, with the tail of that rank's output.
   Once one rank has finished cleanly the others must finish within `join_timeout_s`.

Departures from torchrun (numbered):
1. No restarts (torchrun's `--max-restarts`): a failed rank stops the run; `--resume` continues it
   from its last checkpoint, as after any stop.
2. The free port is found by binding port 0 on rank 0's node and closing it; the process group binds it
   again a moment later (torchrun's `--standalone` does the same). Another process could take it in
   between: the run then fails at the rendezvous, with that error, and can be started again.
3. The actors run the entry in a worker thread (the actor answers `output` calls beside it, for the
   console); the pipeline installs no signal handlers, which only the main thread may.
4. Paths in the arguments (the recipe, `--out`, overrides) are resolved in the driver's working
   directory; on a multi-machine cluster that folder must be on a shared filesystem (not tested: one
   machine here).

Rollout workers (`placement.rollout_workers`) with N > 1 learner ranks are refused before anything
starts (`check_rollout_placement`): a data-parallel RL stage samples each rank's own share of the
prompts, so each rank would need its own rollout workers, and `RunContext.rollout_engine` refuses
placement on more than one rank. With `--nproc 1` the learner actor builds the Ray rollout engine as one
process does (the workers are actors started from the learner's actor, on the same cluster).
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

SAMPLING_STAGES = ("grpo", "ppo")  # the data-parallel stages that call RunContext.rollout_engine
TAIL_CHARS = 3000  # of a failed rank's output, in the error


class LearnerError(RuntimeError):
    """A learner rank failed (raised, died or exited non-zero), or the ranks could not be started."""


@dataclass(frozen=True)
class LearnerGroup:
    """How the N learner actors are placed and joined."""

    nproc: int
    num_cpus: float = 1.0          # CPUs each rank reserves (recipe placement.num_cpus_per_learner)
    num_gpus: float = 0.0          # GPUs each rank reserves (a CUDA recipe: 1); not run here (no GPU)
    start_timeout_s: float = 300.0  # an actor's start: a new process importing torch
    join_timeout_s: float = 300.0  # after one rank finished cleanly, the others must within this
    poll_s: float = 1.0            # the join's round: how soon a failure or new console output is seen

    def __post_init__(self) -> None:
        if self.nproc < 1 or self.num_cpus <= 0 or self.num_gpus < 0:
            raise ValueError(f"{self}: expected nproc ≥ 1, num_cpus > 0, num_gpus ≥ 0")


def check_rollout_placement(nproc: int, rollout_workers: int | None, stages: Sequence[tuple[str, str]]) -> None:
    """Refuse Ray rollout workers beside N > 1 learner ranks when a stage would sample (`stages`: each
    stage's (kind, folder)); `rollout_workers` None = no placement block. Module docstring, last paragraph."""
    if nproc == 1 or rollout_workers is None:
        return
    for i, (kind, folder) in enumerate(stages):
        if kind in SAMPLING_STAGES:
            raise LearnerError(
                f"stages[{i}] ({folder}): placement.rollout_workers with --launcher ray --nproc {nproc} is not supported: "
                f"each data-parallel rank samples its own share of the prompts and would need its own rollout workers "
                f"(not built). Run --nproc 1 --launcher ray (the learner and its rollout workers as Ray actors), "
                f"or drop placement.rollout_workers to sample inside each rank")


def env_for(rank: int, world_size: int, local_rank: int, local_world_size: int, master_addr: str,
            master_port: int) -> dict[str, str]:
    """The environment torchrun gives rank `rank` (what `init_world` reads)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world_size), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


def local_ranks(nodes: Sequence[str]) -> list[int]:
    """Each rank's index among the ranks on its node (its GPU on a CUDA node).
    `local_ranks(["a", "b", "a"])` → [0, 0, 1]."""
    seen: dict[str, int] = {}
    out = []
    for n in nodes:
        out.append(seen.get(n, 0))
        seen[n] = out[-1] + 1
    return out


def free_port() -> int:
    """A TCP port free on this machine now (departure 2)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class _Tee(io.TextIOBase):
    """What the entry prints: kept (for the driver) and passed on to the actor's own stdout (Ray's log)."""

    def __init__(self, passthrough: TextIO):
        self.lock, self.parts, self.passthrough = threading.Lock(), [], passthrough

    def write(self, s: str) -> int:
        with self.lock:
            self.parts.append(s)
        self.passthrough.write(s)
        return len(s)

    def flush(self) -> None:
        self.passthrough.flush()

    def isatty(self) -> bool:
        return False

    def text(self) -> str:
        with self.lock:
            return "".join(self.parts)


class LearnerActor:
    """The body of one learner rank's Ray actor (`ray.remote` is applied at start, with its resources)."""

    def __init__(self) -> None:
        self.out = _Tee(sys.stdout)

    def where(self) -> tuple[str, str]:
        """(node id, node IP) of this actor."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        return free_port()

    def output(self, since: int = 0) -> str:
        """What the entry has printed, from character `since` on (the driver polls it)."""
        return self.out.text()[since:]

    def run(self, entry: Callable[[list[str]], int | None], argv: list[str], env: dict[str, str], cwd: str) -> int:
        """Run `entry(argv)` as rank env["RANK"]: its exit status (None = 0). An exception propagates
        (the driver names it); what it printed is kept in `output`."""
        if not os.path.isdir(cwd):
            raise LearnerError(f"the driver's working directory {cwd} does not exist on this node "
                               "(the run's paths need a shared filesystem)")
        os.chdir(cwd)
        os.environ.update(env)
        with contextlib.redirect_stdout(self.out), contextlib.redirect_stderr(self.out):
            try:
                code = entry(argv)
            except BaseException:
                self.out.write(traceback.format_exc())
                raise
        return int(code or 0)


@dataclass
class _Rank:
    actor: Any
    ref: Any = None
    code: int | None = None     # its exit status once it returned
    shown: int = field(default=0)  # characters of its output already printed (rank 0)


def _kill(actors: Sequence[Any]) -> None:
    import ray

    for a in actors:
        with contextlib.suppress(Exception):  # already dead, or the cluster is gone
            ray.kill(a, no_restart=True)


def _cause(err: BaseException) -> str:
    text = [line for line in str(err).strip().splitlines() if line.strip()]
    import ray

    if isinstance(err, ray.exceptions.RayTaskError):  # the rank raised: its own exception's last line
        inner = err.cause if getattr(err, "cause", None) is not None else err
        lines = [line for line in str(inner).strip().splitlines() if line.strip()]
        return f"{type(inner).__name__}: {lines[-1] if lines else ''}"[:600]
    return f"{type(err).__name__}: {text[0] if text else ''}"[:600]


def _tail(actor: Any, timeout: float = 10.0) -> str:
    import ray

    try:
        text = ray.get(actor.output.remote(), timeout=timeout)
    except Exception:  # noqa: BLE001 — a dead actor has no output to give
        return ""
    return text[-TAIL_CHARS:]


def launch_learners(group: LearnerGroup, entry: Callable[[list[str]], int | None], argv: Sequence[str], *,
                    print_fn: Callable[[str], None] = lambda s: print(s, end="", flush=True),
                    on_started: Callable[[list[Any]], None] | None = None) -> int:
    """Run `entry(argv)` on `group.nproc` learner actors forming one torch.distributed group; returns 0
    when every rank returned 0, else raises `LearnerError` naming the first rank that failed and why
    (module docstring). `entry` must be importable in the actors (a module-level function).
    `print_fn` gets rank 0's output as it grows; `on_started` gets the actors, in rank order, once every
    rank runs (tests kill one). Starts a local Ray cluster if this process has none."""
    import ray

    if not ray.is_initialized():
        ray.init(include_dashboard=False, configure_logging=False, log_to_driver=False)
    have = float(ray.cluster_resources().get("CPU", 0.0))
    if group.nproc * group.num_cpus > have:
        raise LearnerError(f"--nproc {group.nproc} learner ranks × {group.num_cpus:g} CPUs (placement.num_cpus_per_learner) "
                           f"need {group.nproc * group.num_cpus:g} CPUs; the Ray cluster has {have:g}")
    remote = ray.remote(LearnerActor).options(num_cpus=group.num_cpus, num_gpus=group.num_gpus,
                                              max_restarts=0, max_concurrency=2)
    ranks = [_Rank(remote.remote()) for _ in range(group.nproc)]
    try:
        try:  # the first answer waits for each actor's process to start
            where = ray.get([r.actor.where.remote() for r in ranks], timeout=group.start_timeout_s)
            port = ray.get(ranks[0].actor.free_port.remote(), timeout=group.start_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
            raise LearnerError(f"the {group.nproc} learner actors did not start: {_cause(err)}") from err
        locals_ = local_ranks([node for node, _ in where])
        cwd = os.getcwd()
        for k, r in enumerate(ranks):
            on_node = sum(node == where[k][0] for node, _ in where)
            env = env_for(k, group.nproc, locals_[k], on_node, where[0][1], port)
            env.update({n: v for n, v in os.environ.items() if n.startswith("POSTTRAIN_")})  # e.g. the collective timeout
            r.ref = r.actor.run.remote(entry, list(argv), env, cwd)
        if on_started is not None:
            on_started([r.actor for r in ranks])
        return _join(ranks, group, print_fn)
    finally:
        _kill([r.actor for r in ranks])  # every rank has returned or failed: nothing is left running


def _join(ranks: list[_Rank], group: LearnerGroup, print_fn: Callable[[str], None]) -> int:
    import ray

    pending = {r.ref: k for k, r in enumerate(ranks)}
    first_done: float | None = None
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=group.poll_s)
        _show(ranks[0], print_fn)
        for ref in done:
            k = pending.pop(ref)
            try:
                ranks[k].code = ray.get(ref)
            except (ray.exceptions.RayError, LearnerError) as err:
                _fail(ranks, k, f"learner rank {k} failed: {_cause(err)}", err)
            if ranks[k].code != 0:
                _fail(ranks, k, f"learner rank {k} exited with status {ranks[k].code}", None)
            first_done = first_done if first_done is not None else time.monotonic()
        if pending and first_done is not None and time.monotonic() - first_done > group.join_timeout_s:
            late = sorted(pending.values())
            _fail(ranks, late[0], f"learner rank(s) {', '.join(map(str, late))} still running {group.join_timeout_s:g} s "
                                  f"after rank {next(k for k, r in enumerate(ranks) if r.code == 0)} finished", None)
    _show(ranks[0], print_fn)
    return 0


def _show(rank0: _Rank, print_fn: Callable[[str], None]) -> None:
    """Print what rank 0 printed since the last call (a dead rank 0 shows nothing more)."""
    import ray

    try:
        new = ray.get(rank0.actor.output.remote(rank0.shown), timeout=10.0)
    except Exception:  # noqa: BLE001 — rank 0 died: its call reports it
        return
    if new:
        rank0.shown += len(new)
        print_fn(new)


def _fail(ranks: list[_Rank], k: int, what: str, err: BaseException | None) -> None:
    """Stop every rank (the failed one's peers would wait in a collective) and raise `LearnerError`."""
    tail = _tail(ranks[k].actor) if err is None or not isinstance(err, _actor_died()) else ""
    _kill([r.actor for r in ranks])
    others = ", ".join(str(j) for j in range(len(ranks)) if j != k and ranks[j].code is None)
    message = what + (f"; stopped the other ranks ({others})" if others else "")
    if tail.strip():
        message += f"\n--- the last of rank {k}'s output ---\n{tail.rstrip()}"
    raise LearnerError(message) from err


def _actor_died() -> type:
    import ray

    return ray.exceptions.RayActorError
