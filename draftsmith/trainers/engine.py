"""How a run trains: one process, DDP, or DeepSpeed ZeRO 0-3, under whichever launcher started it.

Engines: one plain process, DDP under torchrun / accelerate launch, or DeepSpeed ZeRO 0-3 when the
recipe has a ``deepspeed:`` section (under any of those launchers or the ``deepspeed`` launcher).
Batch sizes, accumulation and precision always come from the recipe's ``train:`` section. Also
here: the optimizer and schedule every trainer builds, collectives over ranks, the full weights of a
partitioned module, and the teardown that lets every rank exit cleanly.
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterable, Optional

import torch
from torch import nn

from draftsmith.recipe import DeepSpeedConfig, Recipe, RecipeError, TrainConfig
from draftsmith.runs import log
from draftsmith.target import choose_device, gathered_parameters, resolve_dtype


class TrainingError(RuntimeError):
    """A run that cannot go on. The message names the step and the last good checkpoint."""


def world_size() -> int:
    """Processes in this run, from the launcher's environment (1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def configure_threads() -> Optional[int]:
    """Split the cores between the ranks on this machine when the launcher did not.

    torchrun sets OMP_NUM_THREADS=1; the deepspeed launcher sets nothing, and every rank then
    spreads over all cores (about 70x slower training on 2 cores). Returns the threads set, if any.
    """
    if world_size() <= 1 or "OMP_NUM_THREADS" in os.environ:
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world_size())
    threads = max(1, (os.cpu_count() or 1) // max(1, local))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    return threads


def resolve_grad_accum(train: TrainConfig, world: int) -> int:
    """Micro-batches per optimizer step. With train.global_batch_size it is derived for this world
    size (and written back into `train`, so every trainer and the saved recipe see it)."""
    if train.global_batch_size is None:
        return train.grad_accum_steps
    per_pass = train.micro_batch_size * world
    if train.global_batch_size % per_pass:
        raise RecipeError(
            f"recipe key 'train.global_batch_size'={train.global_batch_size} is not divisible by "
            f"train.micro_batch_size={train.micro_batch_size} x {world} processes; change one of them"
        )
    train.grad_accum_steps = train.global_batch_size // per_pass
    return train.grad_accum_steps


def deepspeed_config(train: TrainConfig, ds: DeepSpeedConfig, world: int) -> dict:
    """The DeepSpeed config dict of a recipe: batch sizes, accumulation and clipping from train:,
    ZeRO settings from deepspeed:, then deepspeed.config merged over it. Precision is added by
    accelerate from train.mixed_precision."""
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": ds.offload_optimizer, **({"nvme_path": ds.nvme_path} if ds.offload_optimizer == "nvme" else {})}
    if ds.offload_param != "none":
        zero["offload_param"] = {"device": ds.offload_param, **({"nvme_path": ds.nvme_path} if ds.offload_param == "nvme" else {})}
    config = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum_steps,
        "train_batch_size": train.micro_batch_size * train.grad_accum_steps * world,
        "gradient_clipping": train.max_grad_norm,
        "zero_optimization": zero,
        # The optimizer is a torch AdamW built from train:, not DeepSpeed's fused Adam (which
        # compiles for minutes on first use).
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
    }
    return _merge(config, ds.config or {})


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _check_launcher(ds: Optional[DeepSpeedConfig]) -> None:
    """Refuse DeepSpeed settings that come from the launcher instead of the recipe."""
    env_ds = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    use_ds = ds is not None and ds.zero_stage is not None
    if env_ds and not use_ds:
        raise RecipeError(
            "the launcher asks for DeepSpeed (ACCELERATE_USE_DEEPSPEED=true) but the recipe has no deepspeed.zero_stage: "
            "merge recipes/deepspeed/zero2.yaml (or zero1/zero3) into the recipe instead"
        )
    if not use_ds:
        return
    if os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none") not in ("", "none"):
        raise RecipeError(
            f"the launcher passes a DeepSpeed config file ({os.environ['ACCELERATE_DEEPSPEED_CONFIG_FILE']}); "
            "draftsmith takes DeepSpeed settings from the recipe's deepspeed: section only"
        )
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if stage not in (None, "") and int(stage) != ds.zero_stage:
        raise RecipeError(f"the launcher asks for ZeRO stage {stage} but the recipe has deepspeed.zero_stage={ds.zero_stage}; drop the launcher's setting")


def _single_process_env() -> None:
    """DeepSpeed always runs in a process group: give a plain process a group of one."""
    if "RANK" in os.environ or "LOCAL_RANK" in os.environ:
        return
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _skip_cpu_shm_op() -> None:
    """Keep DeepSpeed's CPU backend from compiling its shared-memory all-reduce (23-52 s and a C++
    compiler on first use): only inference_all_reduce uses it, and training never calls that."""
    import deepspeed.ops

    compatible = deepspeed.ops.__compatible_ops__
    if "deepspeed_shm_comm" in compatible:
        compatible["deepspeed_shm_comm"] = False


def make_accelerator(train: TrainConfig, deepspeed: Optional[DeepSpeedConfig] = None):
    """An accelerate engine for one process, DDP, or DeepSpeed ZeRO (when `deepspeed.zero_stage` is
    set), under whichever launcher started this process.

    Derives train.grad_accum_steps from train.global_batch_size when that is set, and raises
    RecipeError (before anything is written) when the world size does not divide the global batch
    or the launcher's DeepSpeed settings contradict the recipe.
    """
    device = choose_device(train.device, "training")
    mixed = resolve_mixed_precision(train.mixed_precision, device)
    threads = configure_threads()
    if threads:
        log(f"OMP_NUM_THREADS was not set by the launcher: {threads} thread(s) per process")
    _check_launcher(deepspeed)
    world = world_size()
    accum = resolve_grad_accum(train, world)
    from accelerate.utils import InitProcessGroupKwargs

    handlers = []
    cpu = device.type == "cpu"
    if deepspeed is not None and deepspeed.zero_stage is not None:
        if cpu:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            # accelerate ignores DeepSpeed when told to use the CPU, but DeepSpeed runs on CPU.
            os.environ["ACCELERATE_USE_CPU"] = "false"
            handlers.append(InitProcessGroupKwargs(backend="gloo"))
            _skip_cpu_shm_op()
        _single_process_env()
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin

        plugin = DeepSpeedPlugin(hf_ds_config=deepspeed_config(train, deepspeed, world), zero3_init_flag=deepspeed.shard_target)
        accelerator = Accelerator(
            mixed_precision=mixed,
            gradient_accumulation_steps=accum,
            deepspeed_plugin=plugin,
            kwargs_handlers=handlers,
        )
        if not deepspeed.shard_target:
            # transformers reads a global ZeRO-3 config to load models with zero.Init and to sync
            # generate() across ranks; a replicated target must be neither.
            from transformers.integrations import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
        return _on(accelerator, device)

    from accelerate import Accelerator

    if cpu and world > 1:
        # Several CPU processes talk over gloo. In one process, naming a backend would make
        # accelerate believe it is distributed, so it is set only under a launcher.
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    return _on(Accelerator(mixed_precision=mixed, gradient_accumulation_steps=accum, kwargs_handlers=handlers, cpu=cpu), device)


def _on(accelerator, device: torch.device):
    """`accelerator`, after checking that it runs where the device rule chose (accelerate keeps a
    process-wide device that an earlier run in the same process could have fixed)."""
    if accelerator.device.type != device.type:
        raise TrainingError(f"the engine runs on {accelerator.device}, the device rule chose {device}: an earlier run in this process kept its device")
    return accelerator


def resolve_mixed_precision(name: str, device: Optional[torch.device] = None) -> str:
    """train.mixed_precision as accelerate takes it: "auto" is bf16 autocast where the training
    `device` computes bf16 natively, none elsewhere (target.auto_dtype says why)."""
    if name != "auto":
        return name
    return "bf16" if resolve_dtype("auto", "autocast", device) == "bfloat16" else "no"


def uses_deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def engine_info(accelerator) -> dict:
    """What wrote a checkpoint: {"kind": "deepspeed" | "accelerate", "zero_stage", "world_size"}."""
    if uses_deepspeed(accelerator):
        stage = accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]["stage"]
        return {"kind": "deepspeed", "zero_stage": int(stage), "world_size": accelerator.num_processes}
    return {"kind": "accelerate", "zero_stage": None, "world_size": accelerator.num_processes}


def describe_engine(accelerator, recipe: Recipe) -> str:
    """One log phrase for how a run trains: "2 process(es) x micro-batch 2 x 1 accumulation; engine deepspeed ZeRO-2"."""
    t = recipe.train
    engine = engine_info(accelerator)["kind"]
    if engine == "deepspeed":
        engine += f" ZeRO-{recipe.deepspeed.zero_stage}"
    return f"{accelerator.num_processes} process(es) x micro-batch {t.micro_batch_size} x {t.grad_accum_steps} accumulation; engine {engine} on {accelerator.device}"


def full_state_dict(
    accelerator, module: nn.Module, prefix: str = "", trainable_only: bool = False
) -> dict[str, torch.Tensor]:
    """`module`'s complete weights on every rank (a collective under DeepSpeed: all ranks call it):
    its parameters (only those that train, with `trainable_only`) and persistent buffers.

    Under DeepSpeed the trainable parameters come from the optimizer's float32 master copy, gathered
    from the ranks' partitions; elsewhere they are the module's own tensors.
    """
    if not uses_deepspeed(accelerator):
        keep = {n for n, p in module.named_parameters() if p.requires_grad} if trainable_only else None
        return {
            prefix + k: v.detach().cpu().contiguous()
            for k, v in module.state_dict().items()
            if keep is None or k in keep
        }
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, param in module.named_parameters():
        if trainable_only and not param.requires_grad:
            continue
        full = safe_get_full_fp32_param(param) if param.requires_grad else None
        if full is None:
            with gathered_parameters([param]):
                full = param.detach().to(torch.float32).clone()
        out[prefix + name] = full.detach().cpu().contiguous()
    if not trainable_only:
        for owner_name, owner in module.named_modules():
            for name, buffer in owner.named_buffers(recurse=False):
                if name not in owner._non_persistent_buffers_set:  # state_dict() leaves those out too
                    out[prefix + (f"{owner_name}.{name}" if owner_name else name)] = buffer.detach().cpu().contiguous()
    return out


def build_optimizer(params: Iterable[nn.Parameter], train: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if not params:
        raise TrainingError("the draft model has no trainable parameters")
    return torch.optim.AdamW(
        params, lr=train.lr, weight_decay=train.weight_decay, betas=(train.adam_beta1, train.adam_beta2)
    )


def lr_factor(step: int, train: TrainConfig) -> float:
    """Multiplier of train.lr at optimizer step `step` (0-based): linear warmup, then the schedule."""
    if train.warmup_steps > 0 and step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    if train.lr_schedule == "constant":
        return 1.0
    span = max(1, train.max_steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / span)
    floor = train.min_lr_ratio
    if train.lr_schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, train))


def stepping_optimizer(optimizer):
    """The torch optimizer whose step moves the weights, inside the engine's wrappers (accelerate's
    AcceleratedOptimizer, DeepSpeed's ZeRO optimizer): the AdamW build_optimizer made, except under
    DeepSpeed's optimizer offload, where it is the DeepSpeedCPUAdam accelerate made from it. The
    two share their parameter groups until a checkpoint loads; the load gives the stepping one new
    groups, so the schedule must follow that one (Trainer.resume)."""
    inner = optimizer
    while hasattr(getattr(inner, "optimizer", None), "param_groups"):
        inner = inner.optimizer
    return inner


def apply_optimizer_settings(scheduler, train: TrainConfig) -> list[str]:
    """After a resume: a checkpoint brings back the optimizer's settings with its state (AdamW's
    moments, which stay), so a recipe that changed train.lr, weight_decay or the Adam betas since
    would go unheard. Sets the recipe's values (the learning rate at the step reached, as the
    schedule gives it) and returns what changed, "train.lr 0.01 -> 0.5", for the run to say."""
    changed = []
    groups = scheduler.optimizer.param_groups
    if any(base != train.lr for base in scheduler.base_lrs):
        changed.append(f"train.lr {scheduler.base_lrs[0]:g} -> {train.lr:g}")
        scheduler.base_lrs = [train.lr] * len(groups)
        for group in groups:
            group["initial_lr"] = train.lr
            group["lr"] = train.lr * lr_factor(scheduler.last_epoch, train)
        scheduler._last_lr = [group["lr"] for group in groups]
    for key, value in {"weight_decay": train.weight_decay, "betas": (train.adam_beta1, train.adam_beta2)}.items():
        old = groups[0].get(key)
        old = tuple(old) if isinstance(old, (list, tuple)) else old
        if old is None or old == value:
            continue
        changed.append(f"{'train.adam_beta1, adam_beta2' if key == 'betas' else 'train.' + key} {old} -> {value}")
        for group in groups:
            group[key] = value
    return changed


def any_rank(accelerator, flag: bool) -> bool:
    """True on every rank when `flag` is true on any rank, so all ranks stop at the same step."""
    if accelerator.num_processes == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(t, reduction="sum").item() > 0)


def gather_objects(accelerator, obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    if accelerator.num_processes == 1:
        return [obj]
    out: list[Any] = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(out, obj)
    return out


def teardown(accelerator) -> None:
    """Free the engine before the process group goes, so ranks exit cleanly.

    The caller drops its own references to the wrapped model and optimizer first. Without that and a
    garbage collection, a rank sometimes aborts at interpreter exit after a successful DDP run (see
    docs/ENVIRONMENT.md).
    """
    import gc

    from accelerate.state import AcceleratorState, GradientState

    accelerator.free_memory()
    gc.collect()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # accelerate keeps its settings (mixed precision, DeepSpeed plugin, accumulation) and its device
    # in process-wide singletons: forget them all, so a later run in this process chooses its own
    # (a CPU run after a CUDA one in the same process would otherwise keep CUDA, silently).
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def peak_memory(accelerator) -> dict:
    """Peak memory of the busiest rank in MB: host RSS, and device memory on CUDA."""
    import resource

    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    values = [rss_kb / 1024]
    if torch.cuda.is_available():
        values.append(torch.cuda.max_memory_allocated() / 2**20)
    t = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1 and torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    out = {"peak_rss_mb": round(float(t[0]), 1)}
    if len(values) > 1:
        out["peak_device_mb"] = round(float(t[1]), 1)
    return out
