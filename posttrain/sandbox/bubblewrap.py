"""The bubblewrap backend: each run in fresh namespaces, on a read-only root, with a private tmpfs.

bubblewrap (https://github.com/containers/bubblewrap) builds the sandbox; this module decides its
shape and owns its lifetime. Per run:

- namespaces: user, PID, network, IPC, UTS, cgroup (`--unshare-all`), a new session
  (`--new-session`: no TIOCSTI into the caller's terminal), `--die-with-parent`, and no nested user
  namespaces (`--disable-userns`);
- filesystem: an empty tmpfs root holding only `/usr` and the interpreter's prefix, read-only (plus
  the `/bin`, `/lib*` links or binds), a fresh `/proc` of the new PID namespace, a minimal `/dev`
  (null, zero, random, tty … — no GPU nodes), a size-capped private tmpfs `/tmp` as the work
  directory, and the job under `/job`, read-only. No `/home`, `/etc`, `/sys`, `/run`, `/tmp` of the
  host, and of `/root` only the interpreter's prefix if it lives there (pyenv);
- environment: empty (`--clearenv`); uid/gid 65534 inside;
- limits: RLIMIT_AS / CPU / FSIZE / NOFILE / NPROC / CORE set by the harness, hard == soft;
  a cgroup `pids.max` when a writable pids controller exists — the only process cap that holds when
  the caller is root, since the kernel exempts a real uid of 0 from RLIMIT_NPROC;
- lifetime: the harness runs as the namespace's PID 1 (`--as-pid-1`); the parent reads its pid
  from `--info-fd`. Killing that one process makes the kernel kill every process in the PID
  namespace, `setsid` or not, and bwrap returns only once all of them are gone and reaped.

Departures from a textbook container:
1. No seccomp filter: the kernel's syscall surface is reachable (see docs/sandbox.md).
2. No memory cgroup: memory is capped per process by RLIMIT_AS and for files by the tmpfs size, not
   as a sum over the sandbox's processes (at most `processes × memory_bytes`).
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from posttrain.sandbox.execution import HARNESS_SOURCE, Execution, Job, Limits, collect, job_spec, wait_exit

SANDBOX_UID = 65534  # "nobody" inside the user namespace
PROCESS_OVERHEAD = 1  # bwrap itself (the shell exec'd into it) is in the cgroup but not the sandbox
# After SIGKILL, PID 1 exits once the namespace is empty and its mounts are torn down: 2.5 s measured
# for a tmpfs of ~5·10^5 directories on a loaded 2-core host. We wait for it (see `_SandboxInit.kill`);
# the limit only bounds a kernel that never lets it exit.
REAP_LIMIT_S = 300.0
BWRAP_EXIT_S = 5.0  # bwrap exits right after it reaps PID 1


class SandboxUnavailable(RuntimeError):
    """bubblewrap or a property the sandbox needs is missing on this host."""


@dataclass(frozen=True)
class HostSupport:
    """What this host lets the sandbox enforce, found by `probe` (each entry was tried, not assumed)."""

    bwrap: str  # path of the bwrap binary
    version: str
    disable_userns: bool  # bwrap knows --disable-userns (≥ 0.8)
    cgroup_pids: Path | None  # parent directory for per-run pids cgroups, None if none is writable
    caller_is_root: bool

    @property
    def process_cap(self) -> str | None:
        """How the process count is capped: 'cgroup', 'rlimit', or None (not capped)."""
        if self.cgroup_pids is not None:
            return "cgroup"
        return None if self.caller_is_root else "rlimit"


def _pids_cgroup_parent() -> Path | None:
    """A directory under which we may create pids cgroups: ours, in v1 or v2. None if not writable."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            candidates.append(Path("/sys/fs/cgroup/pids") / path.lstrip("/"))
        elif controllers == "":  # v2: the pids controller must already be enabled for children
            candidates.append(Path("/sys/fs/cgroup") / path.lstrip("/"))
    for parent in candidates:
        probe = parent / f"posttrain-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            probe.mkdir()
        except OSError:
            continue
        try:
            ok = (probe / "pids.max").exists() and (probe / "cgroup.procs").exists()
            if ok:
                (probe / "pids.max").write_text("8")
        except OSError:
            ok = False
        finally:
            try:
                probe.rmdir()
            except OSError:
                pass
        if ok:
            return parent
    return None


def probe(python: str) -> HostSupport:
    """Find bwrap and check, by running it, that it can build the sandbox here. Raises
    SandboxUnavailable with the reason and the fix."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "code rewards need bubblewrap, and `bwrap` is not on PATH. Install it "
            "(Debian/Ubuntu: `apt-get install -y bubblewrap`), or select the `unsafe-subprocess` "
            "backend explicitly if you accept running model-written code without isolation.")
    version = subprocess.run([bwrap, "--version"], capture_output=True, text=True, check=False).stdout.strip()
    help_text = subprocess.run([bwrap, "--help"], capture_output=True, text=True, check=False).stdout
    support = HostSupport(bwrap=bwrap, version=version, disable_userns="--disable-userns" in help_text,
                          cgroup_pids=_pids_cgroup_parent(), caller_is_root=os.geteuid() == 0)
    argv = _bwrap_argv(support, python, None) + [python, "-I", "-S", "-c", "print(6 * 7)"]
    try:
        r = subprocess.run(argv, capture_output=True, timeout=30, env={}, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxUnavailable(f"bubblewrap failed to start a sandbox: {e}") from e
    if r.returncode != 0 or r.stdout != b"42\n":
        raise SandboxUnavailable(
            f"bubblewrap ({version}) cannot build the sandbox on this host (exit {r.returncode}): "
            f"{r.stderr.decode(errors='replace').strip()!r}. If that is about namespaces: bwrap "
            "needs user namespaces (user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1 "
            "for non-root callers; on Ubuntu >= 23.10 kernel.apparmor_restrict_unprivileged_userns=0 "
            "or an AppArmor profile for bwrap); inside a container, one that allows them. Or select "
            "the `unsafe-subprocess` backend explicitly.")
    return support


def _bwrap_argv(support: HostSupport, python: str, job_fds: dict[str, int] | None,
                limits: Limits | None = None, info_fd: int | None = None) -> list[str]:
    limits = limits or Limits()
    prefix = Path(python).resolve().parent.parent
    # --as-pid-1: the harness is the namespace's PID 1 and bwrap's direct child, so bwrap reaps it,
    # and the kernel reaps everything else in the namespace first. (bwrap's own PID-1 reaper would
    # report the status and let bwrap exit *before* it is itself gone, leaving a zombie for the
    # host's init — which in a container may never reap it.)
    argv = [support.bwrap, "--unshare-all", "--unshare-user", "--as-pid-1", "--die-with-parent",
            "--new-session", "--clearenv",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox"]
    if support.disable_userns:
        argv += ["--disable-userns"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / top
        if host.is_symlink():
            argv += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            argv += ["--ro-bind", str(host), str(host)]
    if not prefix.is_relative_to("/usr"):
        argv += ["--ro-bind", str(prefix), str(prefix)]
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--size", str(limits.tmpfs_bytes), "--tmpfs", "/tmp", "--chdir", "/tmp"]
    if job_fds is not None:
        argv += ["--dir", "/job"]
        for name, fd in job_fds.items():
            argv += ["--perms", "0444", "--ro-bind-data", str(fd), f"/job/{name}"]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    return argv


class BubblewrapSandbox:
    """Runs jobs under bubblewrap. Thread-safe: each `run` is independent (the pool calls it from
    several threads). `require_process_cap`: refuse to run where no process cap holds (root without
    a writable pids cgroup) instead of running with the PID namespace and the timeout only."""

    name = "bubblewrap"

    def __init__(self, python: str | None = None, *, require_process_cap: bool = True) -> None:
        self.python = str(Path(python or sys.executable).resolve())
        self.support = probe(self.python)
        if self.support.process_cap is None and require_process_cap:
            raise SandboxUnavailable(
                "the caller is root and no pids cgroup is writable here, so nothing caps the number "
                "of processes a sandbox may fork (the kernel exempts uid 0 from RLIMIT_NPROC). Run as "
                "a non-root user, give this process a writable pids cgroup, or pass "
                "require_process_cap=False to rely on the PID namespace and the wall timeout alone.")
        # One real job through the whole path (memfd binds, info fd, cgroup, harness): a host where
        # any of it fails refuses here, instead of answering every later job with a sandbox error.
        ex = self.run(Job("", calls=("6 * 7",)), Limits(timeout_s=30))
        if not (ex.started and {"i": 0, "value": 42} in ex.records):
            raise SandboxUnavailable(f"the sandbox self-test failed: {ex.error or ex}")

    def run(self, job: Job, limits: Limits) -> Execution:
        running = self.start(job, limits)
        if isinstance(running, Execution):
            return running
        try:
            with running.proc:
                ex = collect(running.proc, running.result_r, limits, running.start, running.kill,
                             extra_fds=running.extra_fds)
            running.finish(ex)
            return ex
        finally:
            running.close()

    def start(self, job: Job, limits: Limits, *, stdin_pipe: bool = False) -> Running | Execution:
        """Launch `job` and hand back the running sandbox (the caller reads it and `close()`s it), or
        an Execution with the set-up error. `stdin_pipe`: the parent holds a pipe to the harness's
        stdin (a session's cells) instead of /dev/null."""
        memfds: list[int] = []
        pipes: list[int] = []
        cgroup: Path | None = None
        try:
            data = {"harness.py": HARNESS_SOURCE}
            if job.kind == "stdio":
                data["stdin"] = job.stdin.encode()
            data["spec.marshal"] = job_spec(job, limits, "/job/stdin" if job.kind == "stdio" else None)
            job_fds = {}
            for name, payload in data.items():
                fd = os.memfd_create(f"posttrain-{name}", os.MFD_CLOEXEC)
                memfds.append(fd)
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view):]
                os.lseek(fd, 0, os.SEEK_SET)
                job_fds[name] = fd
            result_r, result_w = os.pipe()
            info_r, info_w = os.pipe()
            pipes += [result_r, result_w, info_r, info_w]
            argv = _bwrap_argv(self.support, self.python, job_fds, limits, info_w)
            argv += [self.python, "-I", "-S", "-B", "/job/harness.py", str(result_w), "/job/spec.marshal"]
            if self.support.cgroup_pids is not None:
                cgroup = self.support.cgroup_pids / f"posttrain-sandbox-{uuid.uuid4().hex}"
                cgroup.mkdir()
                (cgroup / "pids.max").write_text(str(limits.processes + PROCESS_OVERHEAD))
                # The shell joins the cgroup, then becomes bwrap: nothing runs outside it.
                argv = ["/bin/sh", "-c", 'echo $$ > "$0" || exit 125; exec "$@"',
                        str(cgroup / "cgroup.procs")] + argv
            start = time.monotonic()
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        pass_fds=(*memfds, result_w, info_w), start_new_session=True, env={})
            except OSError as e:
                if cgroup is not None:
                    _remove_cgroup(cgroup)
                return Execution(error=f"could not start bubblewrap: {e}")
            for fd in (result_w, info_w, *memfds):
                os.close(fd)
            memfds = []
            running = Running(proc, result_r, start, _SandboxInit(proc), info_r, cgroup)
            pipes, cgroup = [], None  # the handle owns them now
            return running
        except OSError as e:
            return Execution(error=f"sandbox set-up failed: {e}")
        finally:
            for fd in memfds + pipes:
                os.close(fd)
            if cgroup is not None:
                _remove_cgroup(cgroup)


class Running:
    """A launched bubblewrap sandbox: its process, the parent's read end of the result channel, and
    how to end it (`kill`: the whole PID namespace) and release it (`close`: fds, pidfd, cgroup)."""

    def __init__(self, proc: subprocess.Popen, result_r: int, start: float, init: _SandboxInit,
                 info_r: int, cgroup: Path | None):
        self.proc, self.result_r, self.start, self.init = proc, result_r, start, init
        self.info_r, self.cgroup = info_r, cgroup
        self.extra_fds = {info_r: init.feed}

    def kill(self) -> None:
        self.init.kill(self.cgroup)

    def finish(self, ex: Execution) -> None:
        """After `collect`: bwrap has reaped PID 1 (so the namespace is empty) unless it died first."""
        if not self.init.wait_gone(0.0):
            self.init.kill(self.cgroup)
        if self.init.stuck or not self.init.wait_gone(0.0):
            ex.error = f"the sandbox's PID 1 survived SIGKILL for {REAP_LIMIT_S:.0f} s"
        if not ex.started and ex.error is None:
            ex.error = (f"the sandbox did not start (exit {ex.exit_code}): "
                        f"{ex.stderr.decode(errors='replace').strip()[:2000]}")

    def close(self) -> None:
        self.init.close()
        for fd in (self.result_r, self.info_r):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.cgroup is not None:
            _remove_cgroup(self.cgroup)
            self.cgroup = None


class _SandboxInit:
    """The sandbox's PID 1, held by a pidfd from the moment `--info-fd` names it (while it is still
    bwrap's child, so the pid cannot have been recycled). Killing it kills the whole PID namespace."""

    def __init__(self, bwrap: subprocess.Popen) -> None:
        self.bwrap = bwrap
        self.info = bytearray()
        self.pidfd: int | None = None
        self.stuck = False  # PID 1 outlived REAP_LIMIT_S after SIGKILL

    def feed(self, chunk: bytes) -> None:
        self.info += chunk
        if self.pidfd is not None:
            return
        try:
            child = json.loads(bytes(self.info))["child-pid"]
        except (ValueError, KeyError, TypeError):
            return  # not complete yet
        try:
            pidfd = os.pidfd_open(child)
        except OSError:
            return  # gone already
        if _ppid(child) == self.bwrap.pid:
            self.pidfd = pidfd
        else:
            os.close(pidfd)

    def kill(self, cgroup: Path | None) -> None:
        """SIGKILL PID 1 and wait, however long it takes, until it has exited and bwrap has reaped it.

        PID 1 exits only after the kernel has killed every other process of the namespace and torn
        down its mounts; a tmpfs holding a million inodes takes seconds to free. bwrap must be alive
        to reap it: kill bwrap first and PID 1 is orphaned to the host's init — a zombie forever
        under an init that never reaps (a training script as PID 1 of a container). So bwrap itself
        is killed only when it has no child left (PID 1 never started, or is gone and bwrap is
        stuck), or when PID 1 outlives `REAP_LIMIT_S` after SIGKILL (never seen; reported)."""
        if self.pidfd is None and self.bwrap.returncode is None:
            self.adopt_child()
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except OSError:
                pass
            if not self.wait_gone(REAP_LIMIT_S):
                self.stuck = True
            elif self.bwrap.returncode is not None or wait_exit(self.bwrap, BWRAP_EXIT_S):
                return
        if self.bwrap.returncode is None:  # once reaped, its pid (and group id) may be another's
            try:
                os.killpg(self.bwrap.pid, signal.SIGKILL)  # bwrap leads its own session and group
            except OSError:
                pass
        if cgroup is not None:
            _kill_cgroup(cgroup)

    def adopt_child(self) -> None:
        """Find PID 1 without the info fd (not read yet, or bwrap failed before writing it): the
        child of bwrap, held by a pidfd once its parent is checked again (so not a recycled pid)."""
        for pid in _children(self.bwrap.pid):
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue
            if _ppid(pid) == self.bwrap.pid:
                self.pidfd = pidfd
                return
            os.close(pidfd)

    def wait_gone(self, timeout: float) -> bool:
        """True once PID 1 has exited — which the kernel allows only after every other process of
        the namespace is gone."""
        if self.pidfd is None:
            return True
        with selectors.DefaultSelector() as sel:
            sel.register(self.pidfd, selectors.EVENT_READ)
            return bool(sel.select(timeout))

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _children(parent: int) -> list[int]:
    """Pids whose parent is `parent`, from /proc/*/stat (the kernel's `children` file needs
    CONFIG_PROC_CHILDREN, which not every kernel has). Only on the rare path where the info fd
    has not named PID 1."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and _ppid(int(entry.name)) == parent:
            out.append(int(entry.name))
    return out


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _kill_cgroup(cgroup: Path) -> None:
    try:
        pids = (cgroup / "cgroup.procs").read_text().split()
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass


def _remove_cgroup(cgroup: Path) -> None:
    """Remove a run's cgroup; any process still in it is a sandbox straggler and is killed first."""
    delay = 0.0005
    for _ in range(40):  # ≈ 2 s at most; exited tasks leave a cgroup a moment after being reaped
        try:
            cgroup.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            _kill_cgroup(cgroup)
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
