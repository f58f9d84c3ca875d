"""The probe: bad inputs and interruptions across the command line, as a careful user would try
them. Every row must end in one line naming the file, key or argument, with the documented exit
code (2 bad input, 1 an environment failure, 130/143 a run stopped by Ctrl-C/SIGTERM after saving),
and nothing the user owned may change on disk.

Rows run ``draftsmith.cli.main`` in this process (the same code path as the console script, without
paying for a new interpreter each time); the signal rows run a real subprocess.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from draftsmith.atomic import MANIFEST_NAME, TMP_PREFIX, current_umask
from draftsmith.cli import main
from draftsmith.runs import LOCK_NAME, checkpoint_problem, hold_folder, list_checkpoints
from draftsmith.testing import REPO, heads_recipe, launch_env, run_trainer, write_chats

pytestmark = pytest.mark.usefixtures("one_thread")


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` with the sha256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_llama_dir):
    """A trained tiny run, its export, and a folder of the user's own files."""
    root = tmp_path_factory.mktemp("bad-input")
    recipe = heads_recipe(root, tiny_llama_dir, "run", "train.max_steps=2", "train.save_every=2", "train.eval_every=2")
    run_trainer(recipe)
    assert main(["export", str(root / "run"), "--out", str(root / "export")]) == 0
    assert main(["eval", "--drafter", str(root / "export"), "--prompts", str(_prompts(root)), "--max-new-tokens", "4", "--out", str(root / "report")]) == 0
    user = root / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("a day of work\n")
    (user / "recipe.yaml").write_text("my own recipe, not draftsmith's\n")
    prompts = _prompts(root)
    latin1 = root / "latin1.jsonl"
    latin1.write_bytes(json.dumps({"prompt": "caf"}).encode()[:-2] + b'\xe9"}\n')
    asked = root / "asked"  # a folder of the user's holding a prompts file
    asked.mkdir()
    shutil.copy(prompts, asked / "questions.jsonl")
    lit = root / "lit"  # another tool's run, laid out with a checkpoints/ folder of its own
    (lit / "checkpoints" / "step-000999").mkdir(parents=True)
    (lit / "checkpoints" / "step-000999" / "weights.bin").write_bytes(b"\0" * 64)
    (lit / "recipe.yaml").write_text("my experiment's recipe\n")
    (lit / "metrics.jsonl").write_text('{"my": "metrics"}\n')
    return {"root": root, "recipe": root / "run.yaml", "run": root / "run", "export": root / "export", "report": root / "report", "user": user,
            "prompts": prompts, "latin1": latin1, "model": tiny_llama_dir, "asked": asked, "lit": lit, "data": root / "run" / "data"}  # fmt: skip


def _prompts(root: Path) -> Path:
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {w}"}) + "\n" for w in ("red cat", "blue dog")))
    return prompts


def damaged_copy(src: Path, dst: Path, damage) -> Path:
    shutil.copytree(src, dst)
    damage(dst)
    return dst


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF
    path.write_bytes(bytes(data))


# (name, argv builder, expected exit code, words the one line must hold, setup)
# A CUDA device this machine lacks: refused before any model loads or anything is written (the rows
# only hold where no GPU is visible; tests/gpu covers the machines that have one).
NO_CUDA = [] if torch.cuda.is_available() else [
    ("train --device cuda without a GPU", lambda w: ["train", str(w["recipe"]), "--device", "cuda"], 2, ["no CUDA device is visible", "--device cpu"]),
    ("a recipe's train.device that is no device", lambda w: ["train", str(w["recipe"]), "train.device=gpu"], 2, ["train.device", "auto, cpu or cuda"]),
    ("generate --device cuda:0 without a GPU", lambda w: ["generate", "--drafter", str(w["export"]), "--prompt", "hi", "--device", "cuda:0"], 2, ["--device", "no CUDA device"]),
]  # fmt: skip

ROWS = NO_CUDA + [
    ("missing recipe", lambda w: ["train", str(w["root"] / "nope.yaml")], 2, ["nope.yaml"]),
    ("missing data file", lambda w: ["train", str(w["recipe"]), f"data.path={w['root'] / 'gone.jsonl'}", f"output_dir={w['root'] / 'r2'}"], 2, ["data.path: data file not found", "gone.jsonl"]),
    ("unknown recipe key", lambda w: ["train", str(w["recipe"]), "train.lrr=1e-3"], 2, ["train.lrr", "train.lr"]),
    # Overrides after a flag still reach the recipe (argparse alone calls them unrecognized arguments).
    ("unknown recipe key after --device", lambda w: ["train", str(w["recipe"]), "--device", "cpu", "train.lrr=1e-3"], 2, ["train.lrr", "train.lr"]),
    ("output_dir is the user's folder", lambda w: ["train", str(w["recipe"]), f"output_dir={w['user']}"], 2, ["mine", "not a draftsmith run"]),
    # A checkpoints/ folder of another tool's does not make a draftsmith run; a data cache is none either.
    ("output_dir is another tool's run", lambda w: ["train", str(w["recipe"]), f"output_dir={w['lit']}"], 2, ["lit", "not a draftsmith run"]),
    ("output_dir is a data cache", lambda w: ["train", str(w["recipe"]), f"output_dir={w['data']}", f"data.cache_dir={w['root'] / 'd2'}"], 2, ["output_dir", "is a draftsmith data cache"]),
    ("output_dir and data.cache_dir are one folder", lambda w: ["train", str(w["recipe"]), f"output_dir={w['root'] / 'same'}", f"data.cache_dir={w['root'] / 'same'}"], 2, ["'output_dir' and 'data.cache_dir'", "same folder"]),
    ("resume=never on a run", lambda w: ["train", str(w["recipe"]), "train.resume=never"], 2, ["already holds checkpoints"]),
    ("resume another head kind", lambda w: ["train", str(w["recipe"]), "head.kind=hydra", "train.max_steps=3"], 2, ["head.kind", "hydra", "medusa"]),
    ("resume a reshaped head", lambda w: ["train", str(w["recipe"]), "head.num_heads=3", "train.max_steps=3"], 2, ["does not fit", "head"]),
    ("data cache in the user's folder", lambda w: ["prepare", str(w["recipe"]), f"data.cache_dir={w['user']}"], 2, ["data.cache_dir", "not a draftsmith data cache"]),
    ("train's data cache in the user's folder", lambda w: ["train", str(w["recipe"]), f"data.cache_dir={w['user']}"], 2, ["data.cache_dir", "not a draftsmith data cache"]),
    # A run's recipe.yaml and command.txt are its record; an export's files are what the user ships.
    ("the data cache in a run folder", lambda w: ["prepare", str(w["recipe"]), f"data.cache_dir={w['run']}", f"output_dir={w['root'] / 'r9'}"], 2, ["data.cache_dir", "training run's folder"]),
    ("train's data cache in an export", lambda w: ["train", str(w["recipe"]), f"data.cache_dir={w['export']}"], 2, ["data.cache_dir", "an export or a report"]),
    # eval and export each replace only their own earlier output, never the other's.
    ("eval --out over an export", lambda w: ["eval", "--drafter", str(w["run"]), "--prompts", str(w["prompts"]), "--out", str(w["export"])], 2, ["another draftsmith command's output", "--overwrite"]),
    # Not even --overwrite lets eval write over what it reads.
    ("eval --out over its own drafter", lambda w: ["eval", "--drafter", str(w["run"]), "--prompts", str(w["prompts"]), "--out", str(w["run"]), "--overwrite"], 2, ["is the input", "write somewhere else"]),
    ("eval --out inside the export it reads", lambda w: ["eval", "--drafter", str(w["export"]), "--prompts", str(w["prompts"]), "--out", str(w["export"] / "report")], 2, ["is inside the input", "write somewhere else"]),
    ("eval --out around its prompts", lambda w: ["eval", "--drafter", str(w["export"]), "--prompts", str(w["asked"] / "questions.jsonl"), "--out", str(w["asked"]), "--overwrite"], 2, ["contains the input", "questions.jsonl"]),
    ("export --out over an eval report", lambda w: ["export", str(w["run"]), "--out", str(w["report"])], 2, ["another draftsmith command's output", "--overwrite"]),
    # A training run, a data cache and the drafter's own target are never replaced, --overwrite or not.
    ("eval --out over a training run", lambda w: ["eval", "--drafter", str(w["export"]), "--prompts", str(w["prompts"]), "--out", str(w["run"]), "--overwrite"], 2, ["training run", "not even with --overwrite"]),
    ("export --out over a data cache", lambda w: ["export", str(w["run"]), "--out", str(w["data"]), "--overwrite"], 2, ["data cache", "not even with --overwrite"]),
    ("export --out over its target", lambda w: ["export", str(w["run"]), "--out", str(w["model"]), "--overwrite"], 2, ["is the input", "write somewhere else"]),
    ("a mistyped built-in drafter", lambda w: ["generate", "--drafter", "sufix", "--prompt", "hi"], 2, ["sufix", "did you mean 'suffix'", "built-in name"]),
    # argparse names a missing required flag before an unknown one: the mistyped flag comes first.
    ("a mistyped flag beside a required one", lambda w: ["generate", "--drafter", "suffix", "--promt", "hi"], 2, ["unrecognized arguments: --promt", "did you mean --prompt?"]),
    ("a mistyped flag after the required ones", lambda w: ["generate", "--drafter", "suffix", "--prompt", "hi", "--temprature", "1"], 2, ["draftsmith generate: unrecognized", "--temprature (did you mean --temperature?)"]),
    # Python hands a non-UTF-8 argument over surrogate-escaped (a latin-1 terminal's "café").
    ("a prompt that is not UTF-8", lambda w: ["generate", "--drafter", "suffix", "--prompt", "caf\udce9"], 2, ["--prompt is not valid UTF-8", "character 4", "0xe9"]),
    ("a number flag given a word", lambda w: ["generate", "--drafter", "suffix", "--prompt", "hi", "--max-new-tokens", "abc"], 2, ["--max-new-tokens: invalid int value: 'abc'"]),
    ("an exit-layer list with a word", lambda w: ["eval", "--drafter", str(w["model"]), "--prompts", str(w["prompts"]), "--out", str(w["root"] / "x4"), "--exit-layer", "sweep,3"], 2, ["--exit-layer", "comma-separated", "'sweep,3'"]),
    ("an override without its value", lambda w: ["train", str(w["recipe"]), "train.max_steps"], 2, ["train.max_steps", "key=value"]),
    # Flags that belong to another drafter are refused, not ignored.
    ("--exit-layer for suffix matching", lambda w: ["generate", "--drafter", "suffix", "--prompt", "hi", "--exit-layer", "4"], 2, ["--exit-layer", "suffix"]),
    ("n-gram sizes for suffix matching", lambda w: ["generate", "--drafter", "suffix", "--prompt", "hi", "--prompt-lookup-max", "2"], 2, ["--prompt-lookup-max", "--drafter lookup"]),
    ("export a plain model folder", lambda w: ["export", str(w["model"]), "--out", str(w["root"] / "x3")], 2, ["without the recipe.yaml", "eval --drafter"]),
    # Flags of another layout are refused, not ignored.
    ("export --verifier outside speculators' layout", lambda w: ["export", str(w["run"]), "--out", str(w["root"] / "x5"), "--format", "vllm", "--verifier", "org/x"], 2, ["--verifier", "--format speculators"]),
    ("export --num-speculative-tokens in draftsmith's layout", lambda w: ["export", str(w["run"]), "--out", str(w["root"] / "x6"), "--num-speculative-tokens", "2"], 2, ["--num-speculative-tokens", "vllm"]),
    ("export --verifier at a path that is not there", lambda w: ["export", str(w["run"]), "--out", str(w["root"] / "x7"), "--format", "speculators", "--verifier", str(w["root"] / "nope")], 2, ["--verifier", "no such folder"]),
    ("export from nowhere", lambda w: ["export", str(w["root"] / "nope"), "--out", str(w["root"] / "x1")], 2, ["not found"]),
    ("export over the user's folder", lambda w: ["export", str(w["run"]), "--out", str(w["user"])], 2, ["mine", "--overwrite"]),
    ("export into the checkpoint it reads", lambda w: ["export", str(w["run"]), "--out", str(next((w["run"] / "checkpoints").iterdir()) / "x")], 2, ["inside the input"]),
    ("export around the run", lambda w: ["export", str(w["run"]), "--out", str(w["root"])], 2, ["contains the input"]),
    ("export an unknown format", lambda w: ["export", str(w["run"]), "--out", str(w["root"] / "x2"), "--format", "onnx"], 2, ["--format", "onnx"]),
    ("export to a read-only place", lambda w: ["export", str(w["run"]), "--out", "/sys/draftsmith-probe"], 1, ["PermissionError", "--debug"]),
    ("a flipped byte in a checkpoint", lambda w: ["export", str(damaged_copy(w["run"], w["root"] / "run-flipped", lambda d: flip(next((d / "checkpoints").iterdir()) / "model.safetensors"))), "--out", str(w["root"] / "x3")], 2, ["sha256", "model.safetensors"]),
    ("a truncated export", lambda w: ["generate", "--drafter", str(damaged_copy(w["export"], w["root"] / "export-cut", lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:64]))), "--prompt", "hi"], 2, ["model.safetensors"]),
    ("a cut-off config.json", lambda w: ["eval", "--drafter", str(damaged_copy(w["export"], w["root"] / "export-config", lambda d: (d / "config.json").write_text((d / "config.json").read_text()[:30]))), "--prompts", str(w["prompts"]), "--out", str(w["root"] / "e1")], 2, ["config.json"]),
    ("a relative target recorded elsewhere", lambda w: ["generate", "--drafter", str(damaged_copy(w["export"], w["root"] / "export-relative", _relative_target)), "--prompt", "hi"], 2, ["records its target as 'tiny-target'", "pass --target"]),
    ("an unknown head kind", lambda w: ["eval", "--drafter", str(damaged_copy(w["export"], w["root"] / "export-kind", _unknown_kind)), "--prompts", str(w["prompts"]), "--out", str(w["root"] / "e2")], 2, ["teleport"]),
    ("--limit 0", lambda w: ["eval", "--drafter", str(w["export"]), "--prompts", str(w["prompts"]), "--limit", "0", "--out", str(w["root"] / "e3")], 2, ["--limit"]),
    ("--limit -1", lambda w: ["eval", "--drafter", str(w["export"]), "--prompts", str(w["prompts"]), "--limit", "-1", "--out", str(w["root"] / "e4")], 2, ["--limit"]),
    ("eval --out is a file", lambda w: ["eval", "--drafter", str(w["export"]), "--prompts", str(w["prompts"]), "--out", str(w["user"] / "notes.txt")], 2, ["notes.txt", "not a folder"]),
    ("eval --out is the user's folder", lambda w: ["eval", "--drafter", str(w["export"]), "--prompts", str(w["prompts"]), "--out", str(w["user"])], 2, ["--overwrite"]),
    ("a tree of a million nodes", lambda w: ["generate", "--drafter", str(w["export"]), "--prompt", "hi", "--tree", "1000000"], 2, ["1000000 drafted nodes", "limits"]),
    ("a tree of no choices", lambda w: ["generate", "--drafter", str(w["export"]), "--prompt", "hi", "--tree", "[]"], 2, ["'[]' drafts nothing"]),
    ("a target that is a file", lambda w: ["generate", "--drafter", "suffix", "--target", str(w["prompts"]), "--prompt", "hi"], 2, ["is a file, not a model folder"]),
    ("a dynamic tree past the limits", lambda w: ["generate", "--drafter", str(w["export"]), "--prompt", "hi", "--tree", "dynamic:3,3,100000"], 2, ["limits"]),
    ("a billion new tokens", lambda w: ["generate", "--drafter", str(w["export"]), "--prompt", "hi", "--max-new-tokens", "1000000000"], 2, ["--max-new-tokens"]),
    ("a negative temperature", lambda w: ["generate", "--drafter", str(w["export"]), "--prompt", "hi", "--temperature", "-1"], 2, ["--temperature"]),
    ("typical acceptance at temperature 0", lambda w: ["generate", "--drafter", str(w["export"]), "--prompt", "hi", "--verify", "typical"], 2, ["--verify typical", "temperature"]),
    ("prompts that are not UTF-8", lambda w: ["eval", "--drafter", str(w["export"]), "--prompts", str(w["latin1"]), "--out", str(w["root"] / "e5")], 2, ["latin1.jsonl", "not UTF-8"]),
    ("push an invalid repo id", lambda w: ["push", str(w["export"]), "--repo-id", "no good/repo id"], 2, ["--repo-id"]),
    ("push a damaged export", lambda w: ["push", str(damaged_copy(w["export"], w["root"] / "export-push", lambda d: flip(d / "model.safetensors"))), "--repo-id", "me/x"], 2, ["sha256"]),
    ("serve-target without vLLM", lambda w: ["serve-target", str(w["recipe"]), "--port", str(free_port())], 2, ["no vLLM venv", "make vllm"]),
    # Numbers that are not numbers: nan passes every `x < low` check, so each is refused by name.
    ("a temperature of nan", lambda w: ["generate", "--drafter", str(w["export"]), "--prompt", "hi", "--temperature", "nan"], 2, ["--temperature", "finite"]),
    ("a top-p of nan", lambda w: ["eval", "--drafter", str(w["export"]), "--prompts", str(w["prompts"]), "--top-p", "nan", "--out", str(w["root"] / "e6")], 2, ["--top-p", "finite"]),
    ("an infinite temperature", lambda w: ["eval", "--drafter", str(w["export"]), "--prompts", str(w["prompts"]), "--temperature", "inf", "--out", str(w["root"] / "e7")], 2, ["--temperature", "finite"]),
    ("push with a timeout of nan", lambda w: ["push", str(w["export"]), "--repo-id", "me/x", "--timeout", "nan"], 2, ["--timeout", "finite"]),
    ("a learning rate of nan", lambda w: ["train", str(w["recipe"]), "train.lr=nan"], 2, ["train.lr", "finite"]),
    # Destinations and prompts checked before a model loads (here the drafter does not even exist).
    ("eval --out where nothing can be written", lambda w: ["eval", "--drafter", str(w["root"] / "nope"), "--prompts", str(w["prompts"]), "--out", "/sys/draftsmith-probe"], 1, ["PermissionError", "/sys/draftsmith-probe"]),
    ("an empty --prompt", lambda w: ["generate", "--drafter", str(w["export"]), "--prompt", "  "], 2, ["--prompt", "empty"]),
    ("a prompt longer than the target's context", lambda w: ["generate", "--drafter", str(w["export"]), "--prompt", "say " * 300, "--max-new-tokens", "4"], 2, ["--prompt", "1024", "context"]),
    ("more new tokens than the target's context", lambda w: ["generate", "--drafter", str(w["export"]), "--prompt", "hi", "--max-new-tokens", "2000"], 2, ["--max-new-tokens 2000 is too many", "1024"]),
    # More tokens per step than the drafter has heads (DFlash's block rule has its own tests).
    ("3 tokens a step from 2 Medusa heads", lambda w: ["export", str(w["run"]), "--out", str(w["root"] / "x4"), "--format", "vllm", "--num-speculative-tokens", "3"], 2, ["2 heads", "--num-speculative-tokens 2"]),
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _relative_target(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["draftsmith"]["target"]["path"] = "tiny-target"  # as a run started beside its target records it
    (folder / "config.json").write_text(json.dumps(config))
    (folder / MANIFEST_NAME).unlink()  # edited by hand, not damaged


def _unknown_kind(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["draftsmith"]["head"]["kind"] = "teleport"
    (folder / "config.json").write_text(json.dumps(config))
    (folder / MANIFEST_NAME).unlink()  # edited by hand, not damaged


@pytest.mark.parametrize("name, argv, code, words", ROWS, ids=[row[0] for row in ROWS])
def test_bad_input_is_one_line_with_its_exit_code_and_loses_nothing(world, capsys, monkeypatch, name, argv, code, words):
    monkeypatch.setenv("DRAFTSMITH_VLLM_VENV", str(world["root"] / "no-venv"))
    before = {key: snapshot(world[key]) for key in ("user", "run", "export", "report", "lit", "model")}
    args = argv(world)
    capsys.readouterr()
    started = time.monotonic()
    got = main(args)
    text = capsys.readouterr().err
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert got == code and len(errors) == 1 and "Traceback" not in text, (name, got, text[-3000:])
    for word in words:
        assert word in errors[0], (name, word, errors[0])
    assert time.monotonic() - started < 120, f"{name} took {time.monotonic() - started:.0f} s"
    for key, files in before.items():
        assert snapshot(world[key]) == files, f"{name} changed {key}"


def test_the_user_folder_survives_every_row(world):
    assert (world["user"] / "notes.txt").read_text() == "a day of work\n"
    assert (world["user"] / "recipe.yaml").read_text() == "my own recipe, not draftsmith's\n"
    assert (world["asked"] / "questions.jsonl").read_bytes() == world["prompts"].read_bytes()
    assert list_checkpoints(world["run"]), "the run eval was pointed at lost its checkpoints"
    assert (world["lit"] / "recipe.yaml").read_text() == "my experiment's recipe\n"
    assert (world["data"] / "recipe.yaml").exists() is False and any(world["data"].glob("examples-*.pt"))


def _silent_server() -> tuple[socket.socket, str]:
    """A server that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held = []

    def accept():
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return server, f"http://127.0.0.1:{server.getsockname()[1]}"


def test_push_gives_up_on_a_hub_that_never_answers_and_on_one_that_is_not_there(world):
    """huggingface_hub reads HF_ENDPOINT and offline mode when it is imported: a fresh process."""

    def push(url: str, *flags: str):
        env = {**os.environ, "HF_ENDPOINT": url, "HF_TOKEN": "hf_test", "HF_HUB_OFFLINE": "0"}
        cmd = [sys.executable, "-m", "draftsmith.cli", "push", str(world["export"]), "--repo-id", "me/tiny", *flags]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)

    server, url = _silent_server()
    try:
        started = time.monotonic()
        done = push(url, "--timeout", "2", "--deadline", "30")
        assert done.returncode == 1 and done.stderr.count("\n") == 1 and "did not answer within 2 s" in done.stderr and url in done.stderr, done.stderr
        assert time.monotonic() - started < 60
    finally:
        server.close()
    # Nothing listens there any more: refused at once, one line, exit 1 (the environment, not the input).
    done = push(url, "--timeout", "2")
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "cannot reach the Hub" in done.stderr, done.stderr


def test_debug_shows_the_traceback_the_one_line_hides(world):
    missing = str(world["root"] / "nope")
    quiet = subprocess.run([sys.executable, "-m", "draftsmith.cli", "export", missing, "--out", str(world["root"] / "y")], cwd=REPO, capture_output=True, text=True)
    loud = subprocess.run([sys.executable, "-m", "draftsmith.cli", "export", missing, "--out", str(world["root"] / "y"), "--debug"], cwd=REPO, capture_output=True, text=True)
    assert quiet.returncode == 2 and "Traceback" not in quiet.stderr and quiet.stderr.count("\n") == 1, quiet.stderr
    assert loud.returncode != 0 and "Traceback" in loud.stderr and "ArtifactError" in loud.stderr, loud.stderr[-2000:]


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stopped_run_saves_then_exits_130_or_143(tmp_path, tiny_llama_dir, sig, code):
    """`train && export` must not export a half-trained drafter: Ctrl-C and SIGTERM save a
    checkpoint, say how to resume, and exit as shells report a signal."""
    data = write_chats(tmp_path / "chats.jsonl", n=24, words=3)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"""
trainer: heads
output_dir: {tmp_path / 'run'}
target: {{path: {tiny_llama_dir}}}
data: {{path: {data}, eval_size: 4, max_length: 64, seed: 1}}
head: {{kind: medusa, num_heads: 2, num_layers: 1}}
train: {{micro_batch_size: 2, max_steps: 100000, lr: 0.01, log_every: 1, eval_every: 100000, save_every: 100000, lr_schedule: constant}}
"""
    )
    proc = subprocess.Popen([sys.executable, "-m", "draftsmith.cli", "train", str(recipe)], cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.time() + 180
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "training did not start"
            time.sleep(0.2)
        # One run folder, one writer: the same command started again while this one runs is
        # refused in one line naming the process that holds the folder, and changes nothing.
        before = snapshot(tmp_path / "run" / "checkpoints") if (tmp_path / "run" / "checkpoints").is_dir() else {}
        # (a short schedule: where nothing refused it, the second run would end on its own)
        assert_one_line(["train", str(recipe), "train.max_steps=1"], 2, ["in use", f"pid {proc.pid}", str(tmp_path / "run")])
        if before:
            assert snapshot(tmp_path / "run" / "checkpoints") == before
        os.kill(proc.pid, sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code, out[-2000:] + err[-3000:]
    assert "stopped at step" in out and "run the same command to resume" in err, out[-2000:] + err[-2000:]
    assert list((tmp_path / "run" / "checkpoints").glob("step-*")), "no checkpoint was saved"
    assert not (tmp_path / "run" / LOCK_NAME).exists(), "the stopped run kept its folder locked"


def assert_one_line(argv: list[str], code: int, words: list[str]) -> str:
    """Run the command line in this process: exit `code`, exactly one error line holding `words`."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        got = main(argv)
    text = err.getvalue()
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert got == code and len(errors) == 1 and "Traceback" not in text, (argv, got, text[-3000:])
    for word in words:
        assert word in errors[0], (word, errors[0])
    return errors[0]


def test_a_data_cache_has_one_writer_and_a_stale_lock_is_taken_over(world, tmp_path):
    """`prepare` on a data cache another process holds is refused naming it; once that process is
    gone (killed: it could not let go), the lock file it left is taken over with a warning."""
    cache = tmp_path / "cache"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from draftsmith.runs import hold_folder; import time; hold_folder({str(cache)!r}); print('held', flush=True); time.sleep(300)"],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        assert_one_line(["prepare", str(world["recipe"]), f"data.cache_dir={cache}"], 2, ["data.cache_dir", "in use", f"pid {holder.pid}"])
        assert sorted(p.name for p in cache.iterdir()) == [LOCK_NAME]
    finally:
        holder.kill()
        holder.wait()
    warnings = []
    with hold_folder(cache, "data.cache_dir", warn=warnings.append):
        assert json.loads((cache / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert len(warnings) == 1 and f"pid {holder.pid}" in warnings[0] and "taking it over" in warnings[0], warnings
    assert not (cache / LOCK_NAME).exists()
    assert main(["prepare", str(world["recipe"]), f"data.cache_dir={cache}"]) == 0
    assert not (cache / LOCK_NAME).exists() and (cache / "command.txt").is_file()


def test_every_file_draftsmith_writes_honours_the_umask(world):
    """safetensors creates its files 0600: an export another user serves must be readable as the
    umask says, like every other file of a run and an export."""
    want = 0o666 & ~current_umask()
    for key in ("run", "export"):
        modes = {str(p.relative_to(world[key])): oct(p.stat().st_mode & 0o777) for p in world[key].rglob("*") if p.is_file()}
        wrong = {name: mode for name, mode in modes.items() if mode != oct(want)}
        assert modes and not wrong, (key, oct(want), wrong)


# ----------------------------------------------------------------------------- full disks


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB file system of its own (tmpfs) that a test can fill; skipped where this machine does
    not let the tests mount one (mounting needs root, or a container that allows it)."""
    where = tmp_path / "small-disk"
    where.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command: the disk-full cases need a small tmpfs")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip() or 'mount failed'}): the disk-full cases need one")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(disk: Path, leave: int) -> None:
    """Fill `disk` with one file until about `leave` bytes are free."""
    free = shutil.disk_usage(disk).free
    with open(disk / "filler", "wb") as fh:
        fh.write(b"\0" * max(free - leave, 0))


def leftovers(folder: Path) -> list[str]:
    return [str(p.relative_to(folder)) for p in folder.rglob("*") if p.name.startswith(TMP_PREFIX)]


def test_a_disk_that_fills_at_a_checkpoint_is_one_line_and_keeps_the_last_good_one(small_disk, tiny_llama_dir):
    """torch reports the full disk as "enforce fail at inline_container.cc ... unexpected pos"; the
    user reads that the disk is full and where, and finds the checkpoints written before intact
    and no half-written one."""
    data = write_chats(small_disk.parent / "chats.jsonl", n=24, words=3)
    run = small_disk / "run"
    recipe = small_disk.parent / "recipe.yaml"
    recipe.write_text(
        f"""
trainer: heads
output_dir: {run}
target: {{path: {tiny_llama_dir}}}
data: {{path: {data}, eval_size: 4, max_length: 64, seed: 1}}
head: {{kind: medusa, num_heads: 2, num_layers: 1}}
train: {{micro_batch_size: 2, max_steps: 60, lr: 0.01, log_every: 1, eval_every: 100000, save_every: 1, keep_last: 100, lr_schedule: constant}}
"""
    )
    line = assert_one_line(["train", str(recipe)], 1, ["disk is full", str(run)])
    assert "unexpected" not in line, line
    assert not leftovers(run), leftovers(run)
    kept = list_checkpoints(run)
    assert kept and checkpoint_problem(kept[-1], verify_contents=True) is None, kept
    assert not (run / LOCK_NAME).exists()


def test_a_full_disk_under_eval_export_and_prepare_leaves_nothing_partial(world, small_disk):
    fill(small_disk, leave=16 * 1024)
    before = snapshot(small_disk)
    cases = [
        ["eval", "--drafter", str(world["export"]), "--prompts", str(world["prompts"]), "--max-new-tokens", "4", "--out", str(small_disk / "report")],
        ["export", str(world["run"]), "--out", str(small_disk / "export")],
        ["prepare", str(world["recipe"]), f"data.cache_dir={small_disk / 'data'}"],
    ]
    for argv in cases:
        line = assert_one_line(argv, 1, ["disk is full", str(small_disk)])
        assert "unexpected" not in line, line
        assert snapshot(small_disk) == before and sorted(p.name for p in small_disk.iterdir()) == ["filler"], (argv, sorted(small_disk.rglob("*")))


def test_an_out_that_is_a_mount_point_is_refused_before_any_work(world, small_disk):
    """export and eval write a folder beside --out and rename it into place: onto a mount point that
    failed after the work with "Device or resource busy", exit 1."""
    cases = [
        ["export", str(world["run"]), "--out", str(small_disk)],
        ["eval", "--drafter", str(world["export"]), "--prompts", str(world["prompts"]), "--max-new-tokens", "4", "--out", str(small_disk)],
    ]
    for argv in cases:
        assert_one_line(argv, 2, ["mount point", str(small_disk)])
        assert sorted(p.name for p in small_disk.iterdir()) == []


def test_serve_target_refuses_a_port_in_use_and_a_dead_server_names_its_cause(world, tmp_path):
    """A port already taken is refused before vLLM starts (it took 14 s to find out, and said only
    "exited with code 1"); a server that dies while starting is one line with the log's cause."""
    from draftsmith.data.server import ServerError
    from draftsmith.serving import vllm_openai_server

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert_one_line(["serve-target", str(world["recipe"]), "--port", str(port)], 2, ["--port", str(port), "in use"])
    # This interpreter has no vLLM: the server exits at once, and the log says why.
    with pytest.raises(ServerError) as err:
        with vllm_openai_server(sys.executable, world["model"], "tiny", tmp_path / "server.log"):
            pass
    message = str(err.value)
    assert "\n" not in message and "No module named 'vllm" in message and str(tmp_path / "server.log") in message, message


def test_a_checkpoint_is_known_by_its_contents_not_its_name(world, tmp_path):
    """An intact step-N copied to `best`, or a link to it under another name, is the same
    checkpoint: it exports (the old reading took the name for the step and called it damaged)."""
    step = list_checkpoints(world["run"])[-1]
    shutil.copytree(step, tmp_path / "best")
    (tmp_path / "latest").symlink_to(step, target_is_directory=True)
    for name in ("best", "latest"):
        assert main(["export", str(tmp_path / name), "--out", str(tmp_path / f"export-{name}")]) == 0, name
        assert (tmp_path / f"export-{name}" / "model.safetensors").read_bytes() == (world["export"] / "model.safetensors").read_bytes()


def test_eval_counts_the_prompts_it_skips_and_says_why(world, tmp_path, capsys):
    """An empty record and a prompt longer than the target's context (1024 positions) are skipped
    with a warning that counts them, not silently and not cut; the report counts what ran."""
    prompts = tmp_path / "prompts.jsonl"
    records = [{"prompt": "say red cat"}, {"prompt": ""}, {"prompt": "say " * 300}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    capsys.readouterr()
    assert main(["eval", "--drafter", str(world["export"]), "--prompts", str(prompts), "--max-new-tokens", "4", "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert "skipped 1 record(s)" in err and "skipping 1 of 2 prompts longer than the target's context" in err and "not cut" in err, err[-2000:]
    assert json.loads((tmp_path / "r" / "report.json").read_text())["num_prompts"] == 1


def test_eval_replaces_a_report_an_earlier_eval_left_half_written(world, tmp_path):
    """What an interrupted eval of an earlier version left (report files, no manifest) is its own
    output, not the user's: the rerun replaces it instead of asking for --overwrite."""
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.json").write_text('{"mean_accepted_length": 1.')
    (out / "report.md").write_text("# Acceptance")
    assert main(["eval", "--drafter", str(world["export"]), "--prompts", str(world["prompts"]), "--max-new-tokens", "4", "--out", str(out)]) == 0
    assert json.loads((out / "report.json").read_text())["num_prompts"] == 2 and (out / MANIFEST_NAME).is_file()


@pytest.mark.parametrize("max_steps,words", [(1, "already at step 2, past train.max_steps=1"), (2, "already at step 2, train.max_steps")])
def test_a_run_already_at_its_max_steps_says_so_and_keeps_its_record(world, capsys, max_steps, words):
    """Training a finished run again with train.max_steps at or below its step trains nothing: it
    says so, and the run's recipe.yaml (the schedule its checkpoints came from) and its
    final_metrics.json stay as they were."""
    before = snapshot(world["run"])
    assert main(["train", str(world["recipe"]), f"train.max_steps={max_steps}"]) == 0
    said = "".join(capsys.readouterr())
    assert words in said and "nothing to train" in said, said[-2000:]
    after = snapshot(world["run"])
    assert after["recipe.yaml"] == before["recipe.yaml"] and after["command.txt"] == before["command.txt"]
    assert after["final_metrics.json"] == before["final_metrics.json"]
    assert {k: v for k, v in after.items() if "checkpoints" in k} == {k: v for k, v in before.items() if "checkpoints" in k}


def test_a_prompts_file_with_a_byte_order_mark_is_read(tmp_path):
    """Editors that save UTF-8 with a byte-order mark: the mark is not part of the first record."""
    from draftsmith.eval.run import load_prompts

    marked = tmp_path / "bom.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "say red cat"}\n{"prompt": "say blue dog"}\n')
    assert [m[-1]["content"] for m in load_prompts(str(marked), None)] == ["say red cat", "say blue dog"]
    # Past the mark, a byte that is not UTF-8 is still named where it is.
    marked.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(Exception, match=r"bom.jsonl:2: not UTF-8 text \(byte 34: b'\\xe9'\)"):
        load_prompts(str(marked), None)


def test_a_tree_too_deep_and_an_exit_layer_out_of_range_are_refused_before_any_model_loads(world, monkeypatch):
    """What the folder's config already says (the head's depth, the model's layer count) is checked
    before the target loads: a 135M-parameter load is seconds a user waits for a refusal."""
    from draftsmith.runtime.load import load_drafter
    from draftsmith.target import FrozenTarget

    def refuse(*args, **kwargs):
        raise AssertionError("a model loaded before the refusal")

    monkeypatch.setattr(FrozenTarget, "load", refuse)
    monkeypatch.setattr("draftsmith.runtime.load.early_exit_target", refuse)
    with pytest.raises(Exception, match=r"the tree is 9 deep but the medusa head drafts \d tokens"):
        load_drafter(world["export"], tree="1,1,1,1,1,1,1,1,1")
    with pytest.raises(Exception, match=r"exit layer 40 is outside 1..\d+: the model has \d+ decoder layers"):
        load_drafter(world["model"], exit_layer=40)


def test_eval_reads_a_built_in_drafter_by_name_even_beside_a_folder_of_that_name(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from draftsmith.cli import eval_reads

    monkeypatch.chdir(tmp_path)
    for name in ("suffix", "smollm2-135m", "mtbench", "run"):
        (tmp_path / name).mkdir()
    (tmp_path / "run" / "checkpoints").mkdir()
    asked = SimpleNamespace(drafter="suffix", target="smollm2-135m", prompts="mtbench")
    assert eval_reads(asked) == ([Path("mtbench")], [])  # a path of --prompts' name is what load_prompts reads
    asked = SimpleNamespace(drafter="run", target=None, prompts="mtbench")
    assert eval_reads(asked) == ([Path("mtbench")], [Path("run")])  # a report may go inside a run folder


@pytest.mark.parametrize("argv,said", [
    (["generate", "--prompt", "--explain this"], "the following arguments are required: --drafter"),  # a value, not a flag
    (["generate", "--drafter", "suffix", "--prompt", "hi", "extra words here"], "unrecognized arguments: extra words here ("),  # one argument
    (["generate", "--drafter", "suffix", "--prompt", "hi", "--", "x"], "unrecognized arguments: x ("),
    (["--verison"], "unrecognized arguments: --verison (did you mean --version?)"),
])  # fmt: skip
def test_what_the_command_line_got_wrong_is_said_as_given(capsys, argv, said):
    assert main(argv) == 2
    assert said in capsys.readouterr().err
