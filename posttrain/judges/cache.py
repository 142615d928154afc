"""Replies cached on disk, keyed by the request, so a resumed run does not pay for a request twice.

One JSON file per request, `<dir>/<key[:2]>/<key>.json`, written to a temporary name and renamed into
place (a run killed mid-write leaves no half file behind). The key is the SHA-256 of the canonical
JSON of what determines the reply: the endpoint (scheme, host, port, path — never credentials), the
model, the messages, `max_tokens`, `temperature`. A file holds that request and the reply text; the
API key is not part of the request and is never written.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path


def request_key(request: dict) -> str:
    return hashlib.sha256(json.dumps(request, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


class ResponseCache:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    def _path(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}.json"

    def get(self, key: str) -> str | None:
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())["reply"]
        except (ValueError, KeyError):  # unreadable: treat as absent (it will be asked again and rewritten)
            return None

    def put(self, key: str, request: dict, reply: str) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:8]}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"key": key, "request": request, "reply": reply}, f, ensure_ascii=False)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
