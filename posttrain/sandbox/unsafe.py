"""The `unsafe-subprocess` backend: the same harness and verdicts, with no isolation at all.

For hosts without bubblewrap or user namespaces, and only when the user selects it by name. The
candidate runs as the caller, sees the whole filesystem, the network, the caller's files and (via
/proc) other processes; rlimits (which root ignores for processes) and a process-group kill on the
timeout are all it gets. Every run warns, loudly: this is not a sandbox.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from posttrain.sandbox.execution import HARNESS_SOURCE, Execution, Job, Limits, collect, job_spec

log = logging.getLogger(__name__)


class UnsafeSandboxWarning(UserWarning):
    """Model-written code is running without isolation."""


# Shown every time, not once per call site: the user must not forget this is on.
warnings.filterwarnings("always", category=UnsafeSandboxWarning)

WARNING = ("UNSAFE: running model-written code WITHOUT a sandbox (backend 'unsafe-subprocess'): it can "
           "read and write your files, reach the network and signal your processes. Use the "
           "'bubblewrap' backend on any machine you care about.")


class UnsafeSubprocessSandbox:
    name = "unsafe-subprocess"

    def __init__(self, python: str | None = None) -> None:
        self.python = str(Path(python or sys.executable).resolve())
        self.warn()

    @staticmethod
    def warn() -> None:
        log.warning(WARNING)
        warnings.warn(WARNING, UnsafeSandboxWarning, stacklevel=3)

    def run(self, job: Job, limits: Limits) -> Execution:
        running = self.start(job, limits)
        if isinstance(running, Execution):
            return running
        try:
            with running.proc:
                ex = collect(running.proc, running.result_r, limits, running.start, running.kill,
                             kill_when_done=True)
            running.finish(ex)
            return ex
        finally:
            running.close()

    def start(self, job: Job, limits: Limits, *, stdin_pipe: bool = False) -> UnsafeRunning | Execution:
        """Launch `job`; the caller reads the handle and `close()`s it (see BubblewrapSandbox.start)."""
        tmp = tempfile.TemporaryDirectory(prefix="posttrain-unsafe-")
        work = Path(tmp.name)
        (work / "harness.py").write_bytes(HARNESS_SOURCE)
        stdin_path = None
        if job.kind == "stdio":
            stdin_path = str(work / "stdin")
            (work / "stdin").write_text(job.stdin)
        (work / "spec.marshal").write_bytes(job_spec(job, limits, stdin_path))
        result_r, result_w = os.pipe()
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                [self.python, "-I", "-S", "-B", str(work / "harness.py"), str(result_w),
                 str(work / "spec.marshal")], cwd=work, env={},
                stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(result_w,),
                start_new_session=True)
        except OSError as e:
            os.close(result_r)
            tmp.cleanup()
            return Execution(error=f"could not start the interpreter: {e}")
        finally:
            os.close(result_w)
        return UnsafeRunning(proc, result_r, start, tmp)


class UnsafeRunning:
    """A launched unsafe run: the process, the result channel's read end; `kill` ends its process group."""

    extra_fds: dict = {}

    def __init__(self, proc: subprocess.Popen, result_r: int, start: float, tmp: tempfile.TemporaryDirectory):
        self.proc, self.result_r, self.start, self.tmp = proc, result_r, start, tmp

    def kill(self) -> None:
        _killpg(self.proc.pid)

    def finish(self, ex: Execution) -> None:
        if not ex.started and ex.error is None:
            ex.error = f"the harness did not start: {ex.stderr.decode(errors='replace')[:2000]}"

    def close(self) -> None:
        try:
            os.close(self.result_r)
        except OSError:
            pass
        _killpg(self.proc.pid)  # whatever of the group is left; `setsid` escapes this, hence "unsafe"
        self.tmp.cleanup()


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
