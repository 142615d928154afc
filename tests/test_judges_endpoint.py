"""The OpenAI-compatible endpoint backend against a real HTTP server process on 127.0.0.1 (no mocks):
request/response, retry after a dropped connection and a 5xx, timeout, cached replay on resume (no second
request), the request budget, and the API key kept out of the cache, the errors and the repr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from posttrain.data import Message
from posttrain.judges import BudgetExhausted, ChatRequest, EndpointBackend, JudgeBackendError, Winner, judge_pairs

SERVER = Path(__file__).with_name("openai_stub_server.py")
KEY = "sk-test-9f8e7d6c5b4a-never-on-disk"


@contextmanager
def server(*args: str, env: dict | None = None):
    proc = subprocess.Popen([sys.executable, str(SERVER), *args], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    try:
        port = int(proc.stdout.readline())
        url = f"http://127.0.0.1:{port}"

        def stats() -> dict:
            with urllib.request.urlopen(f"{url}/stats", timeout=5) as r:
                return json.loads(r.read())

        yield f"{url}/v1", stats
    finally:
        proc.kill()
        proc.wait(timeout=10)


def ask(text: str) -> ChatRequest:
    return ChatRequest((Message("user", text),), max_tokens=8)


@pytest.fixture
def keyed(monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_KEY", KEY)
    return {"JUDGE_TEST_KEY": KEY}


def test_request_response_and_the_key_is_sent(keyed):
    with server("--key-env", "JUDGE_TEST_KEY", env=keyed) as (url, stats):
        b = EndpointBackend(url, "stub", api_key_env="JUDGE_TEST_KEY")
        assert b.complete([ask("hello"), ask("world")]) == ["echo: hello", "echo: world"]
        assert stats() == {"chat_requests": 2, "bad_auth": 0}
        assert (b.stats.sent, b.stats.retries, b.stats.answered) == (2, 0, 2)
        assert KEY not in repr(b)


def test_wrong_key_is_an_error_at_once_without_the_key_in_it(monkeypatch, keyed):
    with server("--key-env", "JUDGE_TEST_KEY", env=keyed) as (url, stats):
        monkeypatch.setenv("OTHER_KEY", "sk-wrong-" + KEY)
        b = EndpointBackend(url, "stub", api_key_env="OTHER_KEY", max_retries=3, backoff_s=0.01)
        with pytest.raises(JudgeBackendError, match="HTTP 401") as e:
            b.complete([ask("hi")])
        assert KEY not in str(e.value) and stats()["chat_requests"] == 1  # a 401 is not retried
    monkeypatch.delenv("OTHER_KEY")
    with pytest.raises(JudgeBackendError, match="OTHER_KEY is not set"):
        EndpointBackend(url, "stub", api_key_env="OTHER_KEY")


def test_retry_after_a_dropped_connection_and_a_5xx():
    with server("--plan", "drop,503") as (url, stats):
        waits = []
        b = EndpointBackend(url, "stub", api_key_env=None, max_retries=3, backoff_s=0.05, sleep=waits.append)
        # attempt 1: connection closed without a response; attempt 2: HTTP 503; attempt 3: answered
        assert b.complete([ask("x")]) == ["echo: x"]
        assert stats()["chat_requests"] == 3 and (b.stats.sent, b.stats.retries) == (3, 2)
        assert waits == [0.05, 0.1]  # backoff_s · 2^0, backoff_s · 2^1


def test_timeout_then_retry_and_timeouts_exhausted():
    # timeouts of 1.5 s against stalls of 8 s: room for a loaded machine to answer the healthy attempt
    with server("--plan", "stall", "--stall-s", "8") as (url, stats):
        b = EndpointBackend(url, "stub", api_key_env=None, timeout_s=1.5, max_retries=1, backoff_s=0)
        t0 = time.monotonic()
        assert b.complete([ask("slow")]) == ["echo: slow"]  # attempt 1 stalls past 1.5 s, attempt 2 answers
        assert 1.5 <= time.monotonic() - t0 < 7.5 and stats()["chat_requests"] == 2
    with server("--plan", "stall,stall", "--stall-s", "8") as (url, stats):
        b = EndpointBackend(url, "stub", api_key_env=None, timeout_s=1.5, max_retries=1, backoff_s=0)
        with pytest.raises(JudgeBackendError, match=r"no answer after 2 attempt\(s\); last: timed out after 1.5 s"):
            b.complete([ask("slow")])
        assert stats()["chat_requests"] == 2


def test_cached_replay_on_resume_sends_nothing_and_the_cache_never_holds_the_key(tmp_path, keyed):
    cache = tmp_path / "judge_cache"
    requests = [ask(f"q{i}") for i in range(4)]
    with server("--key-env", "JUDGE_TEST_KEY", env=keyed) as (url, stats):
        first = EndpointBackend(url, "stub", api_key_env="JUDGE_TEST_KEY", cache_dir=cache).complete(requests)
        assert stats()["chat_requests"] == 4
        again = EndpointBackend(url, "stub", api_key_env="JUDGE_TEST_KEY", cache_dir=cache)  # a resumed run
        assert again.complete(requests) == first and stats()["chat_requests"] == 4  # zero new requests
        assert (again.stats.sent, again.stats.cache_hits) == (0, 4)
        other_model = EndpointBackend(url, "stub-2", api_key_env="JUDGE_TEST_KEY", cache_dir=cache)
        other_model.complete(requests[:1])  # a different model is a different request: asked, not replayed
        assert stats()["chat_requests"] == 5
    files = list(cache.rglob("*"))
    assert len([f for f in files if f.is_file()]) == 5
    assert all(KEY not in f.read_text() and "Authorization" not in f.read_text() for f in files if f.is_file())


def test_budget_exhausted_is_a_clear_error_and_a_resume_pays_only_for_the_rest(tmp_path):
    cache = tmp_path / "c"
    requests = [ask(f"q{i}") for i in range(5)]
    with server() as (url, stats):
        b = EndpointBackend(url, "stub", api_key_env=None, budget=3, cache_dir=cache)
        with pytest.raises(BudgetExhausted, match=r"request budget of 3 spent \(3 sent.*2 request\(s\) of this batch unanswered"):
            b.complete(requests)
        assert stats()["chat_requests"] == 3
        resumed = EndpointBackend(url, "stub", api_key_env=None, budget=2, cache_dir=cache)
        assert resumed.complete(requests) == [f"echo: q{i}" for i in range(5)]
        assert stats()["chat_requests"] == 5 and resumed.stats.cache_hits == 3  # 3 replayed + 2 new = 5


def test_pairwise_judge_over_the_endpoint_turns_a_position_biased_judge_into_ties():
    # a judge that always answers "A" prefers the position, not the reply: both orders give A → tie
    with server("--reply", "A") as (url, stats):
        b = EndpointBackend(url, "stub", api_key_env=None)
        out = judge_pairs(b, ["2+2?", "3+3?"], ["4", "6"], ["5", "7"])
        assert [j.winner for j in out] == [Winner.TIE, Winner.TIE] and stats()["chat_requests"] == 4  # 2 pairs × 2 orders
