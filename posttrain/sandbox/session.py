"""A persistent sandboxed interpreter: cells over a pipe, one namespace — a notebook's kernel, isolated.

    host = SessionHost("bubblewrap", limits)      # one per environment factory: the backend, a spawner thread
    s = host.open()                               # one per episode; nothing starts until the first cell
    s.run("x = 41")                               # CellResult(stdout="", ...)
    s.run("x + 1")                                # CellResult(stdout="42\n", ...): a last expression prints
    s.close()                                     # or host.close(): every session it opened

The session is the same sandbox as a single run (bubblewrap: namespaces, read-only root, rlimits,
a wall-clock kill from outside — docs/sandbox.md), started with the harness in `session` mode: it
reads cells from a private pipe and runs each in one namespace, writing `{"cell_done": k}` after
each. The parent enforces, per cell, the wall-clock timeout (`Limits.timeout_s`) and the output cap
(`Limits.output_bytes` on each stream); over either, the whole sandbox is killed and the session is
*dead*: the result says so (`reset=True`) and the next cell starts a fresh interpreter. RLIMIT_CPU
holds for the whole process, so a session's cells share `SESSION_CPU_CALLS` calls' worth of CPU time.

Departures from a notebook kernel (Jupyter's):
1. One cell at a time, no interrupt: a cell past its timeout costs the session (a kernel would
   raise KeyboardInterrupt and keep the state), because the parent cannot trust the candidate to
   stop. The model is told the session was reset.
2. Only what the cell prints comes back (stdout, then the error); no rich outputs.
3. Sessions start from the thread of a persistent spawner: bubblewrap's `--die-with-parent` fires
   when the *thread* that started it exits, and the episode loop's threads come and go.
"""

from __future__ import annotations

import json
import os
import selectors
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from posttrain.sandbox.execution import Execution, Job, Limits


@dataclass(frozen=True)
class CellResult:
    stdout: str = ""
    error: str | None = None   # the cell's exception ("ZeroDivisionError: division by zero") or what stopped it
    reset: bool = False        # the session died (timeout, output cap, crash): the next cell starts afresh
    timed_out: bool = False
    output_exceeded: bool = False
    probes: int = 0            # the audit hook's count for this cell (sandbox/_harness.py `Audit`)
    elapsed_s: float = 0.0


class SessionHost:
    """What a factory's sessions share: the backend (probed once), the spawner thread, and the live
    sessions (`close()` ends them all — the environment factory's `close`)."""

    def __init__(self, backend: str = "bubblewrap", limits: Limits | None = None, *, audit: bool = True):
        self.backend_name, self.limits, self.audit = backend, limits or Limits(), audit
        self._backend: Any = None
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="sandbox-session")
        self._lock = threading.Lock()
        self._live: set[Session] = set()
        self.started = 0  # interpreters started (a reset starts another)

    def backend(self) -> Any:
        with self._lock:
            if self._backend is None:
                if self.backend_name == "bubblewrap":
                    from posttrain.sandbox.bubblewrap import BubblewrapSandbox
                    self._backend = BubblewrapSandbox()
                elif self.backend_name == "unsafe-subprocess":
                    from posttrain.sandbox.unsafe import UnsafeSubprocessSandbox
                    self._backend = UnsafeSubprocessSandbox()
                else:
                    raise ValueError(f"sandbox backend {self.backend_name!r} is not one of "
                                     "('bubblewrap', 'unsafe-subprocess')")
            return self._backend

    def open(self) -> Session:
        s = Session(self)
        with self._lock:
            self._live.add(s)
        return s

    def launch(self) -> Any:
        """A fresh interpreter in the sandbox (a `Running` handle, or an Execution with the error)."""
        backend = self.backend()
        job = Job("", session=True, audit=self.audit)
        if getattr(backend, "warn", None):
            backend.warn()
        self.started += 1
        return self._spawner.submit(backend.start, job, self.limits, stdin_pipe=True).result()

    def forget(self, s: Session) -> None:
        with self._lock:
            self._live.discard(s)

    @property
    def live(self) -> int:
        return len(self._live)

    def close(self) -> None:
        with self._lock:
            live = list(self._live)
        for s in live:
            s.close()
        self._spawner.shutdown(wait=True)


class Session:
    """One episode's interpreter. Not thread-safe: an episode's steps run one after another."""

    def __init__(self, host: SessionHost):
        self.host = host
        self._run: Any = None
        self._buf = bytearray()      # the result channel, across cells
        self._started = False
        self._cells = 0
        self._probes = 0             # the harness's running total at the last cell

    @property
    def alive(self) -> bool:
        return self._run is not None

    def run(self, code: str) -> CellResult:
        t0 = time.monotonic()
        if self._run is None:
            running = self.host.launch()
            if isinstance(running, Execution):
                return CellResult(error=f"the sandbox failed to start ({running.error})", reset=True)
            self._run, self._buf, self._started, self._cells, self._probes = running, bytearray(), False, 0, 0
        body = code.encode("utf-8", errors="replace")
        try:
            self._run.proc.stdin.write(b"%08x\n" % len(body) + body)
            self._run.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._kill()
            return CellResult(error="the session had ended; it was reset", reset=True)
        out = self._read_cell(self._cells, t0)
        self._cells += 1
        return out

    def _read_cell(self, k: int, t0: float) -> CellResult:
        run, limits = self._run, self.host.limits
        deadline = t0 + limits.timeout_s
        proc = run.proc
        streams = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
        sel = selectors.DefaultSelector()
        for fd in (*streams, run.result_r, *run.extra_fds):
            sel.register(fd, selectors.EVENT_READ)
        done = timed_out = exceeded = died = False
        try:
            while not (done or exceeded or died):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                for key, _ in sel.select(remaining):
                    chunk = os.read(key.fd, 65536)
                    if key.fd in run.extra_fds:
                        if chunk:
                            run.extra_fds[key.fd](chunk)
                        else:
                            sel.unregister(key.fd)
                        continue
                    if not chunk:  # a stream closed: the interpreter is gone
                        died = True
                        break
                    if key.fd == run.result_r:
                        self._buf += chunk
                        done = (b'{"cell_done":%d' % k) in self._buf
                        exceeded = exceeded or len(self._buf) > limits.output_bytes
                    else:
                        streams[key.fd] += chunk
                        exceeded = exceeded or len(streams[key.fd]) > limits.output_bytes
                    if done or exceeded:
                        break
            if done:  # what the cell flushed before `cell_done` is in the pipes already
                for fd in streams:
                    os.set_blocking(fd, False)
                    try:
                        while len(streams[fd]) <= limits.output_bytes and (chunk := os.read(fd, 65536)):
                            streams[fd] += chunk
                    except BlockingIOError:
                        pass
                    finally:
                        os.set_blocking(fd, True)
                    exceeded = exceeded or len(streams[fd]) > limits.output_bytes
        finally:
            sel.close()
        records = self._records()
        stdout = bytes(streams[proc.stdout.fileno()][: limits.output_bytes]).decode("utf-8", errors="replace")
        probes = self._probe_delta(records)
        elapsed = time.monotonic() - t0
        if timed_out or exceeded or died or not self._started:
            self._kill()
            why = (f"timed out after {limits.timeout_s:g} s" if timed_out else
                   f"output over the {limits.output_bytes}-byte limit" if exceeded else
                   "the interpreter ended (exit, crash or CPU-time limit)")
            return CellResult(stdout, f"{why}; the session was reset: variables and definitions are gone",
                              reset=True, timed_out=timed_out, output_exceeded=exceeded, probes=probes,
                              elapsed_s=elapsed)
        errors = [r for r in records if r.get("cell") == k and ("error" in r or "memory" in r)]
        error = None
        if errors:
            error = "MemoryError (memory limit)" if "memory" in errors[0] else str(errors[0]["error"])[:500]
        return CellResult(stdout, error, probes=probes, elapsed_s=elapsed)

    def _records(self) -> list[dict]:
        """Complete records from the channel (the first must be the harness's `started`)."""
        *lines, rest = bytes(self._buf).split(b"\n")
        self._buf = bytearray(rest)
        out = []
        for line in lines:
            if not self._started:
                self._started = line == b'{"started":true}'
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(record, dict):
                out.append(record)
        return out

    def _probe_delta(self, records: list[dict]) -> int:
        """Probes of this cell: the harness's running total at `cell_done`, less the last one seen; a
        cell that never reached `cell_done` counts its probe records."""
        totals = [r["probes"] for r in records if "cell_done" in r and type(r.get("probes")) is int]
        if totals:
            delta, self._probes = max(0, totals[-1] - self._probes), totals[-1]
            return delta
        return sum(1 for r in records if "probe" in r)

    def _kill(self) -> None:
        run, self._run = self._run, None
        if run is None:
            return
        try:
            run.kill()
            try:
                run.proc.wait(timeout=5)
            except Exception:  # noqa: BLE001 — reported by the backend's checks; never hang here
                pass
            for f in (run.proc.stdin, run.proc.stdout, run.proc.stderr):
                try:
                    f.close()
                except OSError:
                    pass
        finally:
            run.close()

    def close(self) -> None:
        """End the interpreter (if one runs) and leave the host's list. Safe to call twice."""
        self._kill()
        self.host.forget(self)
