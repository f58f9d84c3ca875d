"""Packed linear layers (draftsmith.packed): the same products as F.linear, only inside the context,
following a weight that changes, and out of the way of gradients, other dtypes and other patches."""

import pytest
import torch
from torch import nn

import draftsmith.packed as packed
from draftsmith.packed import packed_linears, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no MKL packed products")


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 24, bias=False))


@pytest.fixture
def products(monkeypatch):
    """Counts the packed products that run."""
    calls = []
    real = packed._packed_product

    def counting(*args):
        calls.append(args[-1])
        return real(*args)

    monkeypatch.setattr(packed, "_packed_product", counting)
    return calls


@pytest.mark.parametrize("threads", [1, 2])
def test_packed_products_match_linear_at_any_row_count(threads, products):
    net = model()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            for rows in range(1, 41):
                x = torch.randn(1, rows, 24)
                want = net(x)
                with packed_linears(net) as count:
                    assert count == 2
                    got = net(x)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)
    # One row stays on F.linear; every other row count ran MKL's packed product in both layers.
    assert sorted(set(products)) == list(range(2, 41)) and len(products) == 2 * 39


def test_only_inside_and_nested_entries_unpack_at_the_outermost_exit(products):
    net = model()
    x = torch.randn(3, 24)
    with torch.no_grad():
        net(x)
        assert not products and "forward" not in net[0].__dict__
        with packed_linears(net):
            with packed_linears(net):
                pass
            assert "forward" in net[0].__dict__
            net(input=x)  # nn.Linear's own keyword works
        assert len(products) == 2
        assert "forward" not in net[0].__dict__ and "forward" not in net[2].__dict__  # the class's forward again
        net(x)
    assert len(products) == 2


def test_a_changed_weight_is_packed_again():
    net = model()
    x = torch.randn(5, 24)
    with torch.no_grad(), packed_linears(net):
        before = net(x)
        net[2].weight.mul_(2.0)  # in place: the version counter moves
        after = net(x)
        net[0].weight = nn.Parameter(torch.randn(40, 24))  # a new tensor: the storage moves
        replaced = net(x)
    torch.testing.assert_close(after, 2 * before, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(replaced, net(x), rtol=1e-5, atol=1e-5)


def test_gradients_take_the_usual_path(products):
    net = model()
    x = torch.randn(4, 24, requires_grad=True)
    with packed_linears(net):
        net(x).sum().backward()
    assert x.grad is not None and net[0].weight.grad is not None
    bias_only = model()
    bias_only[0].weight.requires_grad_(False)
    with packed_linears(bias_only):
        bias_only(torch.randn(4, 24)).sum().backward()  # only the bias trains
    assert bias_only[0].bias.grad is not None
    assert not products


def test_what_is_left_unpacked(monkeypatch):
    with packed_linears(model().to(torch.bfloat16)) as count:
        assert count == 0
    with packed_linears(model(), enabled=False) as count:
        assert count == 0
    zero3 = model()
    zero3[0].weight.ds_id = 7  # how ZeRO-3 marks a parameter it partitions and gathers per forward
    hooked = model()
    own = hooked[2].forward
    hooked[2].forward = own  # an instance forward, as accelerate's hooks set one
    for net in (zero3, hooked):
        with packed_linears(net) as count:
            assert count == 1
    assert hooked[2].__dict__["forward"] is own  # left as it was
    with packed.suspended(), packed_linears(model()) as count:
        assert count == 0
    monkeypatch.setenv("DRAFTSMITH_PACKED_LINEARS", "0")
    with packed_linears(model()) as count:
        assert count == 0


def test_too_little_memory_leaves_the_model_unpacked_and_says_so_once(monkeypatch, capsys):
    net = model()
    monkeypatch.setattr(packed, "_memory_available", lambda: 1000)
    for _ in range(2):
        with packed_linears(net) as count:
            assert count == 0 and "forward" not in net[0].__dict__
    assert capsys.readouterr().err.count("run unpacked") == 1
    monkeypatch.setattr(packed, "_memory_available", lambda: 2**34)
    with packed_linears(net) as count:  # not remembered: with memory, the next entry packs
        assert count == 2


def test_decoding_runs_the_target_packed_and_stays_greedy_identical(products):
    from draftsmith.runtime.drafters import StandaloneDrafter
    from draftsmith.runtime.generate import autoregressive_generate, speculative_generate
    from draftsmith.runtime.tree import TreeSpec
    from draftsmith.target import FrozenTarget
    from draftsmith.testing import tiny_causal_lm

    target = FrozenTarget(tiny_causal_lm("llama", vocab_size=97, hidden_size=32, num_layers=2, seed=3))
    draft = tiny_causal_lm("llama", vocab_size=97, hidden_size=32, num_layers=1, seed=4)
    prompt = torch.tensor([[5, 17, 42, 8]])
    plain, _ = autoregressive_generate(target, prompt, 12, cache="dynamic")
    fast, _ = speculative_generate(target, StandaloneDrafter(draft, TreeSpec.chain(3), cache="dynamic"), prompt, 12, cache="dynamic")
    # The verify forwards (4 rows) ran the target's layers packed; the draft model stays as it is.
    assert 4 in products and "forward" not in draft.lm_head.__dict__
    count = len(products)
    want = target.model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert len(products) == count  # transformers' generate, outside, runs the layers as they are
    assert torch.equal(plain, want) and torch.equal(fast, want)
