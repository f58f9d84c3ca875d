"""Packed linear layers (draftsmith.packed): the same products as F.linear, only inside the context,
following a weight that changes, and out of the way of gradients and other dtypes."""

import pytest
import torch
from torch import nn

from draftsmith.packed import packed_linears, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no MKL packed products")


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 24, bias=False))


@pytest.mark.parametrize("rows", [2, 3, 11, 16, 37])
def test_packed_products_match_linear_and_only_inside(rows):
    net = model()
    x = torch.randn(1, rows, 24)
    with torch.no_grad():
        want = net(x)
        with packed_linears(net) as count:
            assert count == 2
            assert all("forward" in layer.__dict__ for layer in (net[0], net[2]))
            got = net(x)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5) and got.shape == want.shape
    assert not any("forward" in layer.__dict__ for layer in (net[0], net[2]))  # the class's forward again


def test_nested_entries_unpack_at_the_outermost_exit():
    net = model()
    with packed_linears(net):
        with packed_linears(net):
            pass
        assert "forward" in net[0].__dict__
    assert "forward" not in net[0].__dict__


def test_a_changed_weight_is_packed_again():
    net = model()
    x = torch.randn(5, 24)
    with torch.no_grad(), packed_linears(net):
        before = net(x)
        net[2].weight.mul_(2.0)  # in place: the version counter moves
        after = net(x)
        net[0].weight = nn.Parameter(torch.randn(40, 24))  # a new tensor: the storage moves
        replaced = net(x)
    assert torch.allclose(after, 2 * before, atol=1e-5)
    with torch.no_grad():
        assert torch.allclose(replaced, net(x), atol=1e-5)


def test_gradients_and_other_dtypes_take_the_usual_path():
    net = model()
    x = torch.randn(4, 24, requires_grad=True)
    with packed_linears(net):
        net(x).sum().backward()
    assert x.grad is not None and net[0].weight.grad is not None
    half = model().to(torch.bfloat16)
    with packed_linears(half) as count:
        assert count == 0
    with packed_linears(model(), enabled=False) as count:
        assert count == 0


def test_decoding_runs_target_and_drafter_packed_and_stays_greedy_identical():
    from draftsmith.runtime.drafters import StandaloneDrafter
    from draftsmith.runtime.generate import autoregressive_generate, speculative_generate
    from draftsmith.runtime.tree import TreeSpec
    from draftsmith.target import FrozenTarget
    from draftsmith.testing import tiny_causal_lm

    target = FrozenTarget(tiny_causal_lm("llama", vocab_size=97, hidden_size=32, num_layers=2, seed=3))
    draft = tiny_causal_lm("llama", vocab_size=97, hidden_size=32, num_layers=1, seed=4)
    seen = {"target": [], "draft": []}
    for name, lm in (("target", target.model), ("draft", draft)):
        lm.get_output_embeddings().register_forward_pre_hook(lambda module, _inputs, name=name: seen[name].append("forward" in module.__dict__))
    prompt = torch.tensor([[5, 17, 42, 8]])
    plain, _ = autoregressive_generate(target, prompt, 12, cache="dynamic")
    assert seen["target"] and all(seen["target"])  # every LM-head call inside the loop ran from the pack
    seen["target"].clear()
    fast, _ = speculative_generate(target, StandaloneDrafter(draft, TreeSpec.chain(3), cache="dynamic"), prompt, 12, cache="dynamic")
    assert seen["target"] and all(seen["target"]) and seen["draft"] and all(seen["draft"])
    seen["target"].clear()
    want = target.model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert seen["target"] and not any(seen["target"])  # transformers' generate, outside, runs the layers as they are
    assert torch.equal(plain, want) and torch.equal(fast, want)


def test_the_environment_turns_packing_off(monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_PACKED_LINEARS", "0")
    with packed_linears(model()) as count:
        assert count == 0


def test_too_little_memory_leaves_the_model_unpacked_and_says_so(monkeypatch, capsys):
    import draftsmith.packed as packed

    net = model()
    monkeypatch.setattr(packed, "_memory_available", lambda: 1000)
    with packed_linears(net) as count:
        assert count == 0 and "forward" not in net[0].__dict__
    assert "run unpacked" in capsys.readouterr().err
    monkeypatch.setattr(packed, "_memory_available", lambda: 2**34)
    with packed_linears(net) as count:  # not remembered: with memory, the next entry packs
        assert count == 2


def test_weights_deepspeed_partitions_are_left_alone():
    net = model()
    net[0].weight.ds_id = 7  # how ZeRO-3 marks a parameter it partitions and gathers per forward
    with packed_linears(net) as count:
        assert count == 1 and "forward" not in net[0].__dict__ and "forward" in net[2].__dict__
