"""The hidden-state cache: the target's features for every training token, computed once.

A draft head trains on the target's hidden states; the target itself never changes, so running its
decoder layers again every epoch is wasted work. ``draftsmith prepare`` (or the first ``train``)
writes what a head reads -- the requested decoder layers and ``final_hidden``, optionally the
target's top-k logits -- into sharded safetensors files, and the head trainer then trains from
them with only the target's embedding and LM head loaded as callables.

Layout of a cache folder::

    index.json                   what the cache was built for (target, layers, data, storage)
    train-00000.safetensors      shards planned by `prepare`: consecutive examples, ~shard_tokens each
    train-r1-00003.safetensors   shards written by rank 1 while training in hybrid mode
    eval-00000.safetensors ...

Each shard holds ``example_ids [E]`` and ``offsets [E+1]`` (int64), then token-major tensors
``final_hidden [N,D]``, ``layer_<i> [N,D]``, optionally ``topk_values [N,k]`` and
``topk_indices [N,k]`` (int32). In int8 mode every [N,D] tensor is int8 with a float32
``<name>.scale [N]`` beside it (x = q * scale, one absmax scale per token).

Shards are written to a temporary name and renamed, so a file that exists is complete; an
interrupted build resumes with the shards it lacks, and the same inputs give the same files.
A cache built for another target, layer set, storage format or data is refused with one line.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor

from draftsmith.atomic import atomic_path, write_atomic
from draftsmith.data.errors import DataError
from draftsmith.target import model_fingerprint, resolve_dtype

FORMAT_VERSION = 1
INDEX_NAME = "index.json"
SPLITS = ("train", "eval")
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FeatureCacheError(DataError):
    """A feature cache that cannot be built or used. One line naming the folder and the mismatch."""


# ----------------------------------------------------------------------------- identity


@dataclass
class FeatureSpec:
    """What a cache holds and what it was computed from; two caches are interchangeable iff equal.

    target: {"source", "fingerprint", "hidden_size", "vocab_size", "num_layers", "dtype"};
    layers: decoder layers stored besides final_hidden; data: {"train": digest, "eval": digest,
    "max_length": int}; dtype and compress: the storage format; top_k: logits stored per token.
    """

    target: dict
    layers: list[int]
    dtype: str
    compress: str
    top_k: int
    data: dict
    format: int = FORMAT_VERSION

    @property
    def hidden_size(self) -> int:
        return int(self.target["hidden_size"])

    def tensor_names(self) -> list[str]:
        """The [N,D] tensors of a shard: final_hidden, then one per layer."""
        return ["final_hidden"] + [f"layer_{i}" for i in self.layers]

    def bytes_per_token(self) -> int:
        """Disk bytes per token: the [D] vectors, their int8 scales, and the top-k logits."""
        vectors = len(self.tensor_names())
        if self.compress == "int8":
            per_vector = self.hidden_size + 4  # int8 values + a float32 scale
        else:
            per_vector = self.hidden_size * torch.tensor([], dtype=STORAGE_DTYPES[self.dtype]).element_size()
        value_bytes = 2 if self.compress == "int8" else torch.tensor([], dtype=STORAGE_DTYPES[self.dtype]).element_size()
        return vectors * per_vector + self.top_k * (value_bytes + 4)

    def key(self) -> str:
        """8 hex digits naming what the features were computed from and how they are stored (the
        target's weights and precision, the examples, the storage format), the layers aside: two
        specs with one key hold the same numbers."""
        import hashlib

        what = {"target": [self.target.get("fingerprint"), self.target.get("dtype")], "dtype": self.dtype, "compress": self.compress,
                "top_k": self.top_k, "data": self.data, "format": self.format}  # fmt: skip
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:8]

    def check_serves(self, wanted: "FeatureSpec", folder: Path) -> None:
        """Raise FeatureCacheError unless this (stored) cache serves `wanted`: same target, data and
        storage format, every wanted layer present, at least as many top-k logits."""
        where = f"feature cache {folder}"
        if self.format != wanted.format:
            raise FeatureCacheError(f"{where} has format {self.format}, this draftsmith reads {wanted.format}; delete it or set data.features.dir elsewhere")
        mine, theirs = self.target, wanted.target
        if mine.get("fingerprint") != theirs.get("fingerprint"):
            raise FeatureCacheError(
                f"{where} was built for another target ({mine.get('source')}, {mine.get('dtype')}, fingerprint {mine.get('fingerprint')}); "
                f"this recipe's target is {theirs.get('source')} ({theirs.get('dtype')}, fingerprint {theirs.get('fingerprint')}): "
                "set data.features.dir to another folder or delete this one"
            )
        missing = sorted(set(wanted.layers) - set(self.layers))
        if missing:
            raise FeatureCacheError(
                f"{where} holds decoder layers {self.layers} (plus final_hidden) but the head needs layers {missing}: "
                "set data.features.dir to another folder or delete this one"
            )
        if (self.dtype, self.compress) != (wanted.dtype, wanted.compress):
            raise FeatureCacheError(
                f"{where} stores {self.dtype}/{self.compress}, the recipe asks for {wanted.dtype}/{wanted.compress} "
                "(data.features.dtype, data.features.compress): set data.features.dir to another folder or delete this one"
            )
        if self.top_k < wanted.top_k:
            raise FeatureCacheError(f"{where} stores the top {self.top_k} logits, the recipe asks for {wanted.top_k} (data.features.top_k_logits)")
        if self.data != wanted.data:
            raise FeatureCacheError(
                f"{where} was built for other data (examples or data.max_length differ): set data.features.dir to another folder or delete this one"
            )



def examples_digest(examples: Sequence[dict], max_length: int) -> str:
    """A hash of the token ids of `examples` in order, as the trainer sees them (truncated)."""
    digest = hashlib.sha256()
    for example in examples:
        ids = torch.as_tensor(example["input_ids"][:max_length], dtype=torch.int64)
        digest.update(len(ids).to_bytes(8, "little"))
        digest.update(ids.numpy().tobytes())
    return digest.hexdigest()[:20]


def make_spec(target, layers: Iterable[int], cfg, train: Sequence[dict], evaluation: Sequence[dict], max_length: int) -> FeatureSpec:
    """The spec of the cache a recipe wants: `target` is a FrozenTarget, `cfg` a FeaturesConfig."""
    dims = target.dims
    return FeatureSpec(
        target={
            "source": str(target.source),
            "fingerprint": model_fingerprint(target.model),
            "hidden_size": dims.hidden_size,
            "vocab_size": dims.vocab_size,
            "num_layers": dims.num_layers,
            "dtype": str(target.dtype).replace("torch.", ""),
        },
        layers=sorted({int(i) % dims.num_layers for i in layers}),
        dtype=resolve_dtype(cfg.dtype, "feature cache", target.device),  # what the device that computes them runs natively
        compress=cfg.compress,
        top_k=int(cfg.top_k_logits),
        data={"train": examples_digest(train, max_length), "eval": examples_digest(evaluation, max_length), "max_length": max_length},
    )


def read_spec(folder: Path) -> Optional[FeatureSpec]:
    path = Path(folder) / INDEX_NAME
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        return FeatureSpec(**{k: raw[k] for k in ("target", "layers", "dtype", "compress", "top_k", "data", "format")})
    except (ValueError, KeyError, TypeError) as err:
        raise FeatureCacheError(f"feature cache index {path} is unreadable ({type(err).__name__}): delete the folder to rebuild it") from None


def write_spec(folder: Path, spec: FeatureSpec) -> None:
    write_atomic(Path(folder) / INDEX_NAME, json.dumps(asdict(spec), indent=2))


# ----------------------------------------------------------------------------- storage


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row absmax int8: x [N,D] -> (q [N,D] int8, scale [N] float32) with x ~= q * scale.

    The error of every element is at most scale / 2 = max|x_row| / 254.
    """
    x32 = x.to(torch.float32)
    scale = x32.abs().amax(dim=-1).clamp_min(1e-12) / 127.0
    q = torch.round(x32 / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return (q.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)


def encode_rows(spec: FeatureSpec, rows: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-token tensors as stored: [n,D] vectors in the storage dtype or int8 + scale, top-k logits."""
    out = {}
    for name in spec.tensor_names():
        x = rows[name].detach().to("cpu")
        if spec.compress == "int8":
            out[name], out[name + ".scale"] = quantize_int8(x)
        else:
            out[name] = x.to(STORAGE_DTYPES[spec.dtype]).contiguous()
    if spec.top_k:
        value_dtype = torch.float16 if spec.compress == "int8" else STORAGE_DTYPES[spec.dtype]
        out["topk_values"] = rows["topk_values"].detach().to("cpu", value_dtype).contiguous()
        out["topk_indices"] = rows["topk_indices"].detach().to("cpu", torch.int32).contiguous()
    return out


def save_shard(path: Path, spec: FeatureSpec, example_ids: Sequence[int], per_example: Sequence[dict[str, Tensor]]) -> None:
    """Write one shard atomically: the encoded rows of each example, concatenated in order."""
    from safetensors.torch import save_file

    lengths = [next(iter(rows.values())).shape[0] for rows in per_example]
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    tensors = {"example_ids": torch.tensor(list(example_ids), dtype=torch.int64), "offsets": offsets}
    for name in per_example[0]:
        tensors[name] = torch.cat([rows[name] for rows in per_example]).contiguous()
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"draftsmith_features": str(FORMAT_VERSION)})


def rows_of_batch(spec: FeatureSpec, mask: Tensor, lengths: Sequence[int], tensors: dict[str, Tensor]) -> list[dict[str, Tensor]]:
    """Split batch tensors [B,T,...] into per-example rows [n_i,...].

    Real tokens (mask [B,T] true) in row-major order are the examples' tokens concatenated in order
    -- true for padded rows and for packed rows alike -- so the split needs only their lengths.
    """
    flat = {name: t[mask] for name, t in tensors.items()}
    total = int(mask.sum())
    if sum(lengths) != total:
        raise FeatureCacheError(f"batch holds {total} tokens but its examples have {sum(lengths)}: the cache and the data disagree")
    out, start = [], 0
    for n in lengths:
        out.append({name: t[start : start + n] for name, t in flat.items()})
        start += n
    return out


class FeatureCache:
    """Reads (and, in hybrid mode, appends to) a feature cache folder.

    ``has(split, ids)`` says whether every example is cached; ``batch(...)`` lays cached features
    out like a collated batch; ``add(...)`` buffers features computed online, written as this rank's
    own shards by ``flush()``.
    """

    def __init__(self, folder: str | Path, spec: FeatureSpec, rank: int = 0, shard_tokens: int = 65536) -> None:
        self.folder = Path(folder)
        self.spec = spec
        self.rank = rank
        self.shard_tokens = shard_tokens
        self._handles: dict[str, Any] = {}
        self._where: dict[str, dict[int, tuple[str, int, int]]] = {s: {} for s in SPLITS}
        self._pending: dict[str, list[tuple[int, dict[str, Tensor]]]] = {s: [] for s in SPLITS}
        self._pending_ids: dict[str, set[int]] = {s: set() for s in SPLITS}
        self.refresh()

    # -- reading

    def refresh(self) -> None:
        """Index shard files written since the last look (by this or another rank)."""
        from safetensors import safe_open

        for path in sorted(self.folder.glob("*.safetensors")):
            if path.name in self._handles:
                continue
            split = path.name.split("-", 1)[0]
            if split not in SPLITS:
                continue
            try:
                handle = safe_open(str(path), framework="pt")
                ids = handle.get_tensor("example_ids").tolist()
                offsets = handle.get_tensor("offsets").tolist()
            except Exception as err:  # a truncated or foreign file: name it, do not guess
                raise FeatureCacheError(f"feature cache shard {path} is unreadable ({type(err).__name__}): delete it and run again to rebuild it") from None
            self._handles[path.name] = handle
            where = self._where[split]
            for i, example in enumerate(ids):
                where.setdefault(int(example), (path.name, offsets[i], offsets[i + 1]))

    def count(self, split: str) -> int:
        return len(self._where[split])

    def has(self, split: str, ids: Iterable[int], refresh: bool = True) -> bool:
        where = self._where[split]
        if all(i in where for i in ids):
            return True
        if refresh:
            self.refresh()
            return all(i in where for i in ids)
        return False

    def example(self, split: str, index: int, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
        """The cached rows of one example: {"final_hidden": [n,D], "layer_<i>": [n,D], "topk_*": [n,k]}."""
        try:
            name, start, end = self._where[split][index]
        except KeyError:
            raise FeatureCacheError(f"feature cache {self.folder} has no {split} example {index}") from None
        handle = self._handles[name]
        out = {}
        for tensor in self.spec.tensor_names():
            values = handle.get_slice(tensor)[start:end]
            if self.spec.compress == "int8":
                values = dequantize_int8(values, handle.get_slice(tensor + ".scale")[start:end], dtype)
            out[tensor] = values.to(dtype)
        if self.spec.top_k:
            out["topk_values"] = handle.get_slice("topk_values")[start:end].to(dtype)
            out["topk_indices"] = handle.get_slice("topk_indices")[start:end].to(torch.int64)
        return out

    def batch(self, split: str, ids: Sequence[int], segment_ids: Tensor, lengths: Sequence[int], dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
        """Cached features laid out like a collated batch: [B,T,D] tensors (zeros on padding), on
        segment_ids' device (only the real tokens travel there).

        segment_ids [B,T] (0 = padding) is the collator's; lengths are the examples' token counts
        in the batch (after truncation). Real tokens in row-major order are the examples in order.
        """
        mask = segment_ids > 0
        rows = [self.example(split, i, dtype) for i in ids]
        for i, n, r in zip(ids, lengths, rows):
            if r["final_hidden"].shape[0] < n:
                raise FeatureCacheError(f"feature cache {self.folder}: {split} example {i} has {r['final_hidden'].shape[0]} cached tokens, the batch has {n}")
        B, T = segment_ids.shape
        out = {}
        for name in rows[0]:
            flat = torch.cat([r[name][:n] for r, n in zip(rows, lengths)])
            if flat.shape[0] != sum(lengths):
                raise FeatureCacheError(f"feature cache {self.folder}: batch has {sum(lengths)} tokens, its cached examples {flat.shape[0]}")
            flat = flat.to(segment_ids.device, non_blocking=True)
            full = flat.new_zeros((B, T, *flat.shape[1:]))
            full[mask] = flat
            out[name] = full
        return out

    # -- writing (hybrid mode)

    def add(self, split: str, ids: Sequence[int], rows: Sequence[dict[str, Tensor]]) -> None:
        """Buffer rows computed online for examples not cached yet; flush when a shard is full."""
        where, pending = self._where[split], self._pending_ids[split]
        for i, r in zip(ids, rows):
            if i in where or i in pending:
                continue
            self._pending[split].append((int(i), encode_rows(self.spec, r)))
            pending.add(int(i))
        if sum(r["final_hidden"].shape[0] for _, r in self._pending[split]) >= self.shard_tokens:
            self.flush(split)

    def flush(self, split: Optional[str] = None) -> None:
        """Write this rank's buffered rows as a new shard (named by rank and sequence number)."""
        for s in [split] if split else list(SPLITS):
            pending = self._pending[s]
            if not pending:
                continue
            prefix = f"{s}-r{self.rank}-"
            taken = [int(p.stem[len(prefix) :]) for p in self.folder.glob(f"{prefix}*.safetensors") if p.stem[len(prefix) :].isdigit()]
            path = self.folder / f"{prefix}{max(taken, default=-1) + 1:05d}.safetensors"
            save_shard(path, self.spec, [i for i, _ in pending], [r for _, r in pending])
            self._pending[s], self._pending_ids[s] = [], set()
        self.refresh()

    def close(self) -> None:
        self._handles.clear()


# ----------------------------------------------------------------------------- building


def plan_shards(lengths: Sequence[int], shard_tokens: int) -> list[tuple[int, int]]:
    """Consecutive example ranges [start, end), each closed by the example that reaches shard_tokens."""
    plan, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        tokens += n
        if tokens >= shard_tokens:
            plan.append((start, i + 1))
            start, tokens = i + 1, 0
    if start < len(lengths):
        plan.append((start, len(lengths)))
    return plan


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def check_disk(folder: Path, spec: FeatureSpec, tokens: int, written: int, reserve_gb: float, say: Callable[[str], None]) -> int:
    """Report bytes per token and the projected size; raise FeatureCacheError when the disk cannot
    hold what is left to write plus reserve_gb. Returns the projected total in bytes."""
    per_token = spec.bytes_per_token()
    total = per_token * tokens
    probe = folder
    while not probe.exists() and probe != probe.parent:  # the disk the folder will be on
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    needed = max(0, total - written)
    layers = ", ".join(f"layer {i}" for i in spec.layers)
    what = "final_hidden" + (f" + {layers}" if layers else "") + (f" + top-{spec.top_k} logits" if spec.top_k else "")
    storage = "int8 + per-token scale" if spec.compress == "int8" else spec.dtype
    say(
        f"feature cache {folder}: {what} in {storage} = {per_token:,} bytes/token; {tokens:,} tokens "
        f"-> {_human(total)} projected ({_human(written)} already written), {_human(free)} free"
    )
    reserve = int(reserve_gb * 1024**3)
    if needed + reserve > free:
        raise FeatureCacheError(
            f"feature cache {folder} needs {_human(needed)} more but the disk has {_human(free)} free "
            f"(keeping data.features.reserve_gb={reserve_gb} free): free space, point data.features.dir at a larger disk, "
            "or use data.features.compress=int8"
        )
    return total


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def open_cache(folder: Path, spec: FeatureSpec, create: bool) -> None:
    """Check an existing index against `spec` (FeatureCacheError on mismatch); write it if absent and `create`."""
    folder = Path(folder)
    if not folder.is_dir():
        if create:
            write_spec(folder, spec)
        return
    stored = read_spec(folder)
    if stored is not None:
        stored.check_serves(spec, folder)
        return
    if any(folder.glob("*.safetensors")):
        raise FeatureCacheError(f"feature cache {folder} has shards but no {INDEX_NAME}: delete the folder to rebuild it")
    if create:
        write_spec(folder, spec)


@torch.no_grad()
def compute_rows(target, spec: FeatureSpec, batch: dict, lengths: Sequence[int], device) -> list[dict[str, Tensor]]:
    """Run the target on a collated batch; return each example's rows (final_hidden, layers, top-k)."""
    batch = batch.to(device)
    feats = target.features(
        batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        layers=spec.layers,
        need_logits=False,
    )
    return rows_from_features(target, spec, feats, batch["segment_ids"], lengths)


def rows_from_features(target, spec: FeatureSpec, feats, segment_ids: Tensor, lengths: Sequence[int]) -> list[dict[str, Tensor]]:
    """Per-example rows of TargetFeatures computed on a collated batch."""
    mask = segment_ids > 0
    tensors = {"final_hidden": feats.final_hidden}
    tensors.update({f"layer_{i}": feats.hidden[i] for i in spec.layers})
    rows = rows_of_batch(spec, mask, lengths, tensors)
    if spec.top_k:
        for r in rows:
            logits = target.lm_head(r["final_hidden"])
            values, indices = logits.topk(min(spec.top_k, logits.shape[-1]), dim=-1)
            r["topk_values"], r["topk_indices"] = values, indices
    return rows


def build_cache(
    target,
    spec: FeatureSpec,
    splits: dict[str, Sequence[dict]],
    collator,
    folder: str | Path,
    shard_tokens: int,
    batch_size: int,
    reserve_gb: float,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] = lambda: None,
    say: Callable[[str], None] = print,
    progress: bool = True,
) -> Path:
    """Precompute the features of every example of `splits` into `folder` (resumable, deterministic).

    Rank r of world_size computes the planned shards i with i % world_size == r; `barrier` is called
    by every rank before and after. Shards that exist are kept. Within a shard, examples run in
    batches of similar length (a fixed order), so the same inputs give the same files.
    """
    from tqdm.auto import tqdm

    folder = Path(folder)
    max_length = spec.data["max_length"]
    jobs = []
    tokens = 0
    for split, examples in splits.items():
        lengths = [min(len(e["input_ids"]), max_length) for e in examples]
        tokens += sum(lengths)
        for number, (start, end) in enumerate(plan_shards(lengths, shard_tokens)):
            jobs.append((split, number, start, end, sum(lengths[start:end])))
    if rank == 0:
        # Refuse a foreign cache or a disk too small before writing anything.
        open_cache(folder, spec, create=False)
        check_disk(folder, spec, tokens, _folder_bytes(folder) if folder.is_dir() else 0, reserve_gb, say)
        open_cache(folder, spec, create=True)
    barrier()
    open_cache(folder, spec, create=False)
    existing = FeatureCache(folder, spec, rank)
    covered = {s: existing.count(s) == len(splits[s]) for s in splits}
    existing.close()
    todo = [j for j in jobs if not covered[j[0]] and not (folder / f"{j[0]}-{j[1]:05d}.safetensors").is_file()]
    barrier()  # every rank has listed what is missing before any rank writes: they split the same list
    if rank == 0 and not todo:
        say(f"feature cache {folder} is complete")
    mine = [j for k, j in enumerate(todo) if k % world_size == rank]
    device = target.device
    bar = tqdm(total=sum(j[4] for j in mine), desc="features", unit="tok", disable=not (progress and mine), dynamic_ncols=True)
    for split, number, start, end, _ in mine:
        examples = splits[split]
        order = sorted(range(start, end), key=lambda i: (len(examples[i]["input_ids"]), i))
        rows: dict[int, dict[str, Tensor]] = {}
        for b in range(0, len(order), batch_size):
            ids = order[b : b + batch_size]
            batch = collator([examples[i] for i in ids])
            lengths = [min(len(examples[i]["input_ids"]), max_length) for i in ids]
            for i, r in zip(ids, compute_rows(target, spec, batch, lengths, device)):
                rows[i] = encode_rows(spec, r)
            bar.update(sum(lengths))
        ids = list(range(start, end))
        save_shard(folder / f"{split}-{number:05d}.safetensors", spec, ids, [rows[i] for i in ids])
    bar.close()
    barrier()
    return folder


__all__ = [
    "FeatureCache",
    "FeatureCacheError",
    "FeatureSpec",
    "build_cache",
    "check_disk",
    "compute_rows",
    "dequantize_int8",
    "examples_digest",
    "make_spec",
    "open_cache",
    "plan_shards",
    "quantize_int8",
    "read_spec",
    "rows_from_features",
    "rows_of_batch",
]
