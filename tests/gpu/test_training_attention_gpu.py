"""Training attention on CUDA: FlexAttention and the recomputed attention against attend as it is
(skipped without CUDA). tests/unit holds the forward of flex_attend and the gradients of the
recomputed attention on the CPU; FlexAttention has no backward there, so its gradients are held here.

    python -m pytest -q tests/gpu/test_training_attention_gpu.py
"""

import pytest
import torch

import draftsmith.heads.layers as layers
from draftsmith.heads import HEADS
from draftsmith.target import FrozenTarget
from draftsmith.testing import tiny_causal_lm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = "cuda"
CONFIGS = {
    "eagle3": dict(depth=4, train_depth=4, draft_vocab_size=96, aux_layer_ids=[1, 2, 3]),
    "dflash": dict(block_size=4, num_layers=1, aux_layer_ids=[1, 2, 3]),
}


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("how", ["flex", "recompute"])
def test_training_attention_gives_attends_loss_and_gradients(monkeypatch, kind, how):
    """A head's loss and every gradient under bf16 autocast, with the training attention `how`,
    against attention kept: recompute equal to float rounding, flex (bf16 inside) to bf16's."""
    torch.manual_seed(0)
    target = FrozenTarget(tiny_causal_lm("llama", vocab_size=128, seed=0).to(DEVICE))
    ids = torch.randint(3, 128, (2, 160), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, 140:] = 0
    cls = HEADS[kind]
    head = cls(cls.config_class(**CONFIGS[kind]), target.dims).to(DEVICE)
    head.init_from_target(target)
    feats = target.features(ids, attention_mask=mask, layers=head.required_layers())

    def run(choice: str):
        monkeypatch.setattr(layers, "TRAINING_ATTENTION", choice)
        monkeypatch.setattr(layers, "_flex_failed", None)  # a failure in an earlier test must not turn flex off here
        head.zero_grad()
        torch.manual_seed(1)  # DFlash draws its anchors
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss, _ = head.loss(feats, mask)
        loss.backward()
        # FlexAttention really ran: a failure would fall back to the recomputed attention quietly
        # (one note on stderr), and this test would compare that path instead.
        assert layers._flex_failed is None, f"FlexAttention failed: {layers._flex_failed}"
        return loss.detach().float(), {n: p.grad.float().clone() for n, p in head.named_parameters() if p.grad is not None}

    ref_loss, ref_grads = run("keep")
    loss, grads = run(how)
    tol = dict(rtol=2e-2, atol=2e-3) if how == "flex" else dict(rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, **tol)
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        scale = ref_grads[name].abs().max().clamp_min(1e-8)
        torch.testing.assert_close(grads[name] / scale, ref_grads[name] / scale, **tol, msg=f"{kind} {how}: {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,P", [(8, 2, 4), (8, 2, 1), (4, 4, 3)])
def test_drafting_attention_on_cuda_is_attend(dtype, H, Hkv, P):
    """attend_cached (drafting's attention: torch's fused kernel, the grouped heads folded into the
    queries) against attend on CUDA, with a mask hiding a random half of the cache (every row sees
    itself): equal to fp32 rounding, or bf16's."""
    g = torch.Generator(device=DEVICE).manual_seed(4)
    S = 70  # not a multiple of the kernel's alignment: the mask is padded inside
    q = torch.randn(1, H, P, 64, generator=g, device=DEVICE)
    k, v = (torch.randn(1, Hkv, S, 64, generator=g, device=DEVICE) for _ in range(2))
    visible = torch.rand(P, S, generator=g, device=DEVICE) > 0.5
    visible[:, S - P :] |= torch.eye(P, dtype=torch.bool, device=DEVICE)
    want = layers.attend(q.double(), k.double(), v.double(), visible.view(1, 1, P, S))
    got = layers.attend_cached(q.to(dtype), k.to(dtype), v.to(dtype), visible)
    assert got.shape == (1, H, P, 64) and got.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)
