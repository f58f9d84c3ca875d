"""The contract every registered draft head keeps (heads/base.py), checked for each kind in HEADS.

A new head registered in draftsmith.heads gets all of these without writing a test:
- its parameters are distinct tensors, none of them shared with the target, and a loss reaches
  the head alone;
- the teacher-forced training forward computes exactly what the runtime drafter computes when it
  drafts the same tokens (every depth of a chain);
- speculative greedy decoding with it is token-identical to the target's own greedy generate();
- packed rows (the packing collator's 4D mask) give the loss and logits of the same examples padded;
- an export round-trips: the loaded head has the same weights and logits, and no target tensor.

VARIANTS adds configurations worth covering beyond a kind's defaults.
"""

import pytest
import torch

from draftsmith.data import Collator, block_causal_mask
from draftsmith.artifacts import open_drafter
from draftsmith.export import write_head_folder
from draftsmith.heads import HEADS
from draftsmith.runtime.drafters import DraftState, HeadDrafter
from draftsmith.runtime.generate import speculative_generate
from draftsmith.runtime.tree import TreeSpec, default_tree
from draftsmith.target import FrozenTarget
from draftsmith.testing import tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, HIDDEN, LAYERS = 48, 32, 3
VARIANTS = {
    "medusa": [{"lm_head": "own", "num_layers": 2}, {"lm_head": "target"}],
    # Hydra++ (the defaults), plain Hydra, and the reference README's teacher-only loss.
    "hydra": [{}, {"prefix_attention": False, "lm_head": "target", "num_layers": 1, "teacher_weight": 0.0, "input_noise": 0.0}, {"token_weight": 0.0}],
    "eagle": [{"num_layers": 2, "train_depth": 2}, {"teacher": False}],
    # Clover-2 (two augmenting layers, the root token fused first, FC outputs) and Clover-1's
    # architecture (one layer, the root token read by the regressive decoder, residual blocks).
    "clover": [{"depth": 3}, {"depth": 3, "num_layers": 1, "token_first": False, "output": "residual", "teacher": False, "regression_weight": 0.0}],
    # A 3-layer target has no default auxiliary layers; a reduced draft vocabulary exercises d2t.
    "eagle3": [
        {"aux_layer_ids": [1, 2, 3], "draft_vocab_size": 32, "depth": 4, "train_depth": 3},
        {"aux_layer_ids": [3, 1, 2], "norm_before_residual": True},
        # EAGLE-3.1, as speculators' trainer writes it by default, and the per-state fc_norm.
        {"aux_layer_ids": [1, 2, 3], "norm_before_fc": True, "norm_before_residual": True, "norm_output": True},
        {"aux_layer_ids": [1, 2, 3], "fc_norm": True, "norm_output": True},
    ],
    # DFlash: bidirectional blocks over the target's LM head; a learned mask vector with a draft
    # vocabulary (d2t); speculators' causal blocks with the mask token chosen from the target.
    "dflash": [
        {"aux_layer_ids": [1, 2, 3], "block_size": 4, "num_layers": 2, "mask_token_id": 47},
        {"aux_layer_ids": [1, 3], "block_size": 3, "num_layers": 1, "mask_token_id": 5, "mask_embedding": True, "draft_vocab_size": 32, "loss_weighting": "exp"},
        {"aux_layer_ids": [2], "block_size": 5, "num_layers": 1, "causal": True, "loss_weighting": "uniform"},
    ],
}
CASES = [(kind, extra) for kind in HEADS for extra in VARIANTS.get(kind, [{}])]
IDS = [f"{kind}-{'-'.join(f'{k}={v}' for k, v in extra.items()) or 'defaults'}" for kind, extra in CASES]


@pytest.fixture(scope="module")
def target():
    return FrozenTarget(tiny_causal_lm("llama", vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, seed=0))


def assert_close_scaled(got, want, rel=1e-5, msg=""):
    """Equal up to fp32 rounding relative to the row's scale: a random head's logits grow with depth
    (to ~1e3), and an element near zero in such a row carries the row's rounding, not its own."""
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), f"{msg}: -inf (tokens outside a draft vocabulary) in other places"
    got, want = got.masked_fill(~finite, 0.0), want.masked_fill(~finite, 0.0)
    scale = want.abs().amax(-1, keepdim=True).clamp_min(1.0)
    worst = ((got - want).abs() / scale).max()
    assert worst <= rel, f"{msg}: differs by {float(worst):.2e} of the row scale"


def random_head(target, kind, extra, seed=1):
    """A head of `kind` with every parameter perturbed away from its start, so every path matters."""
    cls = HEADS[kind]
    torch.manual_seed(seed)
    head = cls(cls.config_class(**extra), target.dims)
    head.init_from_target(target)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return head.eval()


def recorded_drafting(head, target, prefix, depth):
    """Draft a greedy chain of `depth` after `prefix` with the runtime drafter, recording the logits
    every expand returned. Returns (chain tokens [depth], logits per depth [depth, V])."""
    drafter = HeadDrafter(head, target, TreeSpec.chain(depth))
    drafter.reset(prefix)
    t = prefix.shape[1] - 2  # the last position the target has cached; prefix[t + 1] is the root
    feats = target.features(prefix, layers=head.required_layers())
    recorded = []
    session = drafter.session
    expand = session.expand
    session.expand = lambda frontier: recorded.append(expand(frontier)) or recorded[-1]
    tree = drafter.propose(
        DraftState(
            tokens=prefix,
            new_hidden=feats.final_hidden[:, : t + 1],
            new_layers={i: h[:, : t + 1] for i, h in feats.hidden.items()},
        )
    )
    assert tree.tokens.shape[1] == depth + 1
    levels = session.level_logits()
    if levels is not None:  # Medusa, DFlash: the chain drafted on the device from the level logits, no expand
        assert not recorded
        return tree.tokens[0, 1:], levels[:depth]
    assert len(recorded) == depth
    return tree.tokens[0, 1:], torch.stack([r[0] for r in recorded])


@pytest.mark.parametrize("kind,extra", CASES, ids=IDS)
def test_parameters_are_the_heads_own(target, kind, extra):
    head = random_head(target, kind, extra).train()
    storages = [p.untyped_storage().data_ptr() for p in head.parameters()]
    assert len(storages) == len(set(storages)), "two parameters share one tensor"
    target_storages = {p.untyped_storage().data_ptr() for p in target.model.parameters()}
    assert not target_storages & set(storages), "a target tensor is a head parameter"
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    loss, stats = head.loss(target.features(ids, layers=head.required_layers()), torch.ones_like(ids))
    loss.backward()
    assert torch.isfinite(loss) and stats["count"].sum() > 0
    assert all(p.grad is not None for p in head.parameters() if p.requires_grad)
    assert all(p.grad is None for p in target.model.parameters())


@pytest.mark.parametrize("kind,extra", CASES, ids=IDS)
def test_a_head_leaves_the_config_it_is_handed_as_it_was(target, kind, extra):
    """A recipe's head: section stays as written (an EAGLE-3 or DFlash head resolves its layers and
    vocabulary for the target on its own copy)."""
    import copy

    cfg = HEADS[kind].config_class(**extra)
    before = copy.deepcopy(cfg)
    head = HEADS[kind](cfg, target.dims)
    assert cfg == before and head.cfg is not None


@pytest.mark.parametrize("kind,extra", CASES, ids=IDS)
def test_training_forward_equals_runtime_drafting(target, kind, extra):
    """Run the training forward on prefix + the drafted chain: its depth-k logits at the prefix's
    last cached position are exactly what the drafter computed for depth k."""
    head = random_head(target, kind, extra)
    depth = min(head.depth, 3)
    prefix = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    chain, drafted = recorded_drafting(head, target, prefix, depth)
    # The chain is the greedy one: each drafted token is the argmax of the depth before it.
    assert chain.tolist() == drafted.argmax(-1).tolist()
    full = torch.cat([prefix, chain.unsqueeze(0)], dim=1)
    with torch.no_grad():
        logits = head(target.features(full, layers=head.required_layers()))  # [1,T,K,V]
    t = prefix.shape[1] - 2
    for k in range(depth):
        assert_close_scaled(logits[0, t, k], drafted[k], msg=f"depth {k + 1}")


@pytest.mark.parametrize("kind,extra", CASES, ids=IDS)
def test_greedy_speculative_equals_target_generate(target, kind, extra):
    head = random_head(target, kind, extra)
    drafter = HeadDrafter(head, target, default_tree(min(head.depth, 3), (3, 2, 1)))
    for seed in range(3):
        prompt = torch.randint(3, VOCAB, (1, 5 + seed), generator=torch.Generator().manual_seed(10 + seed))
        reference = target.model.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=16, pad_token_id=0, eos_token_id=None
        )
        out, _ = speculative_generate(target, drafter, prompt, 16)
        assert out.tolist() == reference.tolist(), f"prompt seed {seed}"


@pytest.fixture(scope="module")
def target64():
    return FrozenTarget(tiny_causal_lm("llama", vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, seed=0, dtype=torch.float64))


@pytest.mark.parametrize("kind,extra", CASES, ids=IDS)
def test_packed_rows_give_the_padded_results(target64, kind, extra):
    """Two examples packed into one row (block-diagonal 4D mask, positions restarting) give the same
    loss and, away from the seam, the same logits as the two padded in a batch. In float64: a random
    head amplifies fp32 rounding of the two batch shapes, while a leak across the seam would not vanish."""
    target = target64
    head = random_head(target, kind, extra).double()
    gen = torch.Generator().manual_seed(7)
    examples = [
        {"input_ids": torch.randint(3, VOCAB, (n,), generator=gen).tolist(), "loss_mask": [0] * 3 + [1] * (n - 3)} for n in (11, 9)
    ]
    layers = head.required_layers()

    def run(batch):
        feats = target.features(batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"], layers=layers)
        with torch.no_grad():
            loss, stats = head.loss(feats, batch["loss_mask"], batch["segment_ids"])
            return loss, stats, head(feats)

    packed = Collator(pad_token_id=0, max_length=64, packing=True)(examples)
    # The collator's additive mask is float32; SDPA misreads it under a float64 query.
    packed["attention_mask"] = block_causal_mask(packed["segment_ids"], dtype=torch.float64)
    padded = Collator(pad_token_id=0, max_length=64)(examples)
    assert packed["input_ids"].shape[0] == 1 and packed["attention_mask"].dim() == 4
    loss_p, stats_p, logits_p = run(packed)
    loss_q, stats_q, logits_q = run(padded)
    torch.testing.assert_close(stats_p["count"], stats_q["count"])
    torch.testing.assert_close(loss_p, loss_q, atol=1e-9, rtol=1e-9)
    # Logits at position t of depth k read the tokens up to t + k: compare where those stay inside the example.
    K = logits_p.shape[2]
    for k in range(K):
        n0, n1 = (len(e["input_ids"]) for e in examples)
        assert_close_scaled(logits_p[0, : n0 - k - 1, k], logits_q[0, : n0 - k - 1, k], rel=1e-10, msg=f"example 1, depth {k + 1}")
        assert_close_scaled(logits_p[0, n0 : n0 + n1 - k - 1, k], logits_q[1, : n1 - k - 1, k], rel=1e-10, msg=f"example 2, depth {k + 1}")


@pytest.mark.parametrize("kind,extra", CASES, ids=IDS)
def test_export_round_trip_holds_the_head_and_nothing_of_the_target(target, kind, extra, tmp_path):
    head = random_head(target, kind, extra)
    dims = target.dims
    info = {"path": "tiny", "hidden_size": dims.hidden_size, "vocab_size": dims.vocab_size, "num_layers": dims.num_layers, "hf_config": dims.hf_config}
    folder = write_head_folder(head, info, tmp_path / "export")
    loaded = open_drafter(folder).head
    assert type(loaded) is type(head) and loaded.cfg == head.cfg
    mine, theirs = head.state_dict(), loaded.state_dict()
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    ids = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(9))
    feats = target.features(ids, layers=head.required_layers())
    with torch.no_grad():
        torch.testing.assert_close(loaded(feats), head(feats))
    for value in theirs.values():
        assert not any(value.shape == t.shape and torch.equal(value, t) for t in target.model.state_dict().values())
