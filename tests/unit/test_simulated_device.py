"""SimulatedDevice: the CPU split into a host and a pretend device, so a CPU test fails where a GPU
run would meet tensors on two devices. What CUDA refuses it refuses; what CUDA allows it allows."""

import pytest
import torch

from draftsmith.data.collate import Batch, Collator
from draftsmith.testing import DeviceMismatch, SimulatedDevice
from draftsmith.trainers.distill import predicted_mask

DEVICE = torch.device("cpu")  # what accelerator.device is on a CPU machine


def batch() -> Batch:
    return Collator(pad_token_id=0, max_length=16)([{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [5, 6], "loss_mask": [0, 1]}])


def test_the_distill_trainers_cuda_crash_fails_here_too():
    """trainers/distill.py at 3ef29d1 built the loss mask from a moved loss_mask and the batch's
    segment_ids left on the host: "Expected all tensors to be on the same device" on an H200."""
    with SimulatedDevice():
        host = batch()
        with pytest.raises(DeviceMismatch, match=r"host \(2, 2\) with one on the device \(2, 2\)"):
            predicted_mask(host["loss_mask"].to(DEVICE), host["segment_ids"])
        moved = host.to(DEVICE)
        assert predicted_mask(moved["loss_mask"], moved["segment_ids"]).tolist() == [[True, True], [True, False]]


def test_a_model_and_its_inputs_must_stand_on_one_place():
    with SimulatedDevice() as guard:
        model = torch.nn.Linear(4, 3)
        x = torch.ones(2, 4)
        model(x)  # both on the host: fine, as on a GPU machine's CPU
        with pytest.raises(DeviceMismatch, match="linear"):
            model(x.to(DEVICE))  # the model was never moved
        model.to(DEVICE)
        with pytest.raises(DeviceMismatch, match="linear"):
            model(x)  # the input was never moved
        assert model(x.to(DEVICE)).shape == (2, 3) and guard.place(model.weight) == guard.DEVICE
    assert guard.checked > 0


def test_what_cuda_allows_is_allowed():
    with SimulatedDevice() as guard:
        on_device = torch.arange(6.0).to(DEVICE)
        host_index = torch.tensor([0, 2])
        assert on_device[host_index].tolist() == [0.0, 2.0]  # host index tensors into a device tensor
        assert (on_device * torch.tensor(2.0)).sum().item() == 30.0  # 0-dim host tensors
        host = torch.zeros(6)
        host.copy_(on_device)  # copies cross devices
        host[1:3] = on_device[:2]  # so does assignment into a slice
        like = torch.ones(3, device=on_device.device)  # device=x.device follows x
        assert guard.place(like) == guard.DEVICE and guard.place(torch.ones(3, device=host.device)) == guard.HOST
        assert guard.place(torch.nn.Parameter(on_device.clone())) == guard.DEVICE  # a parameter follows its data


def test_what_cuda_refuses_is_refused():
    with SimulatedDevice():
        on_device = torch.arange(6.0).to(DEVICE)
        with pytest.raises(DeviceMismatch):
            torch.cat([on_device, torch.zeros(2)])
        with pytest.raises(DeviceMismatch):
            torch.zeros(6)[torch.tensor([1, 2]).to(DEVICE)]  # a device index into a host tensor
        with pytest.raises(DeviceMismatch, match="numpy"):
            on_device.numpy()
        assert on_device.cpu().numpy().shape == (6,)
        with pytest.raises(DeviceMismatch):
            torch.arange(6) + on_device  # a factory without device= makes host tensors
        mask = torch.tensor([True, False, True, False, True, False]).to(DEVICE)
        with pytest.raises(DeviceMismatch):
            on_device[mask] = torch.tensor([7.0, 8.0, 9.0])  # index_put_ with a host value
        on_device[mask] = torch.tensor(7.0)  # a 0-dim value is fine


def test_parameters_are_restored_after_the_block():
    new = torch.nn.Parameter.__new__
    with SimulatedDevice():
        assert torch.nn.Parameter.__new__ is not new
    assert torch.nn.Parameter.__new__ is new


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_decoding_takes_a_prompt_from_the_host_and_answers_there(cache):
    """speculative_generate / autoregressive_generate run on the target's device whatever device
    the prompt is on, and return on the prompt's: a user's CPU ids with a model on a GPU. The
    static cache builds its masks, slots and positions on the device too."""
    from draftsmith.runtime.drafters import StandaloneDrafter
    from draftsmith.runtime.generate import autoregressive_generate, speculative_generate
    from draftsmith.runtime.tree import TreeSpec
    from draftsmith.target import FrozenTarget
    from draftsmith.testing import tiny_causal_lm, tiny_tokenizer

    with SimulatedDevice() as guard:
        target = FrozenTarget(tiny_causal_lm("llama", seed=0).to(DEVICE), tiny_tokenizer())
        drafter = StandaloneDrafter(tiny_causal_lm("llama", hidden_size=32, num_layers=1, seed=1).to(DEVICE), TreeSpec.chain(3))
        prompt = torch.tensor([[5, 9, 14, 20]])
        spec, _ = speculative_generate(target, drafter, prompt, 12, cache=cache)
        plain, _ = autoregressive_generate(target, prompt, 12, cache=cache)
        assert guard.place(spec) == guard.place(plain) == guard.HOST
        assert spec.shape == (1, 16) and torch.equal(spec, plain)


def test_reads_of_the_device_are_listed_and_host_ones_are_not():
    """Every operation that hands a device value to the host (a host sync on a GPU) is listed, in
    order, with its name; the same operations on host tensors, and device work that stays on the
    device, are not."""
    with SimulatedDevice() as guard:
        host = torch.tensor([1.0, 0.0, 3.0])
        host.tolist(), host.sum().item(), bool(host.any()), host[host > 0]
        assert guard.reads == []
        dev = host.to(DEVICE)
        kept = (dev * 2).cumsum(0)  # stays on the device
        kept.topk(2)
        assert guard.reads == []
        dev.tolist()
        dev.sum().item()
        bool(dev.any())
        int(dev.argmax())
        dev[dev > 0]
        dev.nonzero()
        dev.to("cpu")
        dev.cpu()
    assert [r.split(" at ")[0] for r in guard.reads] == ["tolist", "item", "__bool__", "__int__", "__getitem__", "nonzero", "to", "cpu"]
