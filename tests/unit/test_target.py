"""FrozenTarget: hooks index decoder layers like HF's output_hidden_states, and nothing trains."""

import pytest
import torch

from draftsmith.target import FrozenTarget, TargetLoadError, decoder_layers
from draftsmith.testing import tiny_causal_lm


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hooks_match_output_hidden_states(arch):
    model = tiny_causal_lm(arch, num_layers=3)
    target = FrozenTarget(model)
    ids = torch.randint(0, 100, (2, 11))
    feats = target.features(ids, layers=[0, 1, 2, -1])
    ref = model(ids, output_hidden_states=True)
    # Layer i is HF's hidden_states[i + 1] for every layer but the last ...
    for i in (0, 1):
        torch.testing.assert_close(feats.hidden[i], ref.hidden_states[i + 1])
    # ... whose HF entry is after the final norm (the known trap): ours is before it.
    assert not torch.allclose(feats.hidden[2], ref.hidden_states[3])
    torch.testing.assert_close(model.model.norm(feats.hidden[2]), ref.hidden_states[3])
    torch.testing.assert_close(feats.final_hidden, ref.hidden_states[3])
    torch.testing.assert_close(feats.logits, ref.logits)
    torch.testing.assert_close(feats.hidden[2], feats.hidden[-1 % 3])
    torch.testing.assert_close(feats.lm_head(feats.final_hidden), ref.logits)
    torch.testing.assert_close(feats.embed(ids), model.model.embed_tokens(ids))


def test_target_is_frozen_and_hooks_removed():
    model = tiny_causal_lm("llama")
    target = FrozenTarget(model)
    assert not any(p.requires_grad for p in model.parameters())
    target.features(torch.randint(0, 100, (1, 5)), layers=[0, 1])
    assert all(not layer._forward_hooks for layer in target.layers)


def test_bad_layer_index():
    target = FrozenTarget(tiny_causal_lm("llama", num_layers=2))
    with pytest.raises(IndexError, match="has 2 decoder layers; layer 5 does not exist"):
        target.features(torch.zeros(1, 3, dtype=torch.long), layers=[5])


def test_model_without_decoder_layers_is_refused():
    class NotADecoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(2, 2)

    with pytest.raises(TargetLoadError, match="NotADecoder has no list of decoder layers"):
        decoder_layers(NotADecoder())


def test_load_from_folder_and_bad_paths(tiny_qwen2_dir, tmp_path):
    target = FrozenTarget.load(str(tiny_qwen2_dir))
    assert target.dims.num_layers == 3 and target.dims.hidden_size == 64
    assert target.tokenizer.chat_template
    with pytest.raises(TargetLoadError, match="GGUF file not found"):
        FrozenTarget.load(str(tmp_path / "missing.gguf"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    with pytest.raises(TargetLoadError, match="broken.gguf"):
        FrozenTarget.load(str(broken))
    with pytest.raises(TargetLoadError, match="model folder not found"):
        FrozenTarget.load(str(tmp_path / "nowhere") + "/")


@pytest.mark.parametrize("hub_offline", ["1", None], ids=["HF_HUB_OFFLINE=1", "HF_HUB_OFFLINE unset"])
def test_hub_id_loads_offline_from_the_local_hub_cache(tiny_qwen2_dir, tmp_path, hub_offline):
    """A hub id resolves from the local Hugging Face cache, never the network, whether or not the
    environment says offline (unset, an unreachable hub was tried with retries for about a minute):
    a model the cache lacks is refused at once, saying where draftsmith looked and what else works."""
    import os
    import shutil
    import subprocess
    import sys
    import time

    commit = "0" * 40
    repo = tmp_path / "hub" / "models--some-org--tiny-qwen2"
    shutil.copytree(tiny_qwen2_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    code = (
        "from draftsmith.target import FrozenTarget\n"
        "t = FrozenTarget.load('some-org/tiny-qwen2')\n"
        "print(t.dims.num_layers, t.dims.hidden_size)\n"
        "try:\n"
        "    FrozenTarget.load('some-org/not-cached')\n"
        "except Exception as err:\n"
        "    print(type(err).__name__, err)\n"
    )
    env = {key: value for key, value in os.environ.items() if key not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update({"HF_HUB_CACHE": str(tmp_path / "hub")}, **({"HF_HUB_OFFLINE": hub_offline} if hub_offline else {}))
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "3 64"
    assert lines[1].startswith("TargetNotFoundError") and "some-org/not-cached" in lines[1], lines[1]
    assert "local HF cache" in lines[1] and "smollm2-135m" in lines[1], lines[1]
    assert time.monotonic() - started < 20  # no network retries (about 5 s here: the interpreter and torch start in it; 29 s with them)


def test_capture_on_a_model_that_trains_lets_gradients_through():
    """LayerSkip's early-exit losses read captured layers of a model that trains: a loss on a
    captured layer's output reaches the parameters of that layer and those below it, not above."""
    from draftsmith.target import capture_layers

    model = tiny_causal_lm("llama", num_layers=3).train()
    ids = torch.randint(0, 100, (2, 7))
    with capture_layers(model, [1]) as captured:
        model(ids)
    captured[1].pow(2).mean().backward()
    layers = decoder_layers(model)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layers[0].parameters())
    assert all(p.grad is not None for p in layers[1].parameters())
    assert all(p.grad is None for p in layers[2].parameters())
    assert model.model.embed_tokens.weight.grad is not None
    assert all(not layer._forward_hooks for layer in layers)


def test_dtype_auto_follows_the_machine_and_says_why(monkeypatch, capsys):
    import draftsmith.target as t

    monkeypatch.delenv("DRAFTSMITH_AUTO_DTYPE")
    monkeypatch.setattr(t.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(t, "_cpu_flags", lambda: {"avx2", "fma"})
    assert t.auto_dtype("cpu") == ("float32", f"this CPU has no native bf16 ({torch.backends.cpu.get_cpu_capability()}; no avx512_bf16 or amx_bf16 in /proc/cpuinfo)")
    monkeypatch.setattr(t, "_cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert t.auto_dtype() == ("bfloat16", "this CPU computes bf16 natively (avx512_bf16)")
    monkeypatch.setattr(t, "_ANNOUNCED", set())
    assert t.resolve_dtype("auto", "target") == "bfloat16" and t.resolve_dtype("float16") == "float16"
    assert "dtype auto: target in bfloat16 (this CPU computes bf16 natively (avx512_bf16))" in capsys.readouterr().err
    monkeypatch.setenv("DRAFTSMITH_AUTO_DTYPE", "float32")
    assert t.auto_dtype() == ("float32", "DRAFTSMITH_AUTO_DTYPE says so")
    monkeypatch.setenv("DRAFTSMITH_AUTO_DTYPE", "fp8")
    with pytest.raises(TargetLoadError, match="DRAFTSMITH_AUTO_DTYPE='fp8'"):
        t.auto_dtype()


def test_mixed_precision_auto_is_bf16_only_where_native(monkeypatch):
    from draftsmith.trainers.engine import resolve_mixed_precision

    monkeypatch.setenv("DRAFTSMITH_AUTO_DTYPE", "bfloat16")
    assert resolve_mixed_precision("auto") == "bf16"
    monkeypatch.setenv("DRAFTSMITH_AUTO_DTYPE", "float32")
    assert resolve_mixed_precision("auto") == "no" and resolve_mixed_precision("fp16") == "fp16"


@pytest.mark.slow
def test_a_float32_load_after_a_bfloat16_load_gives_the_ggufs_float32_logits(tmp_path, monkeypatch):
    """The dequantized cache holds the GGUF's values in full precision, whichever load wrote it:
    a bf16 load first (which fills the cache), then an fp32 load from the cache, equals loading the
    GGUF itself in fp32."""
    from transformers import AutoModelForCausalLM

    from draftsmith.target import builtin_gguf, load_causal_lm

    pytest.importorskip("gguf")
    try:
        gguf = builtin_gguf("smollm2-135m")
    except TargetLoadError as err:
        pytest.skip(str(err))
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    bf16, _ = load_causal_lm("smollm2-135m", "bfloat16")
    assert bf16.dtype == torch.bfloat16
    assert list((tmp_path / "cache" / "models").iterdir()), "the first load writes the cache"
    fp32, _ = load_causal_lm("smollm2-135m", "float32")
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    ids = torch.tensor([[1, 504, 3459, 314, 253, 1789, 30, 2]])
    with torch.no_grad():
        assert torch.equal(fp32(ids).logits, direct(ids).logits)
        assert not torch.equal(bf16(ids).logits.float(), direct(ids).logits)  # the bf16 model is rounded


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_eager_and_sdpa_honour_the_tree_mask_and_load(attention, tiny_qwen2_dir):
    """The two accepted implementations take a custom 4D mask: masking out a key changes the output
    exactly as dropping that key does. Loading from a folder with each works."""
    model = tiny_causal_lm("llama", num_layers=2)
    model.set_attn_implementation(attention)
    target = FrozenTarget(model)
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    # Positions 3..5 may not see position 2 (a sibling branch): the same as the sequence without
    # token 2, positions kept.
    mask = torch.zeros(1, 1, 6, 6)
    mask.masked_fill_(~torch.ones(6, 6, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
    mask[0, 0, 3:, 2] = torch.finfo(torch.float32).min
    masked = target.model(ids, attention_mask=mask).logits[0, 5]
    kept = [0, 1, 3, 4, 5]
    dropped = target.model(ids[:, kept], position_ids=torch.tensor([kept])).logits[0, -1]
    torch.testing.assert_close(masked, dropped, atol=1e-5, rtol=1e-5)
    from transformers import AutoModelForCausalLM

    FrozenTarget(AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, attn_implementation=attention))


@pytest.mark.parametrize("attention", ["flash_attention_2", "flex_attention", None])
def test_other_attention_implementations_are_refused_in_one_line(attention):
    from draftsmith.runtime.drafters import StandaloneDrafter

    model = tiny_causal_lm("llama", num_layers=1)
    model.config._attn_implementation = attention  # as a model loaded that way reports it
    for build, who in ((FrozenTarget, "target"), (StandaloneDrafter, "draft")):
        with pytest.raises(TargetLoadError) as err:
            build(model)
        message = str(err.value)
        assert "\n" not in message and repr(attention) in message and f"the {who}'s attention" in message
        assert "attn_implementation='sdpa' or 'eager'" in message


def fake_cuda(monkeypatch, t, bf16: bool = True):
    """A machine that reports one CUDA device (nothing is ever placed on it): Hopper with native
    bf16, or a Volta that only emulates it (is_bf16_supported() says True there too)."""
    monkeypatch.setattr(t.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(t.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(t.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(t.torch.cuda, "get_device_name", lambda device=None: "Fake H200" if bf16 else "Fake V100")
    monkeypatch.setattr(t.torch.cuda, "get_device_capability", lambda device=None: (9, 0) if bf16 else (7, 0))
    monkeypatch.setattr(t.torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)


def test_device_auto_is_cuda_when_visible_and_the_dtype_asks_the_device_the_model_runs_on(monkeypatch):
    import draftsmith.target as t

    monkeypatch.delenv("DRAFTSMITH_AUTO_DTYPE")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(t.torch.cuda, "is_available", lambda: False)
    assert t.resolve_device("auto")[0] == torch.device("cpu")
    fake_cuda(monkeypatch, t)
    device, why = t.resolve_device("auto")
    assert device == torch.device("cuda", 0) and "Fake H200" in why
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert t.resolve_device("cuda")[0] == torch.device("cuda", 0)
    assert t.auto_dtype("cuda:0") == ("bfloat16", "CUDA device Fake H200 computes bf16 natively (compute capability 9.0)")
    # A model kept on the CPU of a GPU machine runs in what that CPU computes natively, not in bf16
    # because CUDA exists (the old rule picked bf16 there: about 50x slower on an AVX2 CPU).
    monkeypatch.setattr(t, "_cpu_flags", lambda: {"avx2"})
    assert t.auto_dtype("cpu")[0] == "float32" and t.resolve_dtype("auto", "target", "cpu") == "float32"
    assert t.auto_dtype()[0] == "bfloat16"  # no device given: the one `auto` picks, CUDA here
    fake_cuda(monkeypatch, t, bf16=False)
    assert t.auto_dtype("cuda") == ("float32", "CUDA device Fake V100 has no native bf16 (compute capability 7.0)")


@pytest.mark.parametrize(
    "name, message",
    [("cuda", "no CUDA device is visible"), ("cuda:0", "no CUDA device is visible"), ("tpu", "expected auto, cpu, cuda or cuda:N"), ("mps", "draftsmith runs on auto, cpu, cuda or cuda:N"), ("gpu!", "expected auto, cpu, cuda or cuda:N")],
)
def test_a_device_that_is_not_here_is_one_clear_error(monkeypatch, name, message):
    import draftsmith.target as t

    monkeypatch.setattr(t.torch.cuda, "is_available", lambda: False)
    with pytest.raises(t.DeviceError, match=message.replace("(", r"\(")):
        t.resolve_device(name)


def test_a_cuda_index_past_the_visible_devices_is_refused(monkeypatch):
    import draftsmith.target as t

    fake_cuda(monkeypatch, t)
    with pytest.raises(t.DeviceError, match="only 1 CUDA device"):
        t.resolve_device("cuda:3")


def test_load_causal_lm_puts_the_model_on_the_device_in_its_dtype(tiny_llama_dir, monkeypatch):
    import draftsmith.target as t

    model, _ = t.load_causal_lm(str(tiny_llama_dir), "bfloat16", device=torch.device("cpu"))
    assert {p.device.type for p in model.parameters()} == {"cpu"} and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    target = t.FrozenTarget.load(str(tiny_llama_dir), "float32", device="cpu")
    assert target.device == torch.device("cpu") and target.dtype == torch.float32


def test_lora_wrapping_says_nothing_the_user_cannot_act_on():
    """peft reads transformers' deprecated is_gradient_checkpointing: that FutureWarning is not shown."""
    import warnings
    from types import SimpleNamespace

    from draftsmith.target import with_lora

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model = with_lora(tiny_causal_lm("llama", seed=0), SimpleNamespace(enabled=True, r=2, alpha=4, dropout=0.0, target_modules=["q_proj"]))
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) > 0


def test_saving_tied_weights_does_not_ask_the_user_to_check_the_reload(caplog):
    """accelerate's "Removed shared tensor ... check by verifying" at every save of a tied LM head is
    dropped once draftsmith's checkpoints are in use (its loader reties them); other warnings pass."""
    import importlib
    import logging

    from accelerate import PartialState
    from accelerate.utils.other import clean_state_dict_for_safetensors

    importlib.import_module("draftsmith.trainers.checkpoint")  # installs the filter
    PartialState(cpu=True)  # accelerate's logger needs its state, as in a trainer

    shared = torch.ones(4)
    with caplog.at_level(logging.WARNING):
        kept = clean_state_dict_for_safetensors({"embed.weight": shared, "lm_head.weight": shared})
        logging.getLogger("accelerate.utils.other").warning("something else")
    assert list(kept) == ["embed.weight"]
    assert [r.getMessage() for r in caplog.records] == ["something else"]
