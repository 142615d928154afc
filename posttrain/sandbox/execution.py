"""One run of untrusted code: the job, its limits, and the trusted parent's side of the run.

The parent starts a sandbox process (whatever the backend), then reads three channels — stdout,
stderr, and the harness's result channel — with a cap on each and a wall-clock deadline, both
enforced here, outside the sandbox. Over a cap or past the deadline, the backend's `kill` ends the
whole sandbox. What comes back is an `Execution`: raw, capped bytes and the harness's records.
Nothing here decides a verdict (`judge.py` does), and nothing here trusts what the sandbox wrote.
"""

from __future__ import annotations

import json
import marshal
import math
import os
import selectors
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HARNESS_SOURCE = (Path(__file__).parent / "_harness.py").read_bytes()
SESSION_CPU_CALLS = 8  # a session's RLIMIT_CPU: 8 single calls' worth of CPU over all its cells


@dataclass(frozen=True)
class Limits:
    """Per-run resource limits. Each is enforced by the OS or by the parent, never by the candidate."""

    timeout_s: float = 10.0  # wall clock, enforced from outside: the parent kills the whole sandbox
    memory_bytes: int = 1 << 30  # RLIMIT_AS of every process in the sandbox
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE: largest file the candidate may write
    tmpfs_bytes: int = 64 << 20  # size of the private work directory (bubblewrap only)
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 32  # processes in the sandbox, harness included: cgroup pids.max / RLIMIT_NPROC
    output_bytes: int = 1 << 20  # cap on each of stdout, stderr and the result channel

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_bytes", "file_bytes", "tmpfs_bytes", "open_files",
                     "processes", "output_bytes"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"Limits.{name} must be > 0, got {value!r}")

    @property
    def cpu_s(self) -> int:
        """RLIMIT_CPU: one second over the wall timeout, so a busy loop dies even if the parent hangs."""
        return math.ceil(self.timeout_s) + 1

    def rlimits(self) -> dict[str, int]:
        return {
            "RLIMIT_AS": self.memory_bytes,
            "RLIMIT_CPU": self.cpu_s,
            "RLIMIT_FSIZE": self.file_bytes,
            "RLIMIT_NOFILE": self.open_files,
            "RLIMIT_NPROC": self.processes,
            "RLIMIT_CORE": 0,
        }


@dataclass(frozen=True)
class Job:
    """What to run. `calls` set: function tests — each call is a Python expression evaluated after
    the candidate's code, its value sent back as plain data. `calls` None: a stdin → stdout program
    fed `stdin`. Expected outputs are deliberately not a field: they never enter the sandbox."""

    code: str
    calls: tuple[str, ...] | None = None
    stdin: str = ""
    setup: str = ""  # problem-provided code run before the candidate (MBPP's test_setup_code)
    audit: bool = False  # count the program's probes for what it was not given (`probe_count`; _harness.Audit)
    session: bool = False  # a persistent interpreter reading cells over a pipe (sandbox/session.py); `code` unused

    @property
    def kind(self) -> str:
        if self.session:
            return "session"
        return "stdio" if self.calls is None else "calls"


@dataclass
class Execution:
    """The raw outcome of one sandbox run, as the parent observed it."""

    started: bool = False  # the harness reached the candidate; False ⇒ sandbox error
    records: list[dict] = field(default_factory=list)  # result-channel records after `started`
    malformed: bool = False  # the result channel held something that is not our record format
    stdout: bytes = b""
    stderr: bytes = b""
    exit_code: int | None = None  # of the sandbox process; a veto at most, never a pass
    timed_out: bool = False
    output_exceeded: str | None = None  # which stream went over its cap
    elapsed_s: float = 0.0
    error: str | None = None  # why the sandbox itself failed (infrastructure, not the candidate)


def job_spec(job: Job, limits: Limits, stdin_path: str | None) -> bytes:
    """The spec the harness reads. Carries the program and the calls, never the expected values."""
    rlimits = limits.rlimits()
    if job.session:  # the CPU limit is per process: a session's cells share SESSION_CPU_CALLS calls' worth
        rlimits["RLIMIT_CPU"] = limits.cpu_s * SESSION_CPU_CALLS
    spec = {"kind": job.kind, "code": job.code, "calls": list(job.calls or ()), "setup": job.setup,
            "stdin": stdin_path, "rlimits": rlimits, "audit": job.audit}
    return marshal.dumps(spec)  # the harness reads it without importing json


def probe_count(records: list[dict]) -> int:
    """Probes the harness's audit hook counted: its final `probes` total, or — when the program was
    killed (or ended the harness) before the total was written — the probe records written as they
    happened. Never less than the records seen."""
    seen = sum(1 for r in records if "probe" in r)
    totals = [r["probes"] for r in records if type(r.get("probes")) is int]
    return max([seen, *totals])


def collect(proc: subprocess.Popen, result_fd: int, limits: Limits, start: float,
            kill: Callable[[], None], extra_fds: dict[int, Callable[[bytes], None]] | None = None,
            kill_when_done: bool = False) -> Execution:
    """Read stdout, stderr and the result channel until all close, a cap is hit, or the deadline
    passes; then make sure the sandbox is dead and reaped. `result_fd` is the parent's read end.

    `extra_fds` are further read ends whose bytes go to a callback (bubblewrap's info fd).
    `kill_when_done`: end the sandbox as soon as the harness says `done` (the unsafe backend, whose
    stray children would otherwise hold the pipes open until the deadline)."""
    ex = Execution()
    deadline = start + limits.timeout_s
    done_early = False
    buffers: dict[int, bytearray] = {proc.stdout.fileno(): bytearray(),
                                     proc.stderr.fileno(): bytearray(), result_fd: bytearray()}
    names = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr", result_fd: "result"}
    sel = selectors.DefaultSelector()
    for fd in buffers:
        sel.register(fd, selectors.EVENT_READ)
    for fd in extra_fds or {}:
        sel.register(fd, selectors.EVENT_READ)
    open_fds = len(sel.get_map())
    try:
        while open_fds:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ex.timed_out = True
                break
            for key, _ in sel.select(remaining):
                fd = key.fd
                chunk = os.read(fd, 65536)
                if not chunk:
                    sel.unregister(fd)
                    open_fds -= 1
                    continue
                if fd not in buffers:
                    extra_fds[fd](chunk)  # type: ignore[index]
                    continue
                buf = buffers[fd]
                buf += chunk
                if len(buf) > limits.output_bytes:
                    del buf[limits.output_bytes:]
                    ex.output_exceeded = names[fd]
                    break
                if kill_when_done and fd == result_fd and buf.endswith(b'{"done":true}\n'):
                    open_fds, done_early = 0, True
                    break
            if ex.output_exceeded:
                break
        if done_early:  # what the harness flushed before `done` is in the pipes already: take it
            for fd in (proc.stdout.fileno(), proc.stderr.fileno()):
                os.set_blocking(fd, False)
                try:
                    while len(buffers[fd]) <= limits.output_bytes and (chunk := os.read(fd, 65536)):
                        buffers[fd] += chunk
                except BlockingIOError:
                    pass
                if len(buffers[fd]) > limits.output_bytes:
                    del buffers[fd][limits.output_bytes:]
                    ex.output_exceeded = names[fd]
    finally:
        sel.close()
        # All channels closed: the sandbox is exiting; give it until the deadline to finish.
        if not (ex.timed_out or ex.output_exceeded or done_early) and not wait_exit(
                proc, deadline - time.monotonic()):
            ex.timed_out = True
        # Still running (deadline, cap, or done): end all of it, then reap.
        if proc.poll() is None:
            kill()
        try:
            ex.exit_code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # never seen; reported rather than hung on
            ex.error = "the sandbox process did not die within 5 s of SIGKILL"
        ex.elapsed_s = time.monotonic() - start
    ex.stdout = bytes(buffers[proc.stdout.fileno()])
    ex.stderr = bytes(buffers[proc.stderr.fileno()])
    parse_records(bytes(buffers[result_fd]), ex)
    return ex


def wait_exit(proc: subprocess.Popen, timeout: float) -> bool:
    """Block until `proc` exits (True) or `timeout` seconds pass (False), without reaping it.
    A pidfd, not `Popen.wait(timeout)`, which polls with sleeps of up to 50 ms — that alone would
    halve the pool's throughput."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except ProcessLookupError:  # already reaped
        return True
    except (AttributeError, OSError):  # no pidfds (kernel < 5.3, not Linux): poll instead
        try:
            proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return False
        return True
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(pidfd, selectors.EVENT_READ)
            return bool(sel.select(max(0.0, timeout)))
    finally:
        os.close(pidfd)


def parse_records(raw: bytes, ex: Execution) -> None:
    """The first line must be exactly the harness's `started` record (written before the candidate
    ran, so the candidate cannot forge its absence). Later lines are the candidate's responsibility:
    anything that is not one JSON object per line marks the run malformed."""
    lines = raw.split(b"\n")
    if lines[0] != b'{"started":true}':
        return
    ex.started = True
    for line in lines[1:]:
        if not line:
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            ex.malformed = True
            continue
        if not isinstance(record, dict):
            ex.malformed = True
            continue
        ex.records.append(record)
