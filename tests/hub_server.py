"""A tiny stand-in for the Hugging Face Hub HTTP API, on 127.0.0.1, for upload tests.

It answers just what huggingface_hub needs to create a repo and commit regular (non-LFS) files:
repo creation, pre-upload (every file "regular") and the NDJSON commit. Committed files are kept in
memory so a test can check what arrived.
"""

from __future__ import annotations

import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class HubState:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.commits: list[dict] = []


def _handler(state: HubState, base_url: str):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep pytest output clean
            pass

        def _json(self, payload, status=200):
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def do_POST(self):
            body = self._body()
            if self.path.startswith("/api/validate-yaml"):  # the Hub checks a model card's front matter
                return self._json({"errors": [], "warnings": []})
            if self.path.startswith("/api/repos/create"):
                req = json.loads(body)
                repo_id = f"{req.get('organization') or 'user'}/{req['name']}" if "/" not in req["name"] else req["name"]
                state.repos.setdefault(repo_id, {})
                return self._json({"url": f"{base_url}/{repo_id}", "name": repo_id})
            m = re.match(r"/api/models/(.+?)/preupload/(.+)", self.path)
            if m:
                files = json.loads(body).get("files", [])
                return self._json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]})
            m = re.match(r"/api/models/(.+?)/commit/(.+)", self.path)
            if m:
                repo_id = m.group(1)
                files = state.repos.setdefault(repo_id, {})
                header = None
                for line in body.decode().splitlines():
                    item = json.loads(line)
                    if item["key"] == "header":
                        header = item["value"]
                    elif item["key"] == "file":
                        files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                state.commits.append({"repo": repo_id, "header": header})
                oid = f"{len(state.commits):040x}"
                return self._json({"commitUrl": f"{base_url}/{repo_id}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None})
            self._json({"error": f"not handled: POST {self.path}"}, status=404)

        def do_GET(self):
            if self.path.startswith("/api/whoami"):
                return self._json({"name": "user", "type": "user", "orgs": [], "auth": {"accessToken": {"role": "write"}}})
            self._json({"error": f"not handled: GET {self.path}"}, status=404)

    return Handler


class LocalHub:
    """Context manager: a hub on an ephemeral loopback port; `.url` and `.state`."""

    def __enter__(self) -> "LocalHub":
        self.state = HubState()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.state, "http://127.0.0.1"))
        host, port = self.server.server_address[:2]
        self.url = f"http://{host}:{port}"
        self.server.RequestHandlerClass = _handler(self.state, self.url)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
