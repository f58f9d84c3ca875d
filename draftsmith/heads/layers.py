"""Layers that draft heads share: RMSNorm, rotary positions with the target's scaling, a decoder
layer with grouped-query attention, the residual SiLU block, and the one attention-mask builder.

Module and parameter names follow Hugging Face's Llama (``input_layernorm``, ``self_attn.q_proj``,
``post_attention_layernorm``, ``mlp.gate_proj``) and vLLM's Medusa (``layers.J`` inside a residual
block), so an export to an engine's layout renames prefixes and nothing else.

Shapes: B batch, T or P positions, S keys, D hidden size, H query heads, Hkv key/value heads, Dh
head size.
"""

from __future__ import annotations

import copy
import math
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.target import TargetDims

__all__ = [
    "MLP",
    "Attention",
    "BlockEntries",
    "DecoderLayer",
    "LayerShape",
    "RMSNorm",
    "ResidualBlock",
    "Rotary",
    "attend",
    "attend_cached",
    "attend_in_training",
    "flex_attend",
    "causal_allowed",
    "preallocate_cache",
    "tree_visibility",
    "truncate_cache",
]


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), computed in at least fp32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # torch's rms_norm: the same operations on the CPU (the same bits with torch 2.13), one fused
        # kernel on CUDA (torch >= 2.9) where the formula written out is six, each a launch or a graph node. It
        # computes half-precision inputs in fp32 itself; inputs and weights of two precisions (bf16
        # activations under autocast) it would not fuse, so those are brought to one first.
        dtype = x.dtype if x.dtype == self.weight.dtype else torch.promote_types(x.dtype, torch.float32)
        return F.rms_norm(x.to(dtype), self.weight.shape, self.weight.to(dtype), self.eps).to(x.dtype)


class ResidualBlock(nn.Module):
    """``num_layers`` steps of x + SiLU(W x + b), each started at zero so a fresh block is the
    identity (Medusa's block; vLLM names its weights ``layers.J.weight`` / ``layers.J.bias``)."""

    def __init__(self, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


@dataclass
class LayerShape:
    """The shape of a head's decoder layer(s); 0 / None takes the target's value.

    Resolved against the target when the head is built (``resolve``) and written back into the
    config, so checkpoints and exports record concrete values and a head rebuilds without its target.
    """

    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 0.0
    rope_theta: float = 0.0
    # The target's rope scaling (rope_type and its parameters, as in an HF config), None for plain RoPE.
    rope_scaling: Optional[dict[str, Any]] = None
    # Room for positions when the rope type needs it (llama3, yarn, ...).
    max_position_embeddings: int = 0

    def resolved(self, dims: TargetDims):
        """A copy with the zeros filled from the target's HF config (the recipe's own stays as written)."""
        self = copy.deepcopy(self)
        hf = dims.hf_config or {}
        rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
        D = dims.hidden_size
        self.num_attention_heads = self.num_attention_heads or int(hf.get("num_attention_heads") or max(1, D // 64))
        self.num_key_value_heads = self.num_key_value_heads or int(hf.get("num_key_value_heads") or self.num_attention_heads)
        self.head_dim = self.head_dim or int(hf.get("head_dim") or D // self.num_attention_heads)
        self.intermediate_size = self.intermediate_size or int(hf.get("intermediate_size") or 4 * D)
        self.rms_norm_eps = self.rms_norm_eps or float(hf.get("rms_norm_eps") or 1e-6)
        self.rope_theta = self.rope_theta or float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        self.max_position_embeddings = self.max_position_embeddings or int(hf.get("max_position_embeddings") or 4096)
        if self.rope_scaling is None:
            scaling = hf.get("rope_scaling") if isinstance(hf.get("rope_scaling"), dict) else rope
            kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
            if kind not in (None, "default"):
                self.rope_scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        return self

    def check_shape(self, key: str) -> None:
        """ValueError naming head.<key> when heads and key/value heads do not fit together."""
        if self.num_attention_heads and self.num_key_value_heads and self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"recipe key '{key}.num_key_value_heads'={self.num_key_value_heads} must divide "
                f"{key}.num_attention_heads={self.num_attention_heads} (grouped-query attention)"
            )


class Rotary(nn.Module):
    """Rotary position embedding with the target's rope type (plain, linear, llama3, yarn, ...):
    inverse frequencies and attention scaling come from transformers' own rope initialisers."""

    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        dim = shape.head_dim
        if shape.rope_scaling:
            from transformers import LlamaConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            params = {**shape.rope_scaling, "rope_theta": shape.rope_theta}
            kind = params.get("rope_type", params.get("type"))
            params["rope_type"] = kind
            config = LlamaConfig(
                hidden_size=dim * shape.num_attention_heads, num_attention_heads=shape.num_attention_heads,
                head_dim=dim, max_position_embeddings=shape.max_position_embeddings, rope_parameters=params,
            )
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
        else:
            inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
            scaling = 1.0
        # Each rotated pair's frequency, in both halves (the rotate-half layout), in float64. Not a
        # buffer: a cast of the whole head (``head.to(torch.bfloat16)``, ``head.half()``; older
        # DeepSpeed releases cast a bf16 model so) would round a buffer to 8 bits, and at position
        # 3,000 an angle would be off by radians. ``_apply`` moves it with the module, never casts
        # it, from a copy kept on the host (so a head made on the meta device gets real values).
        self._host_frequencies = torch.cat([inv_freq.cpu(), inv_freq.cpu()]).to(torch.float64)
        self.frequencies = self._host_frequencies.to(torch.get_default_device())
        self.scaling = float(scaling)

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        # Where ``fn`` sends a tensor of this device (a move, a cast, to_empty): only a move moves the
        # frequencies, so a cast or a no-op keeps the tensor itself (a captured graph reads it).
        device = fn(torch.zeros(0, dtype=torch.float64, device=self.frequencies.device)).device
        if device != self.frequencies.device:
            self.frequencies = self._host_frequencies.to(device)
        return self

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [..., P, Dh] for integer positions [..., P] (rotate-half convention)."""
        angles = positions.to(torch.float64).unsqueeze(-1) * self.frequencies.to(positions.device)
        cos, sin = angles.cos(), angles.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype), sin.to(dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


@dataclass
class BlockEntries:
    """The attending positions' own keys and values k, v [B,Hkv,P,Dh], seen inside blocks of
    ``size`` consecutive positions: position p sees entry p' of its own block where ``allowed``
    [size,size] bool says (row p % size, column p' % size). DFlash's slots, which see each other
    (all, or causally). FlexAttention reads them as P more keys; ``attend`` as ``size`` own runs."""

    k: Tensor
    v: Tensor
    size: int
    allowed: Tensor

    def __post_init__(self) -> None:
        P = self.k.shape[2]
        if self.size < 1 or P % self.size:
            raise ValueError(f"BlockEntries: {P} positions do not make whole blocks of {self.size}")
        if tuple(self.allowed.shape) != (self.size, self.size):
            raise ValueError(f"BlockEntries: allowed has shape {tuple(self.allowed.shape)}, blocks of {self.size} need [{self.size},{self.size}]")

    def as_runs(self) -> tuple[list[tuple[Tensor, Tensor]], Tensor]:
        """The same entries as ``attend``'s own runs and their own_allowed [P,size]: run j holds,
        at every position, slot j of that position's block."""
        B, Hkv, P, Dh = self.k.shape
        N, G = P // self.size, self.size

        def slot(t: Tensor, j: int) -> Tensor:
            return t.view(B, Hkv, N, G, Dh)[:, :, :, j : j + 1].expand(-1, -1, -1, G, -1).reshape(B, Hkv, P, Dh)

        return [(slot(self.k, j), slot(self.v, j)) for j in range(G)], self.allowed.repeat(N, 1)


OwnEntries = Union[Sequence[tuple[Tensor, Tensor]], BlockEntries]


def attend(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, own: OwnEntries = (), own_allowed: Optional[Tensor] = None) -> Tensor:
    """Softmax attention with grouped-query key/value heads, in at least fp32.

    q [B,H,P,Dh]; k, v [B,Hkv,S,Dh]; allowed [B or 1,1,P,S] bool. ``own``: extra (k, v) pairs
    [B,Hkv,P,Dh] that position p alone sees, entry p of each (the training-time-test diagonal: a
    drafted token's own earlier steps), with ``own_allowed`` [P, len(own)] bool saying which of
    them each position sees (default: all); or the positions' own entries in blocks
    (``BlockEntries``: a DFlash block's slots). Returns [B,H,P,Dh].
    """
    if isinstance(own, BlockEntries):
        own, own_allowed = own.as_runs()
    H, Hkv = q.shape[1], k.shape[1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    scale = 1.0 / math.sqrt(q.shape[-1])
    expand = (lambda t: t.to(dtype).repeat_interleave(H // Hkv, dim=1)) if H != Hkv else (lambda t: t.to(dtype))  # noqa: E731
    q = q.to(dtype)
    scores = torch.matmul(q, expand(k).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    diag = [(q * expand(kd)).sum(-1, keepdim=True) * scale for kd, _ in own]  # [B,H,P,1] each
    if own_allowed is not None:
        diag = [d.masked_fill(~own_allowed[:, j].view(-1, 1), float("-inf")) for j, d in enumerate(diag)]
    weights = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)
    S = k.shape[2]
    out = torch.matmul(weights[..., :S], expand(v))
    for j, (_, vd) in enumerate(own):
        out = out + weights[..., S + j : S + j + 1] * expand(vd)
    return out


# How training runs attention (``attend_in_training``): "auto" is "flex" on CUDA where torch has
# FlexAttention, "recompute" on other accelerators and "keep" on the CPU; or one of them forced.
TRAINING_ATTENTION = "auto"
_TRAINING_ATTENTION_CHOICES = ("auto", "flex", "recompute", "keep")
_compiled_flex: Any = None
_flex_failed: Optional[str] = None  # why FlexAttention failed in this process, once it has


def _training_attention(device: torch.device) -> str:
    choice = TRAINING_ATTENTION
    if choice not in _TRAINING_ATTENTION_CHOICES:
        raise ValueError(f"draftsmith.heads.layers.TRAINING_ATTENTION must be one of {_TRAINING_ATTENTION_CHOICES}, got {choice!r}")
    if choice != "auto":
        return choice
    if device.type == "cpu":
        return "keep"
    if device.type == "cuda":
        from importlib.util import find_spec

        return "flex" if find_spec("torch.nn.attention.flex_attention") is not None else "recompute"
    return "recompute"


def flex_length(n: int, multiple: int = 1) -> int:
    """The length ``flex_attend`` pads n positions or keys to: a multiple of an eighth of the next
    power of two (at least 128), and of ``multiple``. A compiled FlexAttention is compiled once
    per shape; a batch's length is its longest row, so unpadded every new length would compile a
    kernel (forward and backward) and past dynamo's limit run uncompiled. Padded, lengths up to
    2,048 fall into 12 shapes, at most a quarter longer than asked."""
    top = 1 << max(n - 1, 0).bit_length()
    step = max(128, top // 8)
    length = -(-n // step) * step
    return -(-length // multiple) * multiple


def flex_attend(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, own: OwnEntries = (), own_allowed: Optional[Tensor] = None, own_capacity: int = 0
) -> Tensor:
    """``attend``'s result through FlexAttention, which never materialises the scores and skips
    the tiles nobody sees. The own entries become keys after the shared ones: entry p of own run j
    at S' + j P' + p, seen by position p alone (where ``own_allowed`` says); ``BlockEntries`` as
    P' keys after S', seen inside each block where its ``allowed`` says. Runs in autocast's dtype
    where autocast is on (else q's), compiled on CUDA (where FlexAttention is fast only compiled:
    ``_flex_runner``), as written elsewhere (the CPU, where it has no backward: tests only).

    Shapes are padded so that a compiled FlexAttention meets few of them, with zero positions and
    keys nobody sees (no tile of them is in the block mask, and the mask refuses them where a tile
    holds real ones too, so they cost copies, not attention work):
    - positions and shared keys to ``flex_length`` (P', S'), so batches of other lengths reuse
      a kernel;
    - own runs to ``own_capacity`` of them, so EAGLE-3's 7 training-time-test steps have one key
      length and compile one kernel instead of 7. FlexAttention keeps its keys and values for
      backward, padding included: at the 8B bench shape (4 x 2048 positions, 7 steps) about 0.7 GB
      more per EAGLE layer than the unpadded runs.
    Where the real rows and runs end is held in device tensors, not ints the kernel would be
    specialised on."""
    B, H, P, Dh = q.shape
    S = k.shape[2]
    kind = q.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else q.dtype
    blocks = isinstance(own, BlockEntries)
    Pp, Sp = flex_length(P, own.size if blocks else 1), flex_length(S)

    def padded(t: Tensor, length: int) -> Tensor:  # [B,heads,L,Dh] with zero rows up to length
        return F.pad(t, (0, 0, 0, length - t.shape[2])) if length > t.shape[2] else t

    visible = F.pad(allowed, (0, Sp - S, 0, Pp - P)).expand(B, 1, Pp, Sp)
    positions = torch.arange(Pp, device=q.device)
    real = positions < P
    # Filled on the device: no copy from the host, which would wait for the queue.
    rows = torch.full((), P, device=q.device)

    def shared(b, qi, kv):
        return (kv < Sp) & visible[b, 0, qi, kv.clamp(max=Sp - 1)]

    if blocks:
        G, seen_in_block = own.size, own.allowed
        extra = [(padded(own.k, Pp), padded(own.v, Pp))]  # the padding is whole blocks of its own

        def mask_mod(b, h, qi, kv):
            r = (kv - Sp).clamp(min=0)
            return shared(b, qi, kv) | ((kv >= Sp) & (qi < rows) & (r // G == qi // G) & seen_in_block[qi % G, r % G])

        slots = torch.arange(G, device=q.device).view(G, 1)
        own_keys = Sp + (positions // G) * G + slots  # [G,P']: slot j of each position's block
        own_seen = seen_in_block[positions % G].t() & real
    else:
        n = len(own)
        total = max(own_capacity, n)
        extra = [(padded(kd, Pp), padded(vd, Pp)) for kd, vd in own]
        if total > n:
            zeros = k.new_zeros(B, k.shape[1], (total - n) * Pp, Dh)
            extra.append((zeros, zeros))
        end = torch.full((), Sp + n * Pp, device=q.device)  # where the real runs end
        runs_seen = None
        if own_allowed is not None and total:
            runs_seen = F.pad(own_allowed.to(torch.bool), (0, total - n, 0, Pp - P))

        def mask_mod(b, h, qi, kv):
            r = (kv - Sp).clamp(min=0)
            diagonal = (kv >= Sp) & (kv < end) & (qi < rows) & (r % Pp == qi)
            if runs_seen is not None:
                diagonal = diagonal & runs_seen[qi, (r // Pp).clamp(max=total - 1)]
            return shared(b, qi, kv) | diagonal

        own_keys = Sp + torch.arange(n, device=q.device).view(n, 1) * Pp + positions  # [n,P']
        own_seen = real.expand(n, Pp) if runs_seen is None else runs_seen[:, :n].t()
    keys = torch.cat([padded(k, Sp), *(kd for kd, _ in extra)], dim=2).to(dtype)
    values = torch.cat([padded(v, Sp), *(vd for _, vd in extra)], dim=2).to(dtype)
    block_mask = training_block_mask(mask_mod, visible[:1] if allowed.shape[0] == 1 else visible, keys.shape[2], own_keys, own_seen)
    run = _flex_runner(q.device)
    out = run(padded(q, Pp).to(dtype), keys, values, block_mask=block_mask, scale=1.0 / math.sqrt(Dh), enable_gqa=H != k.shape[1])
    return out[:, :, :P]


def _flex_runner(device: torch.device):
    """FlexAttention as it runs on ``device``: compiled on CUDA (once per process), as written elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        # One compiled kernel per key length (and per head shape): EAGLE-3's training-time-test steps
        # share one (own_capacity), DFlash's blocks another; the limit is raised anyway, as dynamo's
        # default (8) would send the rest to the uncompiled FlexAttention, which materialises the scores.
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, name, max(getattr(config, name), 64))
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def training_block_mask(mask_mod, allowed: Tensor, KV: int, own_keys: Optional[Tensor] = None, own_seen: Optional[Tensor] = None, block: int = 128):
    """The BlockMask ``create_block_mask(mask_mod, B, None, P, KV)`` makes for ``flex_attend``'s keys,
    counted tile by tile instead of by calling ``mask_mod`` at every (position, key) pair. The keys:
    S shared ones, seen where ``allowed`` [B or 1,1,P,S] says, then own entries, each seen by one
    position: ``own_keys`` [m,P] is the key of each position's m own entries, ``own_seen`` [m,P]
    bool whether it sees it (default: all). ``mask_mod`` must say the same; the kernel calls it
    inside the tiles that are partly seen.

    ``create_block_mask`` evaluates the mask over the whole [B,P,KV] grid: at an 8B target's bench
    shape (4 x 2048 positions, EAGLE-3's 7th step) 117M pairs with int64 intermediates, a DFlash
    layer's 4,096 slots of 8-token blocks 570M where its slots were 8 own runs. Here the shared
    keys cost one pass over ``allowed`` and the own entries m P additions. Tiles count as torch
    counts them: full where every pair of a block x block tile is seen (tiles past the ends never
    are), partial where some are; the tables are ``create_block_mask``'s (tests/unit/test_heads.py)."""
    from torch.nn.attention.flex_attention import BlockMask

    device = allowed.device
    P, S = allowed.shape[-2], allowed.shape[-1]
    nq, ns, nk = -(-P // block), -(-S // block), -(-KV // block)
    # Seen pairs per (query tile, key tile): the shared keys' from allowed, padded to whole tiles.
    shared = F.pad(allowed[:, 0].to(torch.int32), (0, ns * block - S, 0, nq * block - P))
    counts = F.pad(shared.view(allowed.shape[0], nq, block, ns, block).sum(dim=(2, 4), dtype=torch.int32), (0, nk - ns))
    if own_keys is not None and own_keys.numel():
        query_tile = torch.arange(P, device=device) // block
        seen = torch.ones_like(own_keys, dtype=torch.int32) if own_seen is None else own_seen.to(torch.int32)
        own = torch.zeros(nq * nk, dtype=torch.int32, device=device)
        own.index_put_(((query_tile * nk + own_keys // block).reshape(-1),), seen.reshape(-1), accumulate=True)
        counts = counts + own.view(1, nq, nk)
    full = counts == block * block
    partial = (counts > 0) & ~full

    def ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:  # per query tile: how many, then which (ascending)
        tiles = tiles.unsqueeze(1).to(torch.int32)  # [B or 1, heads 1, nq, nk]
        order = torch.argsort(tiles, dim=-1, descending=True, stable=True)
        return tiles.sum(dim=-1).to(torch.int32), order.to(torch.int32)

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=(block, block), mask_mod=mask_mod, seq_lengths=(P, KV))


def attend_cached(q: Tensor, k: Tensor, v: Tensor, visible: Tensor) -> Tensor:
    """Drafting's attention over a cache: q [1,H,P,Dh] over k, v [1,Hkv,S,Dh], visible [P,S] bool
    (every row sees at least itself). ``attend``'s result through torch's scaled dot product
    attention: its fused kernel and a few small ones (the queries' and the mask's copies, the mask's
    conversion) where ``attend`` writes out nine operations in fp32 and more in bf16, casting the
    keys and values; in fp32 and fp64 equal to rounding, in bf16 at the kernel's own precision
    (``attend`` keeps the weights in fp32). The H query heads fold into Hkv groups of
    G = H / Hkv heads, each group's queries one after another, so each key/value head is read as it
    is (no copy G times over) and the attention keeps a kernel that takes a mask. Returns [1,H,P,Dh]
    whatever layout the kernel wrote (CUDA's memory-efficient one writes [B,P',Hkv,Dh] storage),
    brought to the heads' order with at most one copy, after which ``Attention.output`` needs none
    (or, where no copy was needed here, makes its own one)."""
    B, H, P, Dh = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    grouped = q.reshape(B, Hkv, G * P, Dh)  # query head kv*G + g is group kv's rows g*P .. g*P+P-1
    mask = visible.view(1, 1, 1, P, -1).expand(1, 1, G, P, -1).reshape(1, 1, G * P, -1)
    out = F.scaled_dot_product_attention(grouped, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)  # [B,Hkv,G*P,Dh]
    by_position = out.unflatten(2, (G, P)).permute(0, 3, 1, 2, 4).reshape(B, P, H, Dh)
    return by_position.transpose(1, 2)


def attend_in_training(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, own: OwnEntries = (), own_allowed: Optional[Tensor] = None, own_capacity: int = 0
) -> Tensor:
    """``attend`` where a gradient may follow. ``attend`` materialises the [B,H,P,S] scores and
    autograd keeps their fp32 softmax for backward: at an 8B target's width and 4 x 2048 tokens
    that is about 3 GB per layer call, 21 GB over EAGLE-3's 7 training-time-test steps, and a dozen
    passes over them. So where a gradient follows (``TRAINING_ATTENTION``): on CUDA, FlexAttention
    (``flex_attend``: the same attention, bf16 under autocast, nothing materialised); on another
    accelerator, ``attend`` checkpointed (backward recomputes the scores from q, k and v, which are
    all it keeps: the same values and gradients); on the CPU, ``attend`` as it is. Where
    FlexAttention fails (no backward on the CPU, no Triton), one note says why and the process goes
    on with the recomputed attention. ``own_capacity``: the most own runs this caller's calls
    bring (``flex_attend``; the other paths need not know)."""
    tensors = (q, k, v, *((own.k, own.v) if isinstance(own, BlockEntries) else (t for pair in own for t in pair)))
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return attend(q, k, v, allowed, own, own_allowed)
    global _flex_failed
    how = _training_attention(q.device)
    if how == "flex" and _flex_failed is None:
        try:
            return flex_attend(q, k, v, allowed, own, own_allowed, own_capacity)
        except Exception as err:  # a torch or Triton without a working FlexAttention: say so once, go on
            _flex_failed = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            print(f"note: FlexAttention failed ({_flex_failed}); training attention is recomputed in backward instead", file=sys.stderr)
    if how in ("flex", "recompute"):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(attend, q, k, v, allowed, own, own_allowed, use_reentrant=False)
    return attend(q, k, v, allowed, own, own_allowed)


def causal_allowed(
    T: int,
    device: torch.device,
    segment_ids: Optional[Tensor] = None,
    attention_mask: Optional[Tensor] = None,
) -> Tensor:
    """Which positions each position may attend to over whole sequences: allowed [B or 1,1,T,T] bool.

    Causal; within one packed example when segment_ids [B,T] is given; only real keys per
    attention_mask, which is either a padding mask [B,T] (1 = real token) or the packing
    collator's 4D mask [B,1,T,T] (additive float: 0 = attend; or bool: True = attend). Every
    position also sees itself, so no row of the softmax is empty.
    """
    allowed = torch.ones(T, T, dtype=torch.bool, device=device).tril().view(1, 1, T, T)
    if segment_ids is not None:
        allowed = allowed & (segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)).unsqueeze(1)
    if attention_mask is not None:
        if attention_mask.dim() == 4:
            visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        elif attention_mask.dim() == 2:
            visible = attention_mask.bool()[:, None, None, :]
        else:
            raise ValueError(f"attention_mask must be [B,T] or [B,1,T,T], got shape {tuple(attention_mask.shape)}")
        allowed = allowed & visible
    return allowed | torch.eye(T, dtype=torch.bool, device=device).view(1, 1, T, T)


class Attention(nn.Module):
    """q/k/v/o projections with grouped-query heads; q, k and v may read a wider input than the
    hidden size (EAGLE-3's midlayer reads [embedding; feature], 2D). ``qk_norm`` adds Qwen3's
    per-head RMSNorm of queries and keys (``q_norm``, ``k_norm`` over Dh) before the rotation."""

    def __init__(self, hidden_size: int, shape: LayerShape, input_size: Optional[int] = None, qk_norm: bool = False) -> None:
        super().__init__()
        H, Hkv, Dh = shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim
        if H % Hkv:
            raise ValueError(f"{H} attention heads cannot share {Hkv} key/value heads")
        width = input_size or hidden_size
        self.heads, self.kv_heads, self.head_dim = H, Hkv, Dh
        self.q_proj = nn.Linear(width, H * Dh, bias=False)
        self.k_proj = nn.Linear(width, Hkv * Dh, bias=False)
        self.v_proj = nn.Linear(width, Hkv * Dh, bias=False)
        self.o_proj = nn.Linear(H * Dh, hidden_size, bias=False)
        self.q_norm = RMSNorm(Dh, shape.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(Dh, shape.rms_norm_eps) if qk_norm else None

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B,P,W] -> q [B,H,P,Dh], k and v [B,Hkv,P,Dh], rotary applied (cos/sin [B or 1,P,Dh])."""
        B, P, _ = x.shape
        q = self.q_proj(x).view(B, P, self.heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        k, v = self.kv(x, cos, sin)
        return _rotate(q.transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1)), k, v

    def kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values alone: x [B,P,W] -> k, v [B,Hkv,P,Dh], keys normed and rotated (DFlash
        projects the target's context with each layer's own key/value weights)."""
        B, P, _ = x.shape
        k = self.k_proj(x).view(B, P, self.kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = self.v_proj(x).view(B, P, self.kv_heads, self.head_dim).transpose(1, 2)
        return _rotate(k.transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1)), v

    def output(self, attended: Tensor, dtype: torch.dtype) -> Tensor:
        """attended [B,H,P,Dh] -> [B,P,D]."""
        B, H, P, Dh = attended.shape
        return self.o_proj(attended.transpose(1, 2).reshape(B, P, H * Dh).to(dtype))


class MLP(nn.Module):
    """SwiGLU: down(SiLU(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Llama-style decoder layer (attention with rotary positions, SwiGLU MLP) whose attention
    input and residual the caller may choose, with three attention paths over the same weights:

    - ``forward``: causal over whole sequences (a prefix layer, an augmenting block);
    - ``forward_unrolled``: one step of training-time test (EAGLE), over whole sequences;
    - ``forward_cached``: drafting, appending to a KV cache with a tree visibility mask.

    ``input_norm=False`` leaves out ``input_layernorm`` (EAGLE's first layer reads its fused input
    as it is); ``qk_norm=True`` makes it a Qwen3 layer (DFlash's). ``prepare(x)`` gives the usual
    pre-norm pair (attention input, residual); a head with another input (EAGLE-3's [embedding;
    feature]) builds that pair itself.
    """

    def __init__(
        self, hidden_size: int, shape: LayerShape, input_size: Optional[int] = None, input_norm: bool = True, qk_norm: bool = False
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, shape.rms_norm_eps) if input_norm else None
        self.self_attn = Attention(hidden_size, shape, input_size, qk_norm)
        self.post_attention_layernorm = RMSNorm(hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(hidden_size, shape.intermediate_size)

    @property
    def head_dim(self) -> int:
        return self.self_attn.head_dim

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(attention input, residual) of the pre-norm layer: (input_layernorm(x), x)."""
        return (self.input_layernorm(x) if self.input_layernorm is not None else x), x

    def finish(self, residual: Tensor, attended: Tensor) -> Tensor:
        """residual + attention output, then the MLP's residual step."""
        x = residual + self.self_attn.output(attended, residual.dtype)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, attn_in: Tensor, residual: Tensor, cos: Tensor, sin: Tensor, allowed: Tensor) -> Tensor:
        """Whole sequences: attn_in [B,T,W], residual [B,T,D], allowed [B or 1,1,T,T]."""
        q, k, v = self.self_attn.qkv(attn_in, cos, sin)
        return self.finish(residual, attend_in_training(q, k, v, allowed))

    def forward_unrolled(
        self,
        attn_in: Tensor,
        residual: Tensor,
        cos: Tensor,
        sin: Tensor,
        first: Optional[tuple[Tensor, Tensor]],
        diagonal: list[tuple[Tensor, Tensor]],
        allowed: Tensor,
        steps: int = 0,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """One unrolled step of training-time test over whole sequences.

        `first`: step 1's (k, v) [B,Hkv,T,Dh] (None at step 1: this step's own); `diagonal`: the
        (k, v) of steps 2..s-1; allowed [B or 1,1,T,T]: which step-1 positions each position sees;
        `steps`: how many the unroll runs (its last step has steps - 1 own runs).
        Position t at step s sees step-1 entries t' <= t (real features, as the prefix is at run
        time) and its own entries of steps 2..s (its drafted ancestors). Returns (output [B,T,D],
        this step's (k, v)).
        """
        q, k, v = self.self_attn.qkv(attn_in, cos, sin)
        k1, v1 = first if first is not None else (k, v)
        own = [*diagonal, (k, v)] if first is not None else []
        return self.finish(residual, attend_in_training(q, k1, v1, allowed, own, own_capacity=max(steps - 1, 0))), (k, v)

    def forward_cached(self, attn_in: Tensor, residual: Tensor, cos: Tensor, sin: Tensor, cache: dict, visible: Tensor) -> Tensor:
        """Drafting: P new entries [1,P,.] appended after the cache's S entries; visible [P,S+P]
        bool says which entries each new one sees (prefix, its ancestors, itself). Updates `cache`.
        A preallocated cache (``{"k", "v"}`` buffers [1,Hkv,C,Dh] and ``"slots"`` [P]) is written
        at its slots and read whole: visible is then [P,C]."""
        q, k, v = self.self_attn.qkv(attn_in, cos, sin)
        if "slots" in cache:
            keys, values = cache["k"], cache["v"]
            keys.index_copy_(2, cache["slots"], k.to(keys.dtype))
            values.index_copy_(2, cache["slots"], v.to(values.dtype))
        else:
            keys = k if cache.get("k") is None else torch.cat([cache["k"], k], dim=2)
            values = v if cache.get("v") is None else torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = keys, values
        return self.finish(residual, attend_cached(q, keys, values, visible))


def preallocate_cache(layer: "DecoderLayer", cache: dict, capacity: int, keep: int, device) -> None:
    """Give a ``forward_cached`` cache of ``layer`` preallocated key and value buffers
    [1,Hkv,capacity,Dh] holding the first ``keep`` entries it held (a cache that grows)."""
    attn = layer.self_attn
    old = cache.get("k"), cache.get("v")
    cache["k"], cache["v"] = (torch.zeros(1, attn.kv_heads, capacity, attn.head_dim, dtype=attn.k_proj.weight.dtype, device=device) for _ in range(2))
    if old[0] is not None and keep:
        cache["k"][:, :, :keep] = old[0][:, :, :keep]
        cache["v"][:, :, :keep] = old[1][:, :, :keep]


def truncate_cache(cache: dict, length: int) -> None:
    """Keep the first `length` entries of a forward_cached cache."""
    if cache.get("k") is not None:
        cache["k"], cache["v"] = cache["k"][:, :, :length], cache["v"][:, :, :length]


def ancestor_slots(nodes: Sequence[int], parents: Sequence[int], slots: dict[int, int]) -> list[list[int]]:
    """For each of ``nodes``, the cache slots (``slots``: node id -> slot) of its ancestors below the
    root (node 0, a decided position), nearest first: ``tree_visibility``'s ``ancestors``."""
    out = []
    for node in nodes:
        found, parent = [], parents[node]
        while parent > 0:
            found.append(slots[parent])
            parent = parents[parent]
        out.append(found)
    return out


def tree_visibility(decided: int, cached: int, ancestors: Sequence[Sequence[int]], device: Optional[torch.device] = None) -> Tensor:
    """visible [P, cached+P] on `device` for P new tree entries on a cache holding `cached` entries,
    the first `decided` of them decided positions: each new entry sees those, the cache slots of its
    ancestors (``ancestors[p]``) and itself. Built in one scatter from one index upload."""
    P = len(ancestors)
    rows = [row for row, slots in enumerate(ancestors) for _ in range(len(slots) + 1)]
    cols = [col for row, slots in enumerate(ancestors) for col in (*slots, cached + row)]
    index = torch.tensor([rows, cols], dtype=torch.long).to(device, non_blocking=True)
    visible = torch.zeros(P, cached + P, dtype=torch.bool, device=device)
    visible[:, :decided] = True
    visible[index[0], index[1]] = True
    return visible

