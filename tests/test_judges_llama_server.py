"""The endpoint judge against a real model server: llama.cpp's OpenAI-compatible server
(`python -m llama_cpp.server`, from `llama-cpp-python[server]`) serving SmolLM2-135M-Instruct's GGUF file on
127.0.0.1 — a request answered by the model, a retry across a server killed (`kill -9`) and restarted on
the same port, a timeout, and the cached replay a resumed run makes (no second request).

`tests/test_judges_endpoint.py` drives the same client through scripted faults (a 503, a connection
dropped mid-request, a stall) from a small HTTP server of our own; this file is the same client against
the server people run. It needs `pip install "llama-cpp-python[server]"` (built from source: a C++
compiler, a few minutes on 2 idle cores) and skips without it, saying so; `scripts/test.sh` installs it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from posttrain.data import Message
from posttrain.judges import ChatRequest, EndpointBackend, JudgeBackendError, judge_pairs
from posttrain.models.gguf import smollm2_gguf

pytest.importorskip("llama_cpp.server", reason="llama-cpp-python[server] is not installed (see the module docstring)")

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(smollm2_gguf()),
                             "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "1024", "--n_threads", "1",
                             "--model_alias", "smollm2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(proc: subprocess.Popen, port: int, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama_cpp.server exited with {proc.returncode} before answering")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if json.loads(r.read())["data"]:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"llama_cpp.server on port {port} not ready after {timeout_s:g} s")


@contextmanager
def serving(port: int):
    proc = start(port)
    try:
        wait_ready(proc, port)
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def ask(text: str, max_tokens: int = 12) -> ChatRequest:
    return ChatRequest((Message("user", text),), max_tokens=max_tokens)


def test_the_model_server_answers_retries_across_a_restart_times_out_and_replays_from_the_cache(tmp_path: Path):
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    cache = tmp_path / "judge_cache"
    with serving(port) as proc:
        b = EndpointBackend(url, "smollm2", api_key_env=None, cache_dir=cache, timeout_s=60)
        [first] = b.complete([ask("What is 2 + 3? Answer with a number.")])
        assert first.strip(), "the model answered nothing"
        assert (b.stats.sent, b.stats.answered, b.stats.retries) == (1, 1, 0)
        # the judge's question, both orders, answered by the model (what it says is its own business)
        verdicts = judge_pairs(b, ["What is 2 + 3?"], ["5"], ["6"])
        assert len(verdicts) == 1 and b.stats.answered == 3

        # timeout: a 200-token reply cannot come back in 50 ms from a CPU model
        slow = EndpointBackend(url, "smollm2", api_key_env=None, timeout_s=0.05, max_retries=0)
        with pytest.raises(JudgeBackendError, match="timed out after 0.05 s"):
            slow.complete([ask("Count from one to two hundred in words.", max_tokens=200)])

        # the server is killed mid-run: the next request is refused until a new server listens on the port
        proc.kill()
        proc.wait(timeout=30)
    restarted = start(port)
    try:
        again = EndpointBackend(url, "smollm2", api_key_env=None, timeout_s=60, max_retries=120, backoff_s=0.5,
                                max_backoff_s=1.0)
        [reply] = again.complete([ask("What is 4 + 4? Answer with a number.")])
        assert reply.strip()
        assert again.stats.retries >= 1 and again.stats.answered == 1, again.stats

        # a resumed run: a new client on the same cache replays the answers and sends nothing
        resumed = EndpointBackend(url, "smollm2", api_key_env=None, cache_dir=cache)
        assert resumed.complete([ask("What is 2 + 3? Answer with a number.")]) == [first]
        assert (resumed.stats.sent, resumed.stats.cache_hits) == (0, 1)
    finally:
        restarted.kill()
        restarted.wait(timeout=30)
