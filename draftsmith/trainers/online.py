"""Online speculative decoding: serve a prompt stream, learn from what the target verified.

The runtime serves each request with the current drafter (``speculative_generate``, a chain of
``online.draft_length`` tokens). Every served request leaves its verified tokens in a bounded
replay buffer (data/replay.py). After every ``online.update_every`` requests the drafter takes
``online.steps_per_update`` distillation steps on batches from the buffer (the target re-scores
them in one forward; the recipe's ``distill.divergence`` over the positions ``online.train_on``
names: by default, as in online speculative decoding, only where the draft was rejected), the
buffer is emptied (``online.clear_buffer``, OSD's behaviour) and the updated draft is swapped into
the runtime: a new drafter object around the updated weights, the server never restarts. The acceptance rate of every request goes to metrics.jsonl (kind "serve")
so the curve over the stream shows the drafter catching up when the query distribution shifts.

The stream: ``online.requests_per_source`` prompts (first user turns) from ``data.path``, then as
many from each of ``online.shift_to`` in order.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from draftsmith.atomic import write_atomic
from draftsmith.recipe import Recipe
from draftsmith.runs import log
from draftsmith.target import FrozenTarget, load_draft
from draftsmith.trainers import engine, loop
from draftsmith.trainers.base import Trainer
from draftsmith.trainers.data import pad_token_id, prepare_with_target
from draftsmith.trainers.distill import DistillStep, check_same_tokenizer, common_vocab, distill_objective, predicted_mask


class EmptyReplayWarning(UserWarning):
    """An update came due while the replay buffer held no position to train on; it was skipped."""


def stream_prompts(recipe: Recipe) -> list[dict]:
    """The served stream: [{"source", "messages"}], requests_per_source per source, in order."""
    from draftsmith.data import DataError, load_conversations
    from draftsmith.data.chat import first_user_turn

    d, o = recipe.data, recipe.online
    stream = []
    for source in [d.path, *o.shift_to]:
        prompts = []
        for conv in load_conversations(source, d.format, None, d.seed):
            head = first_user_turn(conv)
            if head is not None:
                prompts.append({"source": source, "messages": head})
            if len(prompts) == o.requests_per_source:
                break
        if not prompts:
            raise DataError(f"no prompts (a user turn) in {source}")
        stream.extend(prompts)
    return stream


class OnlineTrainer(Trainer):
    counts_steps = False  # its position is the requests served, not train.max_steps' steps

    def __init__(self, recipe: Recipe, argv: Optional[list[str]] = None) -> None:
        super().__init__(recipe, argv)
        self.served = 0  # checkpoints are numbered by requests served (their "step"); self.step counts optimizer steps
        self.window: list[tuple[int, int]] = []  # (accepted, judged) of the last online.window requests

    # ------------------------------------------------------------------ setup

    prepare = staticmethod(prepare_with_target)

    def setup(self) -> "OnlineTrainer":
        from draftsmith.data import Collator
        from draftsmith.data.chat import stop_token_ids
        from draftsmith.data.replay import ReplayBuffer

        r = self.recipe
        self.start_run()
        self.target = FrozenTarget.from_config(r.target, self.accelerator.device)
        self.tokenizer = tokenizer = self.target.tokenizer
        self.draft, draft_tokenizer = load_draft(r.draft, self.accelerator.device)
        check_same_tokenizer(draft_tokenizer, tokenizer, r.draft.path, r.target.path)
        self.requests = stream_prompts(r)
        self.eos = stop_token_ids(tokenizer, self.target.model.generation_config)

        self.prepare_engine(DistillStep(self.draft), self.draft.parameters(), adapter_only=r.draft.lora.enabled)
        self.collator = Collator(pad_token_id=pad_token_id(tokenizer), max_length=r.data.max_length)
        # Every rank keeps the same buffer (all verified records), so an update's batches, a
        # checkpoint and a resume at another world size do not depend on who served what.
        self.buffer = ReplayBuffer(r.online.buffer_size, seed=r.train.seed, train_on=r.online.train_on)
        self.resume(strict=False)
        self.swap_drafter()
        sources = ", ".join(dict.fromkeys(p["source"] for p in self.requests))
        self.record(
            f"serving {len(self.requests)} requests ({sources}) with draft {r.draft.path} for target {r.target.path}; "
            f"update every {r.online.update_every} requests ({r.online.steps_per_update} steps, {r.distill.divergence})",
        )
        return self

    def swap_drafter(self) -> None:
        """Put the current draft weights into the runtime: a fresh drafter, no restart."""
        from draftsmith.runtime.drafters import StandaloneDrafter
        from draftsmith.runtime.tree import TreeSpec

        # Serving while training keeps transformers' caches: under ZeRO-3 a model's weights are
        # gathered during each forward, which a CUDA graph of the static cache cannot replay.
        self.drafter = StandaloneDrafter(self.draft.eval(), TreeSpec.chain(self.recipe.online.draft_length), cache="dynamic")

    # ------------------------------------------------------------------ serving and updating

    def serve(self, request: dict, seed: int) -> dict:
        """Answer one request speculatively. Returns its stats and, under "record", its verified tokens."""
        from draftsmith.data.chat import encode_prompt
        from draftsmith.data.replay import verified_record
        from draftsmith.runtime.generate import speculative_generate
        from draftsmith.runtime.verify import SamplingParams

        o, device = self.recipe.online, self.accelerator.device
        room = self.recipe.data.max_length - o.max_new_tokens
        prompt = encode_prompt(self.tokenizer, request["messages"], max(1, room))
        ids = torch.tensor([prompt], device=device)
        generator = torch.Generator(device=device).manual_seed(seed)
        out, stats = speculative_generate(
            self.target, self.drafter, ids, o.max_new_tokens, SamplingParams.choose(o.temperature), eos_token_id=self.eos, generator=generator,
            cache="dynamic",
        )
        record = verified_record(prompt, out[0, len(prompt) :].tolist(), stats.accept_lens, stats.draft_depths)
        return {
            "source": request["source"],
            "accepted": record["accepted"],
            "judged": record["judged"],
            "acceptance_rate": record["accepted"] / max(1, record["judged"]),
            "mean_accepted_length": 1.0 + stats.mean_accept_len,
            "new_tokens": stats.new_tokens,
            "steps": stats.steps,
            "record": record,
        }

    def update(self) -> Optional[dict]:
        """steps_per_update distillation steps on the buffer, then (online.clear_buffer) an empty
        buffer, then a drafter swap. None when skipped.

        Each optimizer step draws grad_accum_steps x world micro-batches from the (shared) buffer
        in one draw; rank r takes micro-batches r, r + world, ...: the step's gradient is that of
        all of them, whatever the world size.
        """
        acc, r = self.accelerator, self.recipe
        if self.buffer.trainable_tokens == 0:
            what = "rejected positions" if r.online.train_on == "rejected" else "verified tokens"
            message = f"replay buffer holds no {what} after {self.served} requests: skipping this update"
            warnings.warn(message, EmptyReplayWarning, stacklevel=2)
            log(f"warning: {message}")
            return None
        self.draft.train()
        world, rank, accum = acc.num_processes, acc.process_index, r.train.grad_accum_steps

        def micro_loss(records: list[dict], step_losses: list[Tensor]) -> Tensor:
            batch = self.collator(records).to(acc.device)
            ids, attention = batch["input_ids"], batch["attention_mask"]
            target_logits = self.target.features(ids, attention_mask=attention, need_logits=True).logits
            draft_logits, target_logits = common_vocab(self.model(ids, attention)[:, :-1], target_logits[:, :-1])
            loss = distill_objective(r, draft_logits, target_logits, predicted_mask(batch["loss_mask"]))
            step_losses.append(loss.detach())
            return loss

        losses = []
        for _ in range(r.online.steps_per_update):
            batches = self.buffer.sample(r.train.micro_batch_size, count=accum * world)[rank::world]
            step_losses: list[Tensor] = []
            loop.optimizer_step(self, [lambda b=b: micro_loss(b, step_losses) for b in batches], self.draft.parameters())
            mean = torch.stack(step_losses).mean()
            losses.append(float(acc.reduce(mean, reduction="mean") if world > 1 else mean))
            self.step += 1
        held = len(self.buffer)
        if r.online.clear_buffer:
            self.buffer.clear()
        self.swap_drafter()
        mean = sum(losses) / len(losses)
        return {"loss": mean, "first_loss": losses[0], "last_loss": losses[-1], "buffer": held, "lr": self.scheduler.get_last_lr()[0]}

    @property
    def position(self) -> int:
        """Checkpoints are numbered by requests served: that is where a resumed stream picks up."""
        return self.served

    def drafter_kind(self) -> str:
        return "standalone"

    def checkpoint_state(self) -> dict:
        return {
            "optimizer_steps": self.step,
            "draft": {"path": self.recipe.draft.path, "lora": self.recipe.draft.lora.enabled},
            "buffer": self.buffer.state_dict(),
        }


    def restore(self, state) -> None:
        self.step, self.served = state["optimizer_steps"], state["step"]
        self.buffer.load_state_dict(state["buffer"])

    # ------------------------------------------------------------------ the stream

    def advance(self) -> tuple[int, dict]:
        """One round of the stream: with several processes each serves one of `world` consecutive
        requests, and all ranks then see every result, in stream order. Updates the drafter when
        an update falls due. Returns (requests served, the update's values or {})."""
        acc, r, o = self.accelerator, self.recipe, self.recipe.online
        index = self.served + acc.process_index
        mine = self.serve(self.requests[index], seed=r.train.seed + index) if index < len(self.requests) else None
        before = self.served
        for values in engine.gather_objects(acc, mine):
            if values is None:
                continue
            self.buffer.add(values.pop("record"))
            self.served += 1
            self.window = (self.window + [(values["accepted"], values["judged"])])[-o.window :]
            values["window_acceptance_rate"] = self.window_rate()
            self.metrics.write(self.served, "serve", values)
        update = {}
        if loop.crossed(before, self.served, o.update_every) and self.served < len(self.requests):
            update = self.update() or {}
        return self.served, {**update, "acceptance": self.window_rate()}

    def window_rate(self) -> float:
        return sum(a for a, _ in self.window) / max(1, sum(j for _, j in self.window))

    def train(self) -> dict:
        """Serve the stream, updating the drafter every online.update_every requests."""
        acc, r = self.accelerator, self.recipe
        schedule = loop.Schedule(len(self.requests), "request", log_every=1, save_every=r.train.save_every, log_kind="update")
        _, elapsed = loop.run_loop(self, schedule, self.served, "serve")
        summary = {"served": self.served, "optimizer_steps": self.step, "seconds": round(self.train_seconds(elapsed), 1), "checkpoint": str(self.last_checkpoint)}
        if acc.is_main_process:
            summary.update(acceptance_by_source(self.output_dir))
            write_atomic(self.output_dir / "final_metrics.json", json.dumps(summary, indent=2))
        return summary


def serve_records(output_dir: str | Path) -> list[dict]:
    """The per-request records (kind "serve") of an online run, in stream order."""
    path = Path(output_dir) / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "serve"]


def acceptance_by_source(output_dir: str | Path) -> dict:
    """Acceptance rate per stream source, first and second half of each: {"acceptance": {...}}."""
    out: dict = {}
    records = serve_records(output_dir)
    for source in dict.fromkeys(r["source"] for r in records):
        rows = [r for r in records if r["source"] == source]
        half = max(1, len(rows) // 2)
        rate = lambda rs: sum(r["accepted"] for r in rs) / max(1, sum(r["judged"] for r in rs))  # noqa: E731
        out[source] = {"requests": len(rows), "first_half": round(rate(rows[:half]), 4), "second_half": round(rate(rows[half:]), 4) if rows[half:] else None}
    return {"acceptance": out}


def plot_acceptance(output_dir: str | Path, png: str | Path, title: str = "") -> Path:
    """Acceptance rate per request and its moving window over the stream, with source changes marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = serve_records(output_dir)
    x = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(x, [r["acceptance_rate"] for r in records], ".", alpha=0.4, label="per request")
    ax.plot(x, [r["window_acceptance_rate"] for r in records], "-", label="moving window")
    for prev, cur in zip(records, records[1:]):
        if cur["source"] != prev["source"]:
            ax.axvline(cur["step"] - 0.5, color="gray", ls="--")
            ax.text(cur["step"], 0.98, f"-> {cur['source']}", va="top", fontsize=8)
    updates = [r["step"] for r in map(json.loads, (Path(output_dir) / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "update"]
    for u in updates:
        ax.axvline(u + 0.5, color="green", alpha=0.15)
    ax.set_ylim(0, 1)
    ax.set_xlabel("requests served")
    ax.set_ylabel("acceptance rate")
    ax.set_title(title or "online speculative decoding: acceptance over the stream (green: drafter updates)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return Path(png)
