"""Regeneration through an OpenAI-compatible server (``vllm serve``, SGLang): data.regenerate.backend=server.

A serving engine batches continuously and runs the target many times faster than ``generate()``
in the training process, which is what regenerating thousands of conversations needs. The
contract with the server is kept narrow so that what comes back is the target's own tokens:

- Before any request the server must list the model (``GET /v1/models``) and tokenize a probe
  text, a rendered chat turn with special tokens and non-ASCII text, to exactly the ids our
  tokenizer gives (``POST /tokenize``, vLLM's, or ``/v1/tokenize``). Otherwise one line, and no
  request is sent.
- Prompts go out as token ids (``/v1/completions`` with ``prompt: [ids]``), rendered with our chat
  template, so the server cannot render the conversation differently.
- Answers come back as token ids (``"return_token_ids": true``, vLLM). A server that returns text
  only is used through its text, re-tokenized when the examples are built; the run says so once.
- Every sampling knob the server could default from the model's generation config (repetition
  penalty, top-k, min-p) is sent explicitly, so the answers follow the recipe's
  temperature/top_p alone; sampled turns carry a per-(conversation, turn) seed.

Requests that fail for a transient reason (connection refused or reset, timeout, HTTP 408, 429,
5xx) are retried with exponential backoff; anything else, or a request that keeps failing, stops
the run with one line. Conversations finished before that are already in the cache.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, Optional

from draftsmith.data.errors import DataError

# Statuses worth another try: the server is busy or restarting, not refusing the request.
RETRY_STATUSES = {408, 409, 425, 429, 500, 502, 503, 504}


class ServerError(DataError):
    """The regeneration server cannot be used or stopped answering; one line naming the URL."""


class _Transient(Exception):
    """A failure another try may fix."""


@dataclass
class Completion:
    """One answer: the generated token ids (None when the server returns text only), its text and
    whether the target ended it itself (rather than running into its token budget)."""

    token_ids: Optional[list[int]]
    text: str
    complete: bool


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RegenerationServer:
    """A client of one OpenAI-compatible server at ``url`` (its API root, e.g. http://127.0.0.1:8000/v1)."""

    def __init__(self, url: str, model: str, timeout: float = 600.0, max_retries: int = 4, backoff: float = 1.0, sleep: Callable[[float], None] = time.sleep) -> None:
        self.url = url.rstrip("/")
        self.root = self.url[: -len("/v1")] if self.url.endswith("/v1") else self.url
        self.model, self.timeout, self.max_retries, self.backoff = model, timeout, max_retries, backoff
        self._sleep = sleep
        self.returns_token_ids: Optional[bool] = None  # learned from the first answer

    # ------------------------------------------------------------------ transport

    def _once(self, method: str, url: str, body: Optional[dict], timeout: float) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            detail = _short(err.read().decode("utf-8", "replace"))
            if err.code in RETRY_STATUSES:
                raise _Transient(f"HTTP {err.code}: {detail}") from None
            raise ServerError(f"{method} {url} was refused with HTTP {err.code}: {detail}") from None
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as err:
            reason = getattr(err, "reason", err)
            raise _Transient(f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__) from None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise ServerError(f"{method} {url} answered with something that is not JSON: {_short(raw.decode('utf-8', 'replace'))!r}") from None

    def request(self, method: str, path: str, body: Optional[dict] = None, root: bool = False, timeout: Optional[float] = None) -> Any:
        """The JSON answer to one request, retried on transient failures; ServerError otherwise."""
        url = (self.root if root else self.url) + path
        tries = self.max_retries + 1
        for attempt in range(tries):
            try:
                return self._once(method, url, body, self.timeout if timeout is None else timeout)
            except _Transient as err:
                if attempt + 1 == tries:
                    raise ServerError(f"{method} {url} failed {tries} times (last: {err}); is the server up? (data.regenerate.server.url)") from None
                self._sleep(self.backoff * 2**attempt)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ checks

    def check(self, tokenizer: Any, probe: str) -> None:
        """Refuse (ServerError) unless the server lists our model and tokenizes ``probe`` exactly as
        ``tokenizer`` does."""
        listing = self.request("GET", "/models", timeout=min(self.timeout, 60.0))
        try:
            names = [m["id"] for m in listing["data"]]
        except (KeyError, TypeError):
            raise ServerError(f"GET {self.url}/models answered {_short(json.dumps(listing))!r}, not an OpenAI model list") from None
        if self.model not in names:
            raise ServerError(
                f"the server at {self.url} serves {', '.join(map(repr, names)) or 'no model'}, not {self.model!r} "
                "(data.regenerate.server.model, default target.path; vLLM: --served-model-name)"
            )
        ours = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
        theirs = self._tokenize(probe)
        if theirs != ours:
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            raise ServerError(
                f"the server at {self.url} tokenizes differently from the target's tokenizer: a probe of {len(ours)} tokens "
                f"first differs at token {at} (ours {ours[at:at + 3]}, the server's {theirs[at:at + 3]}); serve the target's own tokenizer"
            )

    def _tokenize(self, text: str) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        errors = []
        for path, root in (("/tokenize", True), ("/tokenize", False)):  # vLLM's, then under /v1
            try:
                answer = self.request("POST", path, body, root=root, timeout=min(self.timeout, 60.0))
            except ServerError as err:
                errors.append(str(err))
                continue
            tokens = answer.get("tokens") if isinstance(answer, dict) else None
            if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
                return tokens
            errors.append(f"POST {(self.root if root else self.url) + path} answered {_short(json.dumps(answer))!r}")
        raise ServerError(f"cannot check the tokenizer of the server at {self.url}: it has no usable /tokenize endpoint ({errors[-1]})")

    # ------------------------------------------------------------------ generation

    def complete(self, prompt: list[int], max_tokens: int, temperature: float, top_p: float, seed: Optional[int], stop_ids: list[int]) -> Completion:
        """The target's answer to a tokenized prompt."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            # What vLLM would otherwise take from the model's generation_config.json:
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "stop_token_ids": stop_ids,
            "skip_special_tokens": True,
            "return_token_ids": True,
            "n": 1,
            "stream": False,
        }
        if seed is not None:
            body["seed"] = seed
        answer = self.request("POST", "/completions", body)
        try:
            choice = answer["choices"][0]
            text, reason = choice["text"], choice.get("finish_reason")
            ids = choice.get("token_ids")
        except (KeyError, IndexError, TypeError):
            raise ServerError(f"POST {self.url}/completions answered {_short(json.dumps(answer))!r}, not a completion") from None
        if not isinstance(text, str) or reason not in ("stop", "length", "eos", None):
            raise ServerError(f"POST {self.url}/completions answered a malformed choice: {_short(json.dumps(choice))!r}")
        self.returns_token_ids = ids is not None
        if ids is not None:
            if not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
                raise ServerError(f"POST {self.url}/completions answered malformed token_ids: {_short(json.dumps(ids))!r}")
            if len(ids) > max_tokens:
                raise ServerError(f"POST {self.url}/completions answered {len(ids)} tokens, more than the {max_tokens} asked for")
            stop = next((k for k, t in enumerate(ids) if t in stop_ids), None)
            if stop is not None:  # vLLM includes the stop token; the answer is what comes before it
                return Completion(ids[:stop], text, True)
        return Completion(ids, text, reason in ("stop", "eos"))


def run_pool(work: list[int], task: Callable[[int], Any], concurrency: int, on_result: Callable[[int, Any], None]) -> None:
    """Run ``task(i)`` for every i in ``work`` on ``concurrency`` daemon threads, calling
    ``on_result(i, value)`` in this thread as each finishes. The first exception stops the pool:
    nothing new starts, the results of tasks that finished before are delivered, and it is
    raised here. Daemon threads never keep the process alive (a Ctrl-C ends the run at once)."""
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for i in work:
        todo.put(i)
    results: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results.put((i, task(i), None))
            except BaseException as err:  # noqa: BLE001 - handed to the main thread
                results.put((i, None, err))
                return

    threads = [threading.Thread(target=worker, daemon=True, name=f"regenerate-{n}") for n in range(min(concurrency, len(work)))]
    for thread in threads:
        thread.start()
    failure: Optional[BaseException] = None
    try:
        while True:
            # Threads first: once all are done, everything they produced is already queued.
            if not any(t.is_alive() for t in threads) and results.empty():
                break
            try:
                i, value, err = results.get(timeout=0.1)
            except queue.Empty:
                continue
            if err is not None:
                failure = failure or err
                stop.set()  # in-flight tasks finish and are delivered; nothing new starts
                continue
            on_result(i, value)
    finally:
        stop.set()
    if failure is not None:
        raise failure
