"""The in-sandbox runner: the only trusted code that runs inside the sandbox, before the candidate.

This file is not imported by posttrain. Its *source* is copied into every sandbox (read-only), and it
runs as `python -I -S -B harness.py RESULT_FD SPEC_PATH`, standard library only, Python >= 3.8,
and imports only built-in modules (start-up time is the pool's throughput).

What it does, in order:
1. moves the result channel to a private fd, closes every other inherited fd except 0, 1, 2;
2. reads the job spec (the candidate's source, the calls to make, or the stdin file to attach);
3. applies the resource limits, hard == soft, so the candidate cannot raise them;
4. writes the `started` record — everything after this line is the candidate's responsibility:
   a failure before it is a sandbox error, a failure after it is a verdict;
5. runs the candidate, then each call, writing one JSON record per call to the result channel —
   or, for a session (`kind: session`), reads cells from its private stdin pipe and runs each in one
   namespace kept across cells, writing `{"cell_done": k}` after each;
6. writes `done` and leaves with `os._exit(0)` (so `atexit` handlers the candidate planted never run).

With `audit` in the spec, step 4 first installs an audit hook (PEP 578, `sys.addaudithook`) that
counts the candidate's attempts to look for what it was not given — files outside the interpreter's
and its own directories, directory listings there, its caller's frames, the garbage collector's
object lists, tracing hooks, the environment — writing a `{"probe": kind, "what": …}` record for each
of the first 16 *when the event happens* (before the call returns anything), and `{"probes": n}` at
the end. Hooks cannot be removed, and the record is written before the candidate gets what it asked
for; a candidate that later takes over this process can stop the final count, not the records
already written. It is a counter, not a wall: the isolation is the sandbox's.

Nothing here decides a verdict. The expected outputs are not in the spec and never enter the
sandbox; the parent compares. The candidate runs in this same interpreter and can tamper with this
module — that only lets it choose which values get reported, which it could do anyway by returning
them, and it cannot learn the expected values to choose.

Values are reported as tagged plain data (`encode`), and only the exact built-in types are accepted
(`type(x) is int`, never `isinstance`): an object with a custom `__eq__`, or a subclass of a built-in,
is unserializable, and that call fails.
"""

import builtins
import marshal
import math
import os
import resource
import sys

try:  # the C string encoder of the json package: `import json` itself costs ~11 ms (it imports re)
    from _json import encode_basestring_ascii as quote
except ImportError:  # pragma: no cover - CPython always has it
    from json import dumps as quote

MAX_DEPTH = 64


class Unserializable(Exception):
    pass


def encode(value, depth=0):
    """Plain data → JSON-able, tagged so the parent can rebuild the exact built-in type."""
    if depth > MAX_DEPTH:
        raise Unserializable("nested deeper than %d" % MAX_DEPTH)
    t = type(value)
    if value is None or t is bool or t is int or t is str:
        return value
    if t is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if t is list:
        return [encode(v, depth + 1) for v in value]
    if t is tuple:
        return {"tuple": [encode(v, depth + 1) for v in value]}
    if t is set or t is frozenset:
        return {t.__name__: [encode(v, depth + 1) for v in value]}
    if t is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if t is complex:
        return {"complex": [encode(value.real, depth + 1), encode(value.imag, depth + 1)]}
    if t is bytes:
        return {"bytes": value.hex()}
    raise Unserializable("a %s is not plain data" % t.__name__)


def to_json(x):
    """JSON text of a record: dicts with str keys, lists, str, int, finite float, bool, None."""
    t = type(x)
    if x is None:
        return "null"
    if t is bool:
        return "true" if x else "false"
    if t is int:
        return int.__repr__(x)  # ValueError past 4300 digits: that call then fails
    if t is float:
        return float.__repr__(x)  # finite here: encode() tags nan / inf
    if t is str:
        return quote(x)
    if t is list:
        return "[" + ",".join([to_json(v) for v in x]) + "]"
    if t is dict:
        return "{" + ",".join([quote(k) + ":" + to_json(v) for k, v in x.items()]) + "}"
    raise Unserializable("a %s in a record" % t.__name__)


def dumps(record):
    return (to_json(record) + "\n").encode()


def describe(exc):
    try:
        text = str(exc)[:500]
    except BaseException:  # a candidate's exception may make even str() raise
        text = "<unprintable>"
    return "%s: %s" % (type(exc).__name__, text)


def main():
    result_fd = int(sys.argv[1])
    spec_path = sys.argv[2]
    # 1. The result channel lives on a fresh fd; nothing else the launcher left open survives.
    channel = os.dup(result_fd)
    os.set_inheritable(channel, False)
    os.closerange(3, channel)
    os.closerange(channel + 1, 1 << 16)

    def emit(record):
        data = record if type(record) is bytes else dumps(record)
        while data:
            data = data[os.write(channel, data):]

    # 2. The spec: everything the job needs, nothing the verdict needs.
    with open(spec_path, "rb") as f:
        spec = marshal.loads(f.read())  # written by the trusted parent
    if spec.get("stdin") is not None:
        fd = os.open(spec["stdin"], os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)

    # 3. Limits, hard == soft. RLIMIT_NPROC counts per user namespace, so it caps this sandbox's
    #    processes — except when the sandbox's real uid is host root, which the kernel exempts.
    for name, value in spec["rlimits"].items():
        if value is not None:
            resource.setrlimit(getattr(resource, name), (value, value))

    # `-S` skips site (30 ms of start-up); programs still expect exit()/quit() to exist.
    builtins.exit = builtins.quit = sys.exit
    cells = None
    if spec["kind"] == "session":  # the cells' pipe moves to a private fd; the candidate's stdin is empty
        cells = os.dup(0)
        os.set_inheritable(cells, False)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
    audit = Audit(emit, spec_path) if spec.get("audit") else None

    # 4. From here on, whatever happens is the candidate's doing.
    emit({"started": True})
    if audit is not None:
        audit.install()
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        if spec["kind"] == "stdio":
            run_stdio(spec, namespace, emit)
        elif spec["kind"] == "session":
            run_session(cells, namespace, emit, audit)
        else:
            run_calls(spec, namespace, emit)
    except MemoryError:
        emit({"memory": True})
    if audit is not None:
        audit.finish()
    try:
        sys.stdout.flush()
    except BaseException:  # the candidate may have closed or replaced stdout
        pass
    emit({"done": True})
    os._exit(0)


def run_stdio(spec, namespace, emit):
    try:
        exec(compile(spec["code"], "<candidate>", "exec"), namespace)
    except SystemExit as e:
        code = e.code
        if code is None or code == 0:
            emit({"exit": 0})
        else:
            emit({"exit": code if type(code) is int else 1})
        return
    except MemoryError:
        raise
    except BaseException as e:
        emit({"error": describe(e)})
        return
    emit({"exit": 0})


def run_calls(spec, namespace, emit):
    try:
        if spec.get("setup"):
            exec(compile(spec["setup"], "<setup>", "exec"), namespace)
        exec(compile(spec["code"], "<candidate>", "exec"), namespace)
    except MemoryError:
        raise
    except BaseException as e:  # SystemExit included: exiting before the tests is a failure
        emit({"load_error": describe(e)})
        return
    for i, call in enumerate(spec["calls"]):
        try:
            value = eval(compile(call, "<test %d>" % i, "eval"), namespace)
            record = dumps({"i": i, "value": encode(value)})
        except MemoryError:
            raise
        except Unserializable as e:
            record = {"i": i, "error": "Unserializable: %s" % e}
        except BaseException as e:  # ValueError from a >4300-digit int lands here too
            record = {"i": i, "error": describe(e)}
        emit(record)


# ---- sessions: cells over a pipe, one namespace ---------------------------------------------------

def read_cell(fd):
    """One cell: an 8-hex-digit length, a newline, then that many bytes of UTF-8. None at EOF."""
    head = b""
    while len(head) < 9:
        chunk = os.read(fd, 9 - len(head))
        if not chunk:
            return None
        head += chunk
    n = int(head[:8], 16)
    body = b""
    while len(body) < n:
        chunk = os.read(fd, n - len(body))
        if not chunk:
            return None
        body += chunk
    return body.decode("utf-8", "replace")


def run_session(fd, namespace, emit, audit=None):
    """Cells until EOF, like a notebook: one namespace; a cell whose last statement is an expression
    prints its repr (unless None). An exception (SystemExit included) is that cell's error; the session
    goes on. Each cell ends with `{"cell_done": k}` (with the audit's running probe total), written after
    stdout and stderr are flushed."""
    import _ast  # built in: the cell's statements without importing `ast`

    k = 0
    while True:
        code = read_cell(fd)
        if code is None:
            return
        try:
            tree = compile(code, "<cell %d>" % k, "exec", _ast.PyCF_ONLY_AST)
            last = None
            if tree.body and type(tree.body[-1]) is _ast.Expr:
                last = _ast.Expression(tree.body.pop().value)
            exec(compile(tree, "<cell %d>" % k, "exec"), namespace)
            if last is not None:
                value = eval(compile(last, "<cell %d>" % k, "eval"), namespace)
                if value is not None:
                    print(repr(value))
        except MemoryError:
            emit({"cell": k, "memory": True})
        except BaseException as e:
            emit({"cell": k, "error": describe(e)})
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        emit({"cell_done": k} if audit is None else {"cell_done": k, "probes": audit.count})
        k += 1


# ---- the probe counter ---------------------------------------------------------------------------

CANDIDATE_FILES = ("<candidate>", "<setup>", "<cell ")  # code objects the candidate wrote (and <test i>)
MAX_PROBE_RECORDS = 16
# modules between the candidate and the event (`os.getenv`, `Mapping.get`, `inspect.stack`); frozen
# modules (3.11+) are named "<frozen os>"
PASS_THROUGH = ("/os.py", "/inspect.py", "/_collections_abc.py", "<frozen os>", "<frozen _collections_abc>")
FRAME_ATTRS = ("tb_frame", "gi_frame", "cr_frame", "ag_frame")  # the attributes that raise `object.__getattr__`
FRAME_EVENTS = ("sys._getframe", "sys._getframemodulename")  # 3.11+ / 3.12+ (namedtuple asks for the latter)
ALWAYS = ("gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
          "sys.settrace", "sys.setprofile", "sys.addaudithook")


class Audit:
    """Counts probes (see the module docstring). Decisions, per audit event:
    - `open` of a path (or of an fd above 2), `os.listdir`, `os.scandir`, `glob.glob`, `os.chdir`: a
      probe when the path is not under the interpreter's directories (`sys.prefix`, `sys.path`), not
      the work directory (when the harness's own files are not in it: bubblewrap's /tmp) and not a
      /dev/{null,zero,random,urandom} — whoever asked (an import reads only the interpreter's files);
    - `sys._getframe`, and reading a frame attribute (`tb_frame`, …): a probe when the Python code
      that asked is the candidate's own (or `inspect`, called by it) — the standard library's own
      frame reads (`collections.namedtuple`, `enum`) are not;
    - the garbage collector's object lists, other threads' frames, tracing and audit hooks: always;
    - `os.environ` (replaced by a watching copy): any read whose caller is the candidate's code."""

    def __init__(self, emit, spec_path):
        self.emit, self.count, self.busy = emit, 0, False
        own = os.path.dirname(os.path.abspath(spec_path))
        cwd = os.getcwd()
        roots = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
        roots += [p for p in sys.path if p]
        self.roots = tuple(sorted({os.path.normpath(r) for r in roots if r}))
        self.work = None if cwd == own else cwd  # the unsafe backend's cwd holds the harness's files
        self.cwd = cwd
        self.own = own
        self.own_files = tuple(own + "/" + f for f in ("harness.py", "spec.marshal", "stdin"))
        self.devices = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")

    def install(self):
        environ = os.environ
        audit = self

        class WatchedEnviron(type(environ)):
            def __getitem__(self, key):
                audit.caller_probe("environ", str(key))
                return super().__getitem__(key)

            def __iter__(self):
                audit.caller_probe("environ", "*")
                return super().__iter__()

            def __len__(self):
                audit.caller_probe("environ", "len")
                return super().__len__()

            def __repr__(self):
                audit.caller_probe("environ", "repr")
                return super().__repr__()

        watched = WatchedEnviron.__new__(WatchedEnviron)
        watched.__dict__.update(environ.__dict__)
        os.environ = watched
        sys.addaudithook(self.hook)

    def finish(self):
        self.emit({"probes": self.count})

    def record(self, kind, what):
        self.count += 1
        if self.count <= MAX_PROBE_RECORDS:
            self.emit({"probe": kind, "what": what[:200]})

    def outside(self, path):
        if type(path) is int:
            return path > 2
        if type(path) is bytes:
            path = path.decode("utf-8", "replace")
        if type(path) is not str:
            path = str(path)  # an os.PathLike: str() of pathlib paths is the path
        if not path.startswith("/"):
            path = self.cwd + "/" + path
        path = os.path.normpath(path)
        if path in self.devices:
            return False
        if path == self.own or path in self.own_files:
            return True  # the harness's own files: what a program that looks for its tests reads first
        if path.startswith(self.own + "/"):
            return False  # the unsafe backend's work directory: besides those, the program's own files
        for root in self.roots:
            if path == root or path.startswith(root + "/"):
                return False
        if self.work is not None and (path == self.work or path.startswith(self.work + "/")):
            return False
        return True

    def caller_is_candidate(self, skip):
        """Whether the first Python frame `skip` levels up (past `os`, `inspect` and the abstract
        mappings' methods) is the candidate's code."""
        f = sys._getframe(skip)
        while f is not None:
            name = f.f_code.co_filename
            if name.endswith(PASS_THROUGH):
                f = f.f_back
                continue
            return name.startswith(CANDIDATE_FILES) or name.startswith("<test ")
        return False

    def caller_probe(self, kind, what):
        if self.busy:
            return
        self.busy = True
        try:
            if self.caller_is_candidate(3):
                self.record(kind, what)
        finally:
            self.busy = False

    def hook(self, event, args):
        if self.busy or event in ("exec", "compile", "import", "marshal.loads", "object.__setattr__"):
            return
        self.busy = True
        try:
            if event in ("open", "os.listdir", "os.scandir", "glob.glob", "os.chdir"):
                path = args[0] if args else None
                if event == "os.scandir" and path is None:
                    path = "."
                if path is not None and self.outside(path):
                    self.record(event, str(path))
            elif event in ALWAYS:
                self.record(event, "")
            elif event in FRAME_EVENTS:
                if self.caller_is_candidate(2):
                    self.record(event, "")
            elif event == "object.__getattr__" and len(args) == 2 and args[1] in FRAME_ATTRS:
                if self.caller_is_candidate(2):
                    self.record(event, str(args[1]))
        except BaseException:  # the hook must never break the candidate's program
            pass
        finally:
            self.busy = False


if __name__ == "__main__":
    main()
