"""A small OpenAI-compatible server for the regeneration tests: ``GET /v1/models``, vLLM's
``POST /tokenize`` and ``POST /v1/completions`` on token-id prompts, answered by a tiny HF model's
greedy or seeded sampled ``generate()`` the way vLLM answers (``token_ids`` with the stop token
included, ``finish_reason`` stop/length).

``faults`` scripts failures: a callable (n, path) -> None or an action, n counting completion
requests from 1: ``("status", code)``, ``("drop",)`` (close the connection without an answer),
``("sleep", seconds)`` (answer late), ``("json", obj)`` (answer obj instead).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

import torch


class FakeOpenAIServer:
    def __init__(self, model: Any, tokenizer: Any, name: str = "tiny", token_ids: bool = True, faults: Optional[Callable] = None, tokenize: Optional[Callable] = None) -> None:
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.token_ids, self.faults = token_ids, faults
        self.tokenize = tokenize or (lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"])
        self.completions = 0  # completion requests received, faulty ones included
        self.answered = 0  # completion requests answered with a completion
        self.bodies: list[dict] = []
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "FakeOpenAIServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ------------------------------------------------------------------ answers

    @torch.no_grad()
    def _complete(self, body: dict) -> dict:
        prompt = torch.tensor([body["prompt"]])
        stop = list(body.get("stop_token_ids") or [])
        kwargs = dict(max_new_tokens=body["max_tokens"], eos_token_id=stop, pad_token_id=stop[0])
        if body["temperature"] > 0:
            kwargs.update(do_sample=True, temperature=body["temperature"], top_p=body["top_p"], top_k=0)
        else:
            kwargs.update(do_sample=False)
        with self._lock:  # one generate at a time: the model and torch's global generator are shared
            if body["temperature"] > 0:
                torch.manual_seed(body["seed"])
            out = self.model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **kwargs)[0, prompt.shape[1] :].tolist()
        end = next((k for k, t in enumerate(out) if t in stop), None)
        ids = out[: end + 1] if end is not None else out  # vLLM keeps the stop token in token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        choice = {"index": 0, "text": text, "finish_reason": "stop" if end is not None else "length"}
        if self.token_ids and body.get("return_token_ids"):
            choice["token_ids"] = ids
        return {"object": "text_completion", "model": self.name, "choices": [choice]}

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _send(self, code: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": server.name, "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    self._send(200, {"tokens": server.tokenize(body["prompt"]), "count": 0, "max_model_len": 4096})
                    return
                if self.path != "/v1/completions":
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
                    return
                with server._lock:
                    server.completions += 1
                    n = server.completions
                action = server.faults(n, self.path) if server.faults else None
                if action is not None:
                    kind = action[0]
                    if kind == "status":
                        self._send(action[1], {"error": {"message": f"scripted failure {action[1]}"}})
                        return
                    if kind == "drop":
                        self.close_connection = True
                        self.connection.close()
                        return
                    if kind == "json":
                        self._send(200, action[1])
                        return
                    if kind == "sleep":
                        time.sleep(action[1])
                server.bodies.append(body)
                answer = server._complete(body)
                with server._lock:
                    server.answered += 1
                self._send(200, answer)

        return Handler
