"""A small OpenAI-compatible chat-completions server for tests (stdlib `http.server`), run as a process.

    python tests/openai_stub_server.py [--plan drop,stall,503] [--stall-s 3] [--key-env NAME] [--reply TEXT]

Prints its port on the first line of stdout, then serves `POST /v1/chat/completions` on 127.0.0.1 until
killed. The k-th chat request (1-based, counting every attempt) follows the k-th word of `--plan`
(then `ok`): `drop` closes the connection without a response, `stall` sleeps `--stall-s` seconds before
answering, a number answers with that HTTP status, `ok` answers. With `--key-env`, a request whose
`Authorization` is not `Bearer $NAME` gets 401. The reply is `--reply`, else `echo: <last user message>`.
`GET /stats` returns `{"chat_requests": n, "bad_auth": n}` (not counted).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", default="")
    ap.add_argument("--stall-s", type=float, default=3.0)
    ap.add_argument("--key-env", default=None)
    ap.add_argument("--reply", default=None)
    args = ap.parse_args()
    plan = [p for p in args.plan.split(",") if p]
    key = os.environ[args.key_env] if args.key_env else None
    lock = threading.Lock()
    stats = {"chat_requests": 0, "bad_auth": 0}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # quiet
            pass

        def _send(self, status: int, obj: dict) -> None:
            body = json.dumps(obj).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except OSError:  # the client gave up (timed out) meanwhile
                pass

        def do_GET(self):
            self._send(200, stats) if self.path == "/stats" else self._send(404, {"error": "not found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path != "/v1/chat/completions":
                return self._send(404, {"error": {"message": f"no route {self.path}"}})
            with lock:
                stats["chat_requests"] += 1
                k = stats["chat_requests"]
            step = plan[k - 1] if k <= len(plan) else "ok"
            if step == "drop":
                self.close_connection = True
                return  # no response: the client sees the connection closed
            if step == "stall":
                time.sleep(args.stall_s)
            elif step.isdigit():
                return self._send(int(step), {"error": {"message": f"planned status {step}"}})
            if key is not None and self.headers.get("Authorization") != f"Bearer {key}":
                with lock:
                    stats["bad_auth"] += 1
                return self._send(401, {"error": {"message": "invalid api key"}})
            user = [m["content"] for m in body.get("messages", []) if m.get("role") == "user"]
            content = args.reply if args.reply is not None else f"echo: {user[-1] if user else ''}"
            self._send(200, {"id": f"chatcmpl-{k}", "object": "chat.completion", "model": body.get("model"),
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": content}}]})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    sys.stdout.close()
    server.serve_forever()


if __name__ == "__main__":
    main()
