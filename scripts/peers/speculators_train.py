"""Run speculators' own trainer (PyPI speculators==0.9.0) on a CPU-only machine.

    ~/.cache/draftsmith/venvs/speculators-0.9.0/bin/python scripts/peers/speculators_train.py \
        --verifier-name-or-path VERIFIER_DIR --data-path DATA_DIR --save-path OUT_DIR \
        --speculator-type eagle3 --loss-implementation eager --draft-attn-impl sdpa \
        --on-missing raise --num-workers 0 --hidden-states-dtype float32 \
        --log-dir OUT_DIR/logs --max-steps 2 [any other `speculators train` flag]

Runs INSIDE the speculators venv (see docs/ENVIRONMENT: `pip install torch==2.13.0`, then
`pip install torch==2.13.0 speculators==0.9.0`, then uninstall torchvision/torchaudio). Every
argument after the script name goes unchanged to `speculators train`
(`speculators.train.cli.main(TrainConfig.resolve(argv))`); `--help` lists them all.

speculators assumes an accelerator in three places of `speculators/train/trainer.py` and, when it
resumes, a fourth in `checkpointer.py`. This wrapper patches them in memory (the installed package is not edited), and only when
`torch.accelerator.is_available()` is False, so on a GPU machine it changes nothing:

1. `Trainer.__init__` takes `self.local_rank = get_local_rank()` (an int, 0) and later calls
   `self.model.to(self.local_rank)` and `batch_tensor.to(self.local_rank)`; on a CPU-only
   torch `.to(0)` raises "Cannot access accelerator device when none is available". The
   trainer module's `get_local_rank` is replaced by one that returns `torch.device("cpu")`.
2. `_StepTimer.mark` / `_StepTimer.now` call `torch.accelerator.synchronize()` on every logged
   step, which raises the same error without an accelerator. `torch.accelerator.synchronize`
   becomes a no-op when no accelerator is available.
3. `Trainer.__init__` sets `self.device_type = "cuda"` when no accelerator exists and trains
   under `torch.autocast(self.device_type, dtype=hidden_states_dtype)`. CUDA autocast is
   disabled on CPU ("CUDA is not available ... Disabling autocast"): with the EAGLE-3 default
   `--norm-before-fc` the fp32 RMSNorm weight silently promotes the bf16 hidden states and
   everything runs in fp32; with `--no-norm-before-fc`, `fc` fails ("expected m1 and m2 to
   have the same dtype"). The device type is set to "cpu" after `__init__`.
4. Resuming from an epoch checkpoint, `SingleGPUCheckpointer` loads it onto
   `get_current_device()`, which answers "cuda:0" without an accelerator; safetensors then asks
   for pinned memory and fails ("pin_memory=True requires a CUDA or other accelerator backend").
   The checkpointer module's `get_current_device` returns "cpu".

The flags in the command above are needed too: `--loss-implementation eager` (the fused losses
import Triton), `--draft-attn-impl sdpa` (flex attention has no CPU backward),
`--on-missing raise` (offline hidden states, no vLLM server), `--num-workers 0` (the default
12 spawned DataLoader workers only cost start-up time here). `--hidden-states-dtype float32`
is for CPUs without native bf16; with bfloat16 the CPU autocast from patch 3 is used.
Single process only: under torchrun, `maybe_setup_distributed` needs an accelerator.

A tiny verifier plus offline dataset to try it on: scripts/peers/speculators_tiny_data.py
(2 EAGLE-3 steps, total-seq-len 256: about 9 s wall, 0.6 GB peak RSS on 2 cores).
"""

import sys

import torch


def apply_cpu_patches() -> None:
    """Patch speculators' trainer for a machine without an accelerator (no-op with one)."""
    if torch.accelerator.is_available():
        return
    import speculators.train.trainer as trainer_module

    trainer_module.get_local_rank = lambda: torch.device("cpu")

    original_synchronize = torch.accelerator.synchronize

    def synchronize(device=None) -> None:
        if torch.accelerator.is_available():
            original_synchronize(device)

    torch.accelerator.synchronize = synchronize

    original_init = trainer_module.Trainer.__init__

    def init_on_cpu(self, *args, **kwargs) -> None:
        original_init(self, *args, **kwargs)
        self.device_type = "cpu"

    trainer_module.Trainer.__init__ = init_on_cpu

    # Resuming: its checkpointer loads the last epoch onto get_current_device(), which answers
    # "cuda:0" where there is no accelerator (safetensors then asks for pinned memory and fails).
    import speculators.train.checkpointer as checkpointer_module

    checkpointer_module.get_current_device = lambda: "cpu"


def main(argv: list[str]) -> None:
    apply_cpu_patches()
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    train_main(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
