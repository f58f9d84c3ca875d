import os

import pytest

# Keep tests offline and quiet whatever the machine's environment says.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Triton fixes interpreted vs compiled per process, when it is first imported (torch and
# transformers import it while test modules are collected). Without CUDA the kernel tests need the
# interpreter, so it is switched on here, before any of that; with CUDA the session stays compiled
# for tests/gpu and the interpreter tests skip (run them alone with TRITON_INTERPRET=1).
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from draftsmith.testing import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from draftsmith.testing import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    from draftsmith.testing import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


# What `dtype: auto` picks depends on the CPU (bf16 only where native); the suite pins float32 so
# its results are the same on every machine, subprocess launches included. Tests of the bf16 paths
# ask for bfloat16 explicitly; tests of auto_dtype itself clear this variable.
os.environ.setdefault("DRAFTSMITH_AUTO_DTYPE", "float32")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests: tiny models gain nothing from more, and idle OpenMP
    threads spin and oversubscribe a shared 2-core machine (use with pytest.mark.usefixtures)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def local_hub():
    """The Hugging Face Hub stand-in on 127.0.0.1 (tests/hub_server.py): ``with local_hub() as hub``."""
    from hub_server import LocalHub

    return LocalHub


# DRAFTSMITH_FAILURE_LOG=FILE: each failing test's id and traceback appended to FILE as it fails
# (scripts/gpu_check.py sets it), so a step stopped at its time limit still says what failed and why.
# Under pytest-xdist the controller writes it: workers pass their reports up.
_failure_log = os.environ.get("DRAFTSMITH_FAILURE_LOG")


def pytest_runtest_logreport(report):
    if not _failure_log or not report.failed:
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(_failure_log, "a") as fh:
        fh.write(f"=== {report.when} {report.nodeid}\n{report.longreprtext[-6000:]}\n\n")
