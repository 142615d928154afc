"""Adversarial tests of the bubblewrap sandbox: one per property of issue 8.

Each test runs a real attack and asserts the verdict and the elapsed time; the autouse `host_guard`
fixture then asserts that the host is intact (planted canaries unchanged, this process can still
fork) and that no sandbox process survives (nothing left in another PID namespace, no leftover
pids cgroup). Limits are short (1.5 s wall) to keep the file fast.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import socket
import subprocess
import textwrap
import uuid
from pathlib import Path

import psutil
import pytest

from posttrain.sandbox import (
    Job,
    Limits,
    SandboxUnavailable,
    Status,
    judge_programs,
    judge_stdio,
    open_sandbox,
    parse_tests,
)
from posttrain.sandbox.bubblewrap import BubblewrapSandbox

TIMEOUT = 1.5
LIMITS = Limits(timeout_s=TIMEOUT, memory_bytes=512 << 20, output_bytes=64 << 10, processes=16)
SLACK = 1.5  # seconds of start-up / kill latency allowed on a loaded 2-core host


@pytest.fixture(scope="module")
def pool():
    try:
        p = open_sandbox("bubblewrap", limits=LIMITS, concurrency=2)
    except SandboxUnavailable as e:  # the sandbox *is* the thing under test: no silent skip
        pytest.fail(f"bubblewrap sandbox unavailable here: {e}")
    yield p
    p.close()


# ---- host guard -----------------------------------------------------------------------------------

def _own_pidns() -> str:
    return os.readlink("/proc/self/ns/pid")


def foreign_pidns_processes() -> list[tuple[int, str]]:
    """Processes living in a PID namespace other than ours: only sandboxes make those here."""
    own, out = _own_pidns(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns" / "pid") != own:
                out.append((int(entry.name), (entry / "cmdline").read_bytes()[:80].decode(errors="replace")))
        except OSError:
            continue
    return out


def leftover_cgroups() -> list[str]:
    roots = [Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")]
    return [str(p) for r in roots if r.is_dir() for p in r.glob("posttrain-*")]


def visible_canary_dir() -> Path | None:
    """A directory inside the sandbox's read-only /usr that this test may write to (root on CI)."""
    for parent in (Path("/usr/local/share"), Path("/usr/share")):
        if os.access(parent, os.W_OK):
            return parent
    return None


@pytest.fixture(scope="module")
def canaries(tmp_path_factory):
    """World-writable canary files: only the sandbox's mounts can stop a write to them."""
    hidden = tmp_path_factory.mktemp("canary") / "canary.txt"  # host /tmp: not mounted in the sandbox
    paths = [hidden]
    visible_dir = None
    if (parent := visible_canary_dir()) is not None:
        visible_dir = parent / f"posttrain-canary-{uuid.uuid4().hex[:8]}"
        visible_dir.mkdir()
        visible_dir.chmod(0o777)
        paths.append(visible_dir / "canary.txt")  # under /usr: visible, read-only in the sandbox
    for p in paths:
        p.write_text("canary\n")
        p.chmod(0o666)
    yield paths
    if visible_dir is not None:
        shutil.rmtree(visible_dir)


@pytest.fixture(autouse=True)
def host_guard(canaries):
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in canaries}
    yield
    survivors = foreign_pidns_processes()
    assert survivors == [], f"sandbox processes survived the run: {survivors}"
    assert leftover_cgroups() == []
    for p, (data, mtime) in before.items():
        assert (p.read_bytes(), p.stat().st_mtime_ns) == (data, mtime), f"canary {p} changed"
        assert sorted(os.listdir(p.parent)) == ["canary.txt"], f"files appeared beside {p}"
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork


def calls(pool, code: str, asserts: list[str], setup: str = "", limits: Limits | None = None):
    return judge_programs(pool, [(textwrap.dedent(code), parse_tests(asserts), setup)], limits)[0]


def stdio(pool, code: str, cases: list[tuple[str, str]]):
    tests = parse_tests([{"stdin": i, "stdout": o} for i, o in cases])
    return judge_programs(pool, [(textwrap.dedent(code), tests, "")])[0]


# ---- correct, slow, looping -----------------------------------------------------------------------

def test_correct_solutions_pass(pool):
    v = calls(pool, "def add(a, b):\n    return a + b", ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"])
    assert (v.status, v.passed, v.reward) == (Status.PASS, 2, 1.0)
    assert v.elapsed_s < TIMEOUT
    v = stdio(pool, "print(sum(map(int, input().split())))", [("1 2\n", "3\n"), ("40 2\n", "42\n")])
    assert (v.status, v.passed, v.reward) == (Status.PASS, 2, 1.0)


def test_slow_but_correct_is_a_timeout_not_a_pass(pool):
    v = calls(pool, """
        import time
        def add(a, b):
            time.sleep(3)  # correct, but twice the 1.5 s limit
            return a + b
    """, ["assert add(1, 2) == 3"])
    assert (v.status, v.reward) == (Status.TIMEOUT, 0.0)
    assert TIMEOUT <= v.elapsed_s < TIMEOUT + SLACK


def test_infinite_loop_times_out(pool):
    v = calls(pool, "def f():\n    while True:\n        pass", ["assert f() == 1"])
    assert (v.status, v.reward) == (Status.TIMEOUT, 0.0)
    assert TIMEOUT <= v.elapsed_s < TIMEOUT + SLACK


def test_ignoring_sigalrm_and_itimers_does_not_stop_the_wall_timeout(pool):
    v = calls(pool, """
        import signal
        for s in (signal.SIGALRM, signal.SIGVTALRM, signal.SIGPROF, signal.SIGTERM, signal.SIGINT,
                  signal.SIGXCPU, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        def f():
            while True:
                pass
    """, ["assert f() == 1"])
    assert v.status is Status.TIMEOUT and v.reward == 0.0
    assert TIMEOUT <= v.elapsed_s < TIMEOUT + SLACK


def test_blocking_on_stdin_gets_eof_not_a_hang(pool):
    # stdin is the case's input then EOF (function tests: /dev/null): a read cannot block.
    v = stdio(pool, "import sys\ndata = sys.stdin.read()\nprint(len(data))\ninput()", [("abc\n", "4\n")])
    assert v.status is Status.RUNTIME_ERROR and v.reward == 0.0  # the second read: EOFError
    assert v.elapsed_s < TIMEOUT
    v = calls(pool, "import sys\ndef f():\n    return sys.stdin.read()", ["assert f() == 'x'"])
    assert v.status is Status.FAIL and v.elapsed_s < TIMEOUT  # read '' at once


@pytest.mark.parametrize("block", ["time.sleep(100)", "signal.pause()", "select.select([], [], [])",
                                   "threading.Event().wait()"])
def test_blocking_on_sleep_times_out(pool, block):
    v = calls(pool, f"import time, signal, select, threading\ndef f():\n    {block}", ["assert f() is None"])
    assert (v.status, v.reward) == (Status.TIMEOUT, 0.0)
    assert TIMEOUT <= v.elapsed_s < TIMEOUT + SLACK


# ---- processes -----------------------------------------------------------------------------------

def test_fork_bomb_is_capped_and_the_host_can_still_fork(pool):
    v = stdio(pool, """
        import os, time
        hit = False
        while True:
            try:
                os.fork()
            except OSError as e:
                if not hit:
                    hit = True
                    print("capped", e.errno, flush=True)
                time.sleep(0.01)
    """, [("", "never")])
    # Each forked copy prints once when the cap stops it; the run ends on the wall clock.
    assert v.status is Status.TIMEOUT and v.reward == 0.0
    assert TIMEOUT <= v.elapsed_s < TIMEOUT + SLACK
    # while the bomb ran, other work on the host went on: a fresh sandbox works right after
    assert calls(pool, "def f():\n    return 1", ["assert f() == 1"]).status is Status.PASS


def test_fork_cap_reports_eagain_inside(pool):
    # The cap itself, observed from inside: 16 processes = the harness + 15 children; fork 16 fails.
    v = calls(pool, """
        import os, errno
        def f():
            kids = 0
            try:
                for _ in range(100):
                    if os.fork() == 0:
                        import time; time.sleep(30)
                    kids += 1
            except OSError as e:
                return (kids, e.errno)
            return (kids, 0)
    """, [f"assert f() == (15, {errno.EAGAIN})"])
    assert v.status is Status.PASS, v.detail  # f() made 15 children, then EAGAIN (errno 11)
    assert v.elapsed_s < TIMEOUT


@pytest.mark.parametrize("with_cgroup", [True, False])
def test_double_fork_and_setsid_do_not_escape(pool, with_cgroup, monkeypatch):
    # Without the cgroup safety net too: the PID namespace alone must take the daemon down.
    if not with_cgroup:
        backend = pool.backend
        assert isinstance(backend, BubblewrapSandbox)
        monkeypatch.setattr(backend, "support", dataclasses.replace(backend.support, cgroup_pids=None))
    v = stdio(pool, """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                for fd in range(0, 64):
                    try: os.close(fd)
                    except OSError: pass
                time.sleep(60)  # the daemon: would outlive the run if anything leaked
            os._exit(0)
        os.wait()
        print(42)
    """, [("", "42\n")])
    assert (v.status, v.reward) == (Status.PASS, 1.0)  # a correct answer; the daemon is its own business
    assert v.elapsed_s < TIMEOUT  # the daemon does not hold the run open
    # host_guard: nothing in another PID namespace survives


def test_killing_the_parent_or_its_process_group_fails(pool):
    me, group = os.getpid(), os.getpgid(0)
    v = calls(pool, f"""
        import os, signal
        def f():
            for attempt in (lambda: os.kill({me}, signal.SIGKILL),
                            lambda: os.killpg({group}, signal.SIGKILL),
                            lambda: os.kill(os.getppid(), signal.SIGKILL),
                            lambda: os.kill(1, signal.SIGKILL)):
                try:
                    attempt()
                except OSError:
                    pass
            if os.getpid() < 10:  # test-safety only: never broadcast outside a PID namespace
                try:
                    os.kill(-1, signal.SIGKILL)
                except OSError:
                    pass
            return 1
    """, ["assert f() == 2"])
    assert psutil.pid_exists(me) and os.getpgid(0) == group  # we are still here
    assert v.status in (Status.FAIL, Status.RUNTIME_ERROR) and v.reward == 0.0
    assert v.elapsed_s < TIMEOUT + SLACK


# ---- memory and output ---------------------------------------------------------------------------

def test_huge_allocation_is_a_memory_verdict_and_the_parent_is_unchanged(pool):
    rss = psutil.Process().memory_info().rss
    v = calls(pool, "def f():\n    return len(bytearray(8 << 30))", ["assert f() == 8589934592"])
    assert (v.status, v.reward) == (Status.MEMORY, 0.0)
    assert v.elapsed_s < TIMEOUT
    small = Limits(timeout_s=TIMEOUT, memory_bytes=128 << 20)  # fewer steps to the limit: faster
    v = calls(pool, "def f():\n    xs = []\n    while True:\n        xs.append(bytearray(1 << 20))",
              ["assert f() is None"], limits=small)
    assert v.status is Status.MEMORY and v.elapsed_s < TIMEOUT + SLACK
    assert psutil.Process().memory_info().rss - rss < 32 << 20  # parent grew < 32 MiB, not 512


@pytest.mark.parametrize("stream", ["sys.stdout", "sys.stderr"])
def test_output_flood_is_cut_off(pool, stream):
    rss = psutil.Process().memory_info().rss
    v = calls(pool, f"import sys\ndef f():\n    while True:\n        {stream}.write('x' * 65536)",
              ["assert f() is None"])
    assert (v.status, v.reward) == (Status.OUTPUT_LIMIT, 0.0)
    assert v.elapsed_s < TIMEOUT  # cut at 64 KiB, long before the clock
    assert psutil.Process().memory_info().rss - rss < 32 << 20


def test_filling_the_disk_hits_the_file_size_and_tmpfs_limits(pool):
    # one 64 MiB file > RLIMIT_FSIZE 16 MiB: EFBIG (Python ignores SIGXFSZ, so write() raises)
    v = calls(pool, "def f():\n    open('/tmp/big', 'wb').write(b'x' * (64 << 20))\n    return 1",
              ["assert f() == 1"])
    assert (v.status, v.reward) == (Status.RUNTIME_ERROR, 0.0) and "File too large" in v.detail
    assert v.elapsed_s < TIMEOUT
    # many 15 MiB files: the 64 MiB tmpfs fills after 4 (ENOSPC), host memory is not touched
    v = calls(pool, "def f():\n    for i in range(100):\n"
                    "        open(f'/tmp/f{i}', 'wb').write(b'x' * (15 << 20))",
              ["assert f() is None"])
    assert (v.status, v.reward) == (Status.RUNTIME_ERROR, 0.0) and "No space left" in v.detail
    assert v.elapsed_s < TIMEOUT


# ---- filesystem, secrets, network ----------------------------------------------------------------

def test_writes_outside_the_work_dir_fail(pool, canaries):
    targets = [str(p) for p in canaries]
    v = calls(pool, f"""
        import ctypes, ctypes.util, os, posix
        TARGETS = {targets!r}
        def f():
            done = []
            libc = ctypes.CDLL(None, use_errno=True)
            for t in TARGETS + ["/usr/posttrain-new-file", "/etc/passwd", "/job/spec.marshal"]:
                attempts = {{
                    "open": lambda: open(t, "w").write("pwned"),
                    "posix": lambda: posix.write(posix.open(t, posix.O_WRONLY | posix.O_TRUNC), b"pwned"),
                    "ctypes": lambda: libc.open(t.encode(), 0o1 | 0o1000) >= 0 or 1 / 0,
                    "rename": lambda: os.rename(t, t + ".moved"),
                    "unlink": lambda: os.unlink(t),
                    "chmod": lambda: os.chmod(t, 0o777),
                    "sibling": lambda: open(os.path.join(os.path.dirname(t), "new"), "w").write("x"),
                }}
                for name, attempt in attempts.items():
                    try:
                        attempt()
                        done.append((t, name))
                    except Exception:
                        pass
            return done
    """, ["assert f() == [('x', 'y')]"])
    assert (v.status, v.reward) == (Status.FAIL, 0.0)  # f() returned [] (nothing written)
    assert v.elapsed_s < TIMEOUT
    # host_guard checks every canary and its directory


def test_secrets_in_the_parents_environment_and_home_stay_out(pool, tmp_path, monkeypatch):
    env_secret, home_secret = f"ENV-{uuid.uuid4().hex}", f"HOME-{uuid.uuid4().hex}"
    home = tmp_path / "home"
    home.mkdir()
    (home / ".secret").write_text(home_secret)
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", env_secret)
    monkeypatch.setenv("HOME", str(home))
    code = textwrap.dedent(f"""
        import os, glob
        found = [repr(dict(os.environ)), os.path.expanduser("~")]
        for pattern in ({str(home)!r} + "/*", os.path.expanduser("~") + "/**", "/root/**", "/home/**",
                        "/proc/*/environ", "/proc/*/cmdline", "/job/*", "/run/**", "/tmp/**"):
            for p in glob.glob(pattern, recursive=True):
                try:
                    found.append(open(p, "rb").read(100000).decode("latin-1"))
                except Exception:
                    pass
        print("\\n".join(found))
    """)
    ex = pool.run(Job(code))
    v = judge_stdio(ex, "secrets")
    assert v.status is Status.FAIL and v.reward == 0.0  # it ran to the end, printed what it found
    assert v.elapsed_s < TIMEOUT
    everything = ex.stdout + ex.stderr + repr(ex.records).encode()
    assert b"PWD=/tmp" in ex.stdout and b"def main():" in ex.stdout  # it did read environ and /job
    for secret in (env_secret, home_secret):
        assert secret.encode() not in everything
    # the environment: bwrap's PWD for --chdir, and the LC_CTYPE Python sets itself (PEP 538)
    assert ex.stdout.split(b"\n")[0] == b"{'PWD': '/tmp', 'LC_CTYPE': 'C.UTF-8'}"


def test_searching_the_filesystem_for_the_tests_finds_nothing(pool):
    expected = f"EXPECTED-{uuid.uuid4().hex}"
    v = calls(pool, """
        import os, re, stat, sys
        PATTERN = re.compile(rb"EXPECTED-[0-9a-f]{32}")
        SKIP = ("/usr", sys.base_prefix, "/proc/sys", "/proc/self/task", "/proc/1/task", "/proc/2")
        def f():  # every regular file outside the OS image and the interpreter, our /proc included
            for root in ("/job", "/tmp", "/dev/shm", "/proc/self", "/"):
                for d, dirs, files in os.walk(root):
                    if d.startswith(SKIP):
                        dirs[:] = []
                        continue
                    for name in files:
                        path = os.path.join(d, name)
                        try:
                            if not stat.S_ISREG(os.lstat(path).st_mode):
                                continue  # a pipe or a tty would block the read
                            m = PATTERN.search(open(path, "rb").read(1 << 20))
                        except Exception:
                            continue
                        if m:
                            return m.group().decode()
            return "not found"
    """, [f"assert f() == {expected!r}"], limits=Limits(timeout_s=8))  # the walk takes ~2 s
    assert (v.status, v.reward) == (Status.FAIL, 0.0)  # the search finished and found nothing
    assert v.elapsed_s < 8


def test_no_connection_to_a_listener_on_the_host(pool):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("0.0.0.0", 0))
    server.listen(8)
    server.setblocking(False)
    port = server.getsockname()[1]
    host_ips = sorted({a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                       if a.family == socket.AF_INET})
    try:
        v = calls(pool, f"""
            import socket
            def f():
                reached = []
                for ip in {host_ips!r} + ["127.0.0.1"]:
                    try:
                        socket.create_connection((ip, {port}), timeout=0.3).sendall(b"hi")
                        reached.append(ip)
                    except OSError:
                        pass
                return reached
        """, [f"assert f() == {host_ips!r}"])
        assert (v.status, v.reward) == (Status.FAIL, 0.0)  # f() reached nothing: []
        assert v.elapsed_s < TIMEOUT + SLACK
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected
    finally:
        server.close()


def test_isolation_facts_inside(pool):
    v = calls(pool, """
        import os, socket
        def f():
            status = open("/proc/self/status").read()
            return {
                "uid": os.getuid(), "pid": os.getpid(), "host": socket.gethostname(),
                "caps": status.split("CapEff:")[1].split()[0],
                "dev": sorted(os.listdir("/dev")),
                "sys": os.path.exists("/sys/class"), "etc": os.path.exists("/etc/passwd"),
                "ifaces": sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:]),
                "cwd": os.getcwd(), "tmp_writable": os.access("/tmp", os.W_OK),
                "usr_writable": os.access("/usr", os.W_OK),
            }
    """, ["assert f() == {'uid': 65534, 'pid': 1, 'host': 'sandbox', 'caps': '0000000000000000', "
          # bwrap's minimal /dev: no GPU nodes (nvidia*, dri), nor the host's kvm, vda, fuse, …
          "'dev': ['core', 'fd', 'full', 'null', 'ptmx', 'pts', 'random', 'shm', 'stderr', 'stdin', "
          "'stdout', 'tty', 'urandom', 'zero'], 'sys': False, 'etc': False, 'ifaces': ['lo'], 'cwd': '/tmp', "
          "'tmp_writable': True, 'usr_writable': False}"])
    assert v.status is Status.PASS, v.detail
    assert v.elapsed_s < TIMEOUT


# ---- forging the verdict -------------------------------------------------------------------------

@pytest.mark.parametrize("early_exit", [
    "import sys\nsys.exit(0)",
    "import os\nos._exit(0)",
    "raise SystemExit",
    "import atexit, os\natexit.register(lambda: os._exit(0))\nraise SystemExit(0)",
    "import atexit, sys\natexit.register(lambda: print('all tests passed'))\nsys.exit(0)",
])
def test_exiting_before_the_tests_run_scores_zero(pool, early_exit):
    v = calls(pool, early_exit + "\ndef add(a, b):\n    return a + b\n", ["assert add(1, 2) == 3"])
    assert v.status is Status.RUNTIME_ERROR and v.reward == 0.0
    assert v.elapsed_s < TIMEOUT


def test_writing_into_the_parents_stdout_via_proc_scores_zero(pool, capfd):
    marker = f"FORGED-{uuid.uuid4().hex}"
    me = os.getpid()
    v = calls(pool, f"""
        import os
        for target in ("/proc/{me}/fd/1", "/proc/{me}/fd/2", "/proc/1/fd/1", "/proc/1/fd/2",
                       "/proc/self/fd/1", "/dev/tty", "/proc/{me}/fd/0"):
            try:
                with open(target, "w") as fh:
                    fh.write("{marker} PASS\\n")
            except OSError:
                pass
        for fd in range(3, 64):  # and into every inherited descriptor, the result channel included
            try:
                os.write(fd, b'{marker}\\n{{"i":0,"value":3}}\\n{{"done":true}}\\n')
            except OSError:
                pass
        os._exit(0)
    """, ["assert add(1, 2) == 3"])
    out, err = capfd.readouterr()
    assert marker not in out + err  # our stdout/stderr untouched
    assert (v.status, v.reward) == (Status.FAIL, 0.0)  # garbage in the channel → tampered → fail
    assert v.elapsed_s < TIMEOUT


def test_printing_part_of_or_more_than_the_expected_output_scores_zero(pool):
    expected = "1\n2\nFizz\n"
    first_line = stdio(pool, "print(1)", [("3\n", expected)])
    plus_junk = stdio(pool, "print('1\\n2\\nFizz\\nBuzz')", [("3\n", expected)])
    exact = stdio(pool, "print('1\\n2\\nFizz')", [("3\n", expected)])
    assert (first_line.status, plus_junk.status, exact.status) == (Status.FAIL, Status.FAIL, Status.PASS)
    assert (first_line.reward, plus_junk.reward) == (0.0, 0.0)
    assert max(first_line.elapsed_s, plus_junk.elapsed_s) < TIMEOUT


@pytest.mark.parametrize("trick", [
    "class Always:\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n"
    "def f():\n    return Always()",
    "class Int(int):\n    def __eq__(self, other): return True\n    __hash__ = int.__hash__\n"
    "def f():\n    return Int(7)",
    "class Str(str):\n    def __eq__(self, other): return True\n    __hash__ = str.__hash__\n"
    "def f():\n    return Str('x')",
    "class Truthy:\n    def __bool__(self): return True\n    def __eq__(self, o): return True\n"
    "def f():\n    return [Truthy()]",
])
def test_an_object_that_equals_everything_fails(pool, trick):
    v = calls(pool, trick, ["assert f() == 3"])
    assert v.status is Status.RUNTIME_ERROR and v.reward == 0.0  # "Unserializable" for that call
    assert "Unserializable" in v.detail
    assert v.elapsed_s < TIMEOUT


def test_truthiness_is_judged_on_plain_data(pool):
    v = calls(pool, "class T:\n    def __bool__(self): return True\ndef ok():\n    return T()",
              ["assert ok()"])
    assert v.status is Status.RUNTIME_ERROR and v.reward == 0.0


def test_monkeypatching_assert_helpers_changes_nothing(pool):
    v = calls(pool, """
        import builtins, math, operator, sys, unittest
        builtins.AssertionError = type("Nothing", (Exception,), {})
        unittest.TestCase.assertEqual = lambda *a, **k: None
        operator.eq = lambda a, b: True
        math.isclose = lambda *a, **k: True
        harness = sys.modules["__main__"]
        harness.matches = lambda *a: True        # the parent's name for the check: not here
        harness.encode = lambda value, depth=0: value
        def add(a, b):
            return a - b
    """, ["assert add(1, 2) == 3", "assert math.isclose(add(1, 1), 2.0)"])
    assert (v.status, v.passed, v.reward) == (Status.FAIL, 0, 0.0)  # add(1,2) = -1, add(1,1) = 0
    assert v.elapsed_s < TIMEOUT


# ---- sandbox errors are not wrong answers --------------------------------------------------------

def test_a_broken_sandbox_is_a_sandbox_error_with_reward_none(pool, monkeypatch):
    backend = pool.backend
    monkeypatch.setattr(backend, "python", "/nonexistent/python3")
    v = calls(pool, "def f():\n    return 1", ["assert f() == 1"])
    assert (v.status, v.reward) == (Status.SANDBOX_ERROR, None)
    assert "did not start" in v.detail
    assert v.elapsed_s < TIMEOUT


@pytest.mark.parametrize("fake", [
    "import os, sys\nsys.stderr.write('bwrap: Can\\'t mount proc\\n')\nos._exit(1)",
    "import os\nos._exit(125)",
    "import os, signal\nos.kill(1, signal.SIGKILL)\nos.kill(os.getpid(), signal.SIGKILL)",
])
def test_the_candidate_cannot_forge_a_sandbox_error(pool, fake):
    v = calls(pool, fake, ["assert f() == 1"])
    assert v.status is Status.RUNTIME_ERROR and v.reward == 0.0  # judged, not skipped
    assert v.elapsed_s < TIMEOUT


def test_refuses_with_the_reason_when_bwrap_is_missing(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="unsafe-subprocess"):
        BubblewrapSandbox()
