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
    with pytest.raises(IndexError, match="target has 2 decoder layers; layer 5"):
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


def test_hub_id_loads_offline_from_the_local_hub_cache(tiny_qwen2_dir, tmp_path):
    """A hub id resolves from the local Hugging Face cache (HF_HUB_OFFLINE=1), never the network."""
    import shutil
    import subprocess
    import sys

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
    env = {**__import__("os").environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "3 64"
    assert lines[1].startswith("TargetLoadError") and "some-org/not-cached" in lines[1], lines[1]
