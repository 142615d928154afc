"""An OpenAI-compatible chat-completions endpoint as a judge's backend (stdlib `http.client`).

    backend = EndpointBackend("https://api.example.com/v1", "judge-model", api_key_env="JUDGE_API_KEY",
                              budget=2000, cache_dir=run_dir / "judge_cache")
    replies = backend.complete([ChatRequest((Message("user", "…"),), max_tokens=8)])

`POST {base_url}/chat/completions` with `{model, messages, max_tokens, temperature}`; the reply is
`choices[0].message.content`.

- **Key**: read from the environment variable `api_key_env` when the backend is built and sent only
  in the `Authorization: Bearer` header. It is never written to the cache, a log or an error message
  (error text is scrubbed of it), and `repr(backend)` does not show it. `api_key_env=None` sends no
  key (a local server).
- **Timeouts**: `timeout_s` bounds every socket operation (connect, send, each read), so a server
  that stalls past it fails that attempt.
- **Retries**: a connection error (refused, reset, closed without a response), a timeout, HTTP 429 or
  any 5xx is retried up to `max_retries` times, after `backoff_s · 2^attempt` seconds (capped at
  `max_backoff_s`). Any other non-200 status is an error at once (a 401 will not fix itself).
- **Budget**: at most `budget` HTTP attempts over the backend's life (retries count: a timed-out
  request may still be billed). Past it, `BudgetExhausted` says how many were sent and how many of the
  batch are unanswered.
- **Cache** (`cache_dir`, cache.py): every answered request is stored before the next is sent; a
  cached request is answered from disk and costs no attempt, so a resumed run pays only for the rest.
Requests are sent one at a time (a judge's throughput is the endpoint's; no concurrency yet).
"""

from __future__ import annotations

import http.client
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from posttrain.judges.backend import BudgetExhausted, ChatRequest, JudgeBackendError
from posttrain.judges.cache import ResponseCache, request_key

RETRY_STATUSES = frozenset({429, *range(500, 600)})


@dataclass
class EndpointStats:
    sent: int = 0         # HTTP attempts made (what the budget counts)
    retries: int = 0      # attempts after a failed one
    cache_hits: int = 0   # requests answered from the cache (no attempt)
    answered: int = 0     # requests answered by the endpoint


class EndpointBackend:
    name = "endpoint"

    def __init__(self, base_url: str, model: str, *, api_key_env: str | None = "OPENAI_API_KEY",
                 timeout_s: float = 60.0, max_retries: int = 3, backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 budget: int | None = None, cache_dir: str | Path | None = None,
                 sleep: Callable[[float], None] = time.sleep):
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise JudgeBackendError(f"base_url {base_url!r}: expected http(s)://host[:port]/path")
        self._https = url.scheme == "https"
        self._host, self._port = url.hostname, url.port
        self._path = url.path.rstrip("/") + "/chat/completions"
        # what identifies the endpoint in cache keys: no userinfo, no query string
        self.endpoint = f"{url.scheme}://{url.hostname}{f':{url.port}' if url.port else ''}{url.path.rstrip('/')}"
        self.model = model
        self._key = None
        if api_key_env is not None:
            self._key = os.environ.get(api_key_env) or None
            if self._key is None:
                raise JudgeBackendError(f"the API key variable {api_key_env} is not set (or empty)")
        if timeout_s <= 0 or max_retries < 0 or (budget is not None and budget < 0):
            raise JudgeBackendError(f"timeout_s={timeout_s}, max_retries={max_retries}, budget={budget}: "
                                    "expected timeout_s > 0, max_retries ≥ 0, budget ≥ 0 or None")
        self.timeout_s, self.max_retries, self.budget = timeout_s, max_retries, budget
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.cache = ResponseCache(cache_dir) if cache_dir is not None else None
        self.stats = EndpointStats()
        self._sleep = sleep

    def __repr__(self) -> str:  # never the key
        return f"EndpointBackend({self.endpoint!r}, model={self.model!r}, budget={self.budget})"

    def _scrub(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text

    def _post(self, body: bytes) -> tuple[int, bytes]:
        """One HTTP attempt: (status, body). Raises OSError / HTTPException on connection trouble."""
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=self.timeout_s)
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        try:
            conn.request("POST", self._path, body=body, headers=headers)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def _ask(self, payload: dict, unanswered: int) -> str:
        body = json.dumps(payload).encode()
        last = ""
        for attempt in range(self.max_retries + 1):
            if self.budget is not None and self.stats.sent >= self.budget:
                raise BudgetExhausted(
                    f"{self.endpoint}: request budget of {self.budget} spent ({self.stats.sent} sent, "
                    f"{self.stats.cache_hits} answered from the cache); {unanswered} request(s) of this batch "
                    "unanswered — raise the budget and resume with the same cache_dir (answered requests are not paid twice)")
            if attempt:
                self.stats.retries += 1
                self._sleep(min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)))
            self.stats.sent += 1
            try:
                status, raw = self._post(body)
            except TimeoutError:
                last = f"timed out after {self.timeout_s:g} s"
                continue
            except (OSError, http.client.HTTPException) as e:
                last = f"connection error ({type(e).__name__}: {e})"
                continue
            if status in RETRY_STATUSES:
                last = f"HTTP {status}"
                continue
            if status != 200:
                raise JudgeBackendError(self._scrub(f"{self.endpoint}: HTTP {status}: {raw[:300].decode(errors='replace')}"))
            try:
                content = json.loads(raw)["choices"][0]["message"]["content"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise JudgeBackendError(self._scrub(f"{self.endpoint}: not a chat-completions response: "
                                                    f"{raw[:200].decode(errors='replace')}")) from None
            self.stats.answered += 1
            return content if isinstance(content, str) else ""
        raise JudgeBackendError(self._scrub(f"{self.endpoint}: no answer after {self.max_retries + 1} attempt(s); last: {last}"))

    def complete(self, requests: Sequence[ChatRequest]) -> list[str]:
        replies = []
        for i, request in enumerate(requests):
            payload = {"model": self.model, **request.as_json()}
            key = request_key({"endpoint": self.endpoint, **payload})
            cached = self.cache.get(key) if self.cache is not None else None
            if cached is not None:
                self.stats.cache_hits += 1
                replies.append(cached)
                continue
            reply = self._ask(payload, len(requests) - i)
            if self.cache is not None:
                self.cache.put(key, {"endpoint": self.endpoint, **payload}, reply)
            replies.append(reply)
        return replies
