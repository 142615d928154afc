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
5. runs the candidate, then each call, writing one JSON record per call to the result channel;
6. writes `done` and leaves with `os._exit(0)` (so `atexit` handlers the candidate planted never run).

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

    # 4. From here on, whatever happens is the candidate's doing.
    emit({"started": True})
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        if spec["kind"] == "stdio":
            run_stdio(spec, namespace, emit)
        else:
            run_calls(spec, namespace, emit)
    except MemoryError:
        emit({"memory": True})
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


if __name__ == "__main__":
    main()
