"""Test support: tiny random models, a character-level chat tokenizer, learnable chats, recipe
builders and launchers, for tests and benchmarks.

Nothing here downloads anything. The tokenizer speaks ChatML (like SmolLM2 and Qwen2), so chat
templates, loss masks and regeneration run on it exactly as on a real model.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Literal

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]


def tiny_tokenizer():
    """A character-level fast tokenizer with ChatML specials: ~100 tokens, any ASCII text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    chars = list(string.printable)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        bos_token=None,
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_causal_lm(
    arch: Literal["llama", "qwen2"] = "llama",
    vocab_size: int = 104,
    hidden_size: int = 64,
    num_layers: int = 3,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
):
    """A small random Llama or Qwen2 causal LM (eager attention, fp32 by default)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=1,
    )
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    return model.to(dtype).eval()


def save_tiny_model(folder: str | Path, arch: Literal["llama", "qwen2"] = "llama", seed: int = 0, **kwargs) -> Path:
    """Save a tiny model plus the tiny tokenizer as an HF folder that FrozenTarget.load reads."""
    folder = Path(folder)
    tokenizer = tiny_tokenizer()
    model = tiny_causal_lm(arch, vocab_size=len(tokenizer), seed=seed, **kwargs)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------------- data and runs for tests

WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree"]


def write_chats(path: str | Path, n: int = 40, words: int = 4, seed: int = 0) -> Path:
    """A JSONL file of `n` conversations whose answers follow a learnable rule: each answer repeats
    the question's `words` random words twice ("say red cat" -> "red cat red cat")."""
    import json
    import random

    rng = random.Random(seed)
    path = Path(path)
    with open(path, "w") as fh:
        for _ in range(n):
            picked = [rng.choice(WORDS) for _ in range(words)]
            turns = [{"role": "user", "content": "say " + " ".join(picked)}, {"role": "assistant", "content": " ".join(picked * 2)}]
            fh.write(json.dumps({"messages": turns}) + "\n")
    return path


def write_recipe(path: str | Path, text: str, *overrides: str):
    """Write recipe YAML `text` to `path` and load it with `overrides` (key=value)."""
    from draftsmith.recipe import load_recipe

    path = Path(path)
    path.write_text(text)
    return load_recipe(path, overrides=list(overrides))


def heads_recipe(tmp_path: Path, model_dir: Path, name: str, *overrides: str, head: str = "{kind: medusa, num_heads: 2, num_layers: 1, lm_head: own}"):
    """A head-trainer recipe on a tiny model and write_chats data: 30 steps of 4 examples."""
    data = write_chats(tmp_path / "chats.jsonl")
    text = f"""
trainer: heads
output_dir: {tmp_path / name}
target: {{path: {model_dir}}}
data: {{path: {data}, eval_size: 8, max_length: 96, seed: 1}}
head: {head}
train: {{micro_batch_size: 4, max_steps: 30, lr: 0.01, warmup_steps: 2, log_every: 1, eval_every: 30, save_every: 10}}
"""
    return write_recipe(tmp_path / f"{name}.yaml", text, *overrides)


def logged(run_dir: str | Path, kind: str = "train", key: str = "loss") -> dict[int, float]:
    """{step: value} of `key` in the records of `kind` in a run's metrics.jsonl."""
    import json

    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in records if r["kind"] == kind}


def run_trainer(recipe, interrupt_at: int | None = None):
    """Set up and train `recipe` in this process. With `interrupt_at`, the trainer gets a SIGTERM
    at the end of that step (as a scheduler's kill would arrive). Returns (trainer, summary, the
    state dict of the trainer's ``watched`` model before training: the frozen target, or the model
    that trains)."""
    import os
    import signal

    from draftsmith.trainers import TRAINERS

    trainer = TRAINERS[recipe.trainer](recipe, argv=["draftsmith", "train", "test"]).setup()
    if interrupt_at is not None:
        original = trainer.advance

        def advance_then_signal():
            position, values = original()
            if position == interrupt_at:
                os.kill(os.getpid(), signal.SIGTERM)
            return position, values

        trainer.advance = advance_then_signal
    before = {k: v.clone() for k, v in trainer.watched.state_dict().items()}
    try:
        summary = trainer.train()
        trainer.optimized = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    finally:
        trainer.close()
    return trainer, summary, before


REPO = Path(__file__).resolve().parents[1]


def load_script(relative: str):
    """A script of the repository (scripts/...) imported as a module, so a test can call its main."""
    import importlib.util

    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

# How each launcher starts N processes of a module (the command line continues with the module).
LAUNCHERS = {
    "torchrun": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node={n}", "-m"],
    # accelerate 1.15 on CPU: --cpu would silently run one process; --multi_gpu with
    # ACCELERATE_USE_CPU=true runs N (docs/ENVIRONMENT.md).
    "accelerate": ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes={n}", "-m"],
    # The deepspeed launcher injects --local_rank=N into the command line and sets no OMP_NUM_THREADS.
    "deepspeed": ["-m", "deepspeed.launcher.runner", "--num_gpus={n}", "--module"],
}


def launch_env() -> dict:
    """This process's environment without a launcher's rank variables, offline, on CPU ranks: the
    multi-process tests are of CPU training over gloo (CUDA hidden from them, DeepSpeed on CPU);
    tests/gpu launches CUDA ranks itself."""
    import os

    out = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out.update(
        DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    return out


def launch(*args: str, nproc: int = 2, timeout: int = 300, launcher: str = "torchrun", check: bool = True):
    """`LAUNCHER ... -m draftsmith.cli train ARGS` with N processes (torchrun by default), or one
    plain process. With `check`, a non-zero exit or the teardown trap ("terminate called", see
    docs/ENVIRONMENT.md) fails with the output's tail. Returns the CompletedProcess."""
    import subprocess
    import sys

    if nproc > 1:
        cmd = [sys.executable] + [part.format(n=nproc) for part in LAUNCHERS[launcher]] + ["draftsmith.cli", "train", *args]
    else:
        cmd = [sys.executable, "-m", "draftsmith.cli", "train", *args]
    environment = launch_env()
    if launcher == "accelerate":
        environment["ACCELERATE_USE_CPU"] = "true"
    if launcher == "deepspeed":
        environment.pop("OMP_NUM_THREADS", None)  # as on a machine where nobody set it
    done = subprocess.run(cmd, cwd=REPO, env=environment, capture_output=True, text=True, timeout=timeout)
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
        assert "terminate called" not in done.stderr
    return done


def cli(*args, env: dict | None = None):
    """``python -m draftsmith.cli ARGS`` from the repository, output captured."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "draftsmith.cli", *map(str, args)], capture_output=True, text=True, cwd=REPO, env=env)


def one_process_curve(base: str | Path, out: str | Path, *overrides: str) -> dict[int, float]:
    """The logged training losses of recipe `base` (with `overrides`) trained in this process into
    `out`: the reference a multi-process run of the same recipe must reproduce."""
    from draftsmith.recipe import load_recipe

    # On the CPU, as the launched ranks are (launch_env hides CUDA from them).
    run_trainer(load_recipe(base, overrides=[f"output_dir={out}", "train.device=cpu", *overrides]))
    return logged(out)


def answering_model(tokenizer):
    """A tiny random Llama whose answers end at varied lengths: a random model almost never says
    <|im_end|>, so its LM-head row is tied to a common character's (scaled up). Regeneration
    tests need both stopping paths (an end token, the token budget)."""
    model = tiny_causal_lm("llama", vocab_size=len(tokenizer), seed=0)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] = 1.1 * model.lm_head.weight[tokenizer.convert_tokens_to_ids("K")]
    return model


def joint_p_value(pairs: list[tuple[int, int]], model, prompt, temperature: float, top_p: float) -> float:
    """Chi-square p-value of sampled pairs (first, second generated token) after `prompt` [1,T]
    against `model`'s own processed law of those two tokens (``logits_to_probs`` at `temperature`
    and `top_p`): the check that sampled speculative decoding is lossless. 0.0 when a pair has
    probability 0 under the target. Rare cells are pooled so each expects at least 5; cells the
    target never produces (top-p) are left out."""
    from scipy import stats

    from draftsmith.runtime.verify import logits_to_probs

    with torch.no_grad():
        first = logits_to_probs(model(prompt).logits[0, -1].double(), temperature, 0, top_p)
        V = first.shape[-1]
        second = torch.stack([
            logits_to_probs(model(torch.cat([prompt, torch.tensor([[x]])], 1)).logits[0, -1].double(), temperature, 0, top_p)
            for x in range(V)
        ])
    n = len(pairs)
    expected = (first.unsqueeze(1) * second).flatten() * n
    observed = torch.bincount(torch.tensor([a * V + b for a, b in pairs]), minlength=V * V).double()
    if observed[expected == 0].sum() > 0:
        return 0.0
    common = expected >= 5
    rare = ~common & (expected > 0)  # pooled into one cell, where there are any
    obs = torch.cat([observed[common], observed[rare].sum().view(1)]) if rare.any() else observed[common]
    exp = torch.cat([expected[common], expected[rare].sum().view(1)]) if rare.any() else expected[common]
    return float(stats.chisquare(obs.numpy(), (exp / exp.sum() * n).numpy()).pvalue)


def assert_same_curve(run_dir: str | Path, reference: dict[int, float], steps=range(1, 7), rel: float = 1e-4) -> None:
    """The run's logged training losses equal `reference` at `steps` within `rel` (multi-process
    runs against one process: the same computation up to floating-point reduction order)."""
    import pytest

    got = logged(run_dir)
    for step in steps:
        assert got[step] == pytest.approx(reference[step], rel=rel), (step, got, reference)



class DeviceMismatch(RuntimeError):
    """An operation met a host tensor and a device tensor: on a GPU it would fail ("Expected all
    tensors to be on the same device")."""


class SimulatedDevice(torch.overrides.TorchFunctionMode):
    """The CPU split in two, so that a CPU run fails where a GPU run would put a tensor and a module
    on different devices.

    Inside the block every tensor has a place: the *host* (made by a factory without a ``device=``,
    ``.cpu()``, ``.to("cpu")``: where batches are collated; and a module's
    parameters until the module moves) or the *device* (whatever ``.to(device)`` moves there,
    device being a ``torch.device`` object such as ``accelerator.device`` or ``model.device``), or
    no place yet (tensors read from files, ``torch.from_numpy``'s, which no mode sees, or made
    outside the block), which no check involves. A result takes the place of its inputs, a factory
    with ``device=x.device`` the place of x, a parameter the place of its data. An operation whose
    inputs of one element or more stand on both places raises DeviceMismatch, as CUDA would; the
    exceptions are CUDA's own (0-dim host tensors, host index tensors into device tensors, copies,
    assignment into a slice).

    Enter it before models are built or loaded: a parameter made outside counts as on the host.
    ``checked`` counts the operations it judged (a test can assert that it looked at all).
    ``reads`` lists, in order, each operation that waits for the device to hand a value to the host
    (``item``, ``tolist``, ``bool()``/``int()``/``float()``, ``.cpu()``, ``nonzero``, indexing with
    a device mask, ``repeat_interleave`` by device counts...): on a GPU each is a host sync. Each
    entry names the operation and the innermost draftsmith line outside this module that ran it.
    """

    HOST, DEVICE = "host", "device"
    _READS = frozenset(
        (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
         torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.cpu, torch.masked_select,
         torch.Tensor.masked_select, torch.unique, torch.Tensor.unique, torch.argwhere)
    )  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        from torch.utils.weak import WeakTensorKeyDictionary

        self._place = WeakTensorKeyDictionary()
        # torch.device objects returned by Tensor.device, by id, with the place of their tensor (kept
        # alive here so ids stay unique; a test-sized run makes a few thousand).
        self._device_places: dict[int, tuple[torch.device, str | None]] = {}
        self.checked = 0
        self.reads: list[str] = []

    def _read(self, func, tensor) -> None:
        """Record a host read of `tensor` by `func` when the tensor stands on the device."""
        if isinstance(tensor, torch.Tensor) and self.place(tensor) == self.DEVICE:
            import sys

            package, here = str(Path(__file__).parent), __file__
            frame, where = sys._getframe(1), "?"
            while frame is not None:  # the innermost frame of the package outside this module
                name = frame.f_code.co_filename
                if name.startswith(package) and name != here:
                    where = f"{Path(name).name}:{frame.f_lineno}"
                    break
                frame = frame.f_back
            self.reads.append(f"{getattr(func, '__name__', None) or repr(func)} at {where}")

    def place(self, value) -> str | None:
        return self._place.get(value, self.HOST if isinstance(value, torch.nn.Parameter) else None)

    def __enter__(self):
        # nn.Parameter() is no torch function: its place (its data's) is recorded here instead.
        self._new_parameter = torch.nn.Parameter.__new__
        guard, original = self, self._new_parameter

        def new_parameter(cls, data=None, requires_grad=True):
            param = original(cls, data, requires_grad)
            if data is not None and guard.place(data) is not None:
                guard._place[param] = guard.place(data)
            return param

        torch.nn.Parameter.__new__ = new_parameter
        return super().__enter__()

    def __exit__(self, *exc):
        torch.nn.Parameter.__new__ = self._new_parameter
        return super().__exit__(*exc)

    def _device_place(self, device) -> str:
        if isinstance(device, str):
            return self.HOST if device == "cpu" else self.DEVICE
        if isinstance(device, int):
            return self.DEVICE
        tracked = self._device_places.get(id(device))
        if tracked is not None and tracked[0] is device:
            return tracked[1]
        return self.DEVICE  # a device the program names (accelerator.device): where models go

    def _mismatch(self, func, host: torch.Tensor, device: torch.Tensor) -> DeviceMismatch:
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        return DeviceMismatch(
            f"{name} mixes a tensor on the host {tuple(host.shape)} with one on the device {tuple(device.shape)}: "
            "on a GPU this fails; move the host one (batch.to(device), tensor.to(device), or device= where it is made)"
        )

    def _check(self, func, tensors) -> str | None:
        """The place of an operation's inputs (None when none has one); DeviceMismatch on both."""
        host = device = None
        for t in tensors:
            where = self.place(t)
            if where is None or t.dim() == 0:
                continue
            if where == self.HOST:
                host = host if host is not None else t
            else:
                device = device if device is not None else t
        self.checked += 1
        if host is not None and device is not None:
            raise self._mismatch(func, host, device)
        return self.DEVICE if device is not None else self.HOST if host is not None else None

    def _mark(self, out, where: str | None):
        if where is None:
            return out
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._place[t] = where
        return out

    def _moved(self, tensor: torch.Tensor, out: torch.Tensor, where: str | None):
        if where is None:
            where = self.place(tensor)
        if isinstance(tensor, torch.nn.Parameter):
            # Module.to() keeps the Parameter object and swaps its data: the parameter itself moves.
            self._place[tensor] = where
        elif out is tensor and where != self.place(tensor):
            out = tensor.view_as(tensor)  # on one real device .to() returns its input; the move needs its own object
        return self._mark(out, where)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        T = torch.Tensor
        if func in self._READS and args:
            self._read(func, args[0])
        elif func is T.__getitem__ and len(args) > 1:
            for t in torch.utils._pytree.tree_leaves(args[1]):
                if isinstance(t, torch.Tensor) and t.dtype == torch.bool:
                    self._read(func, t)  # a boolean mask: the result's size is its count
        elif func in (torch.repeat_interleave, T.repeat_interleave) and len(args) > 1:
            self._read(func, args[1])
        if func is T.to:
            out = func(*args, **kwargs)
            first = args[1] if len(args) > 1 else kwargs.get("device", kwargs.get("other"))
            if isinstance(first, torch.Tensor):
                return self._moved(args[0], out, self.place(first))
            device = torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items() if k != "copy"})[0]
            raw = first if isinstance(first, (str, torch.device, int)) else device
            where = None if device is None else self._device_place(raw)
            if where == self.HOST:
                self._read(func, args[0])
            return self._moved(args[0], out, where)
        if func in (T.cpu, T.cuda, T.type_as):
            out = func(*args, **kwargs)
            where = self.HOST if func is T.cpu else self.DEVICE if func is T.cuda else self.place(args[1])
            return self._moved(args[0], out, where)
        if func is T.copy_:
            return func(*args, **kwargs)
        if func is T.numpy and self.place(args[0]) == self.DEVICE:
            raise DeviceMismatch(f"numpy() of a device tensor {tuple(args[0].shape)}: on a GPU this fails; call .cpu() first")
        if func in (T.__getitem__, T.__setitem__):
            target, index = args[0], args[1]
            indexed = any(isinstance(t, torch.Tensor) for t in torch.utils._pytree.tree_leaves(index))
            value = [args[2]] if func is T.__setitem__ and indexed and isinstance(args[2], torch.Tensor) else []
            # A value assigned into a slice is copied across devices; through index tensors (index_put_) it is not.
            where = self._check(func, [target, *value])
            for t in torch.utils._pytree.tree_leaves(index):
                if isinstance(t, torch.Tensor) and t.dim() > 0 and self.place(t) == self.DEVICE and where == self.HOST:
                    raise self._mismatch(func, target, t)
            return self._mark(func(*args, **kwargs), where)
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        where = self._check(func, tensors)
        out = func(*args, **kwargs)
        if getattr(func, "__self__", None) is T.device:  # the Tensor.device getter
            self._device_places[id(out)] = (out, self.place(args[0]))
            return out
        if kwargs.get("device") is not None:
            where = self._device_place(kwargs["device"])
        elif not tensors:
            where = self.HOST  # a factory without device=: the default device, the host
        return self._mark(out, where)


class TracedGraph:
    """``draftsmith.graphs.CapturedForward``'s contract kept on the CPU, so that a CPU test fails
    where replaying a CUDA graph would go wrong.

    A CUDA graph records the kernels of one run and replays them: a value the function read to the
    host, or took from Python state, is frozen at capture, and what it returns are the same buffers
    at every replay. Here the function runs its warm-ups, then is traced once with ``make_fx``,
    which records the aten operations with their shapes and constants and refuses a host read
    (RuntimeError, as a capture fails); each call copies the new inputs into the first inputs'
    buffers, replays the trace and copies its results into the first call's outputs, which it
    returns. Parameters and caches stay the module's own tensors, so their in-place writes land
    where eager ones would."""

    def __init__(self, fn, inputs, pool=None, warmup: int = 2) -> None:
        from torch.fx.experimental.proxy_tensor import make_fx

        self.inputs = [x.clone() for x in inputs]
        for _ in range(warmup):
            fn(*self.inputs)
        self.trace = make_fx(lambda *xs: fn(*xs))(*self.inputs)
        self.outputs = None
        self.replays = 0

    def __call__(self, *inputs):
        for buffer, value in zip(self.inputs, inputs):
            buffer.copy_(value)
        return self.replay()

    def replay(self):
        """What ``graph.replay()`` does: the recorded operations on the buffers, results into the
        same output tensors."""
        from torch.utils._pytree import tree_leaves

        result = self.trace(*self.inputs)
        self.replays += 1
        if self.outputs is None:
            self.outputs = result
        else:
            for old, new in zip(tree_leaves(self.outputs), tree_leaves(result)):
                old.copy_(new)
        return self.outputs


class simulated_cuda_graphs:
    """Inside the block, sessions made on the CPU capture their forwards as ``TracedGraph`` where a
    GPU would capture CUDA graphs (``draftsmith.graphs.can_capture`` is true). ``captured`` lists
    the graphs made, so a test can assert what was captured and replayed. Make the targets and
    drafters inside the block: a session made there keeps capturing (and must not be used after).
    Linear layers are not packed inside (``draftsmith.packed``: CPU-only), so the traces hold what
    a CUDA device runs."""

    def __init__(self) -> None:
        self.captured: list[TracedGraph] = []

    def __enter__(self):
        import draftsmith.graphs as graphs
        from draftsmith.packed import suspended

        self._unpacked = suspended()
        self._unpacked.__enter__()

        def capture(fn, inputs, pool=None):
            graph = TracedGraph(fn, inputs, pool)
            self.captured.append(graph)
            return graph

        self._before, graphs._simulation = graphs._simulation, capture
        return self

    def __exit__(self, *exc):
        import draftsmith.graphs as graphs

        graphs._simulation = self._before
        self._unpacked.__exit__(*exc)
        return False


def graph_roles(captured) -> dict[str, list]:
    """The graphs a head session captured (``session.graphs.captured``), by what each holds:
    "read+tree" (a step's read of its accepted positions with the tree drafted after it, one graph:
    ("extend" | "step", count, layers, tree) or ("heads", tree)), "read" (a read on its own: a
    prompt's, longer than a step's, or one no tree took), "tree" (a tree on its own, after such a
    read) and "other" (EAGLE's host-grown levels, by frontier size; DFlash's block after a long
    prompt). A tree's name starts with "static" or "dynamic"."""

    def is_tree(name) -> bool:
        return isinstance(name, tuple) and name[:1] in (("static",), ("dynamic",))

    roles: dict[str, list] = {"read+tree": [], "read": [], "tree": [], "other": []}
    for name in captured:
        if name == "heads" or (isinstance(name, tuple) and name[0] in ("extend", "step") and len(name) == 3):
            roles["read"].append(name)
        elif isinstance(name, tuple) and name[0] in ("extend", "step", "heads") and is_tree(name[-1]):
            roles["read+tree"].append(name)
        elif is_tree(name):
            roles["tree"].append(name)
        else:
            roles["other"].append(name)
    return roles
