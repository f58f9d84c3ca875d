"""Export layouts for the serving engines (vLLM, SGLang, speculators): the exact tensor names and
config keys each engine reads, refusals in one line (exit 2, nothing written), and the way back:
folders in those layouts, ours or written by anyone, load into draftsmith with the same logits.
That the engines themselves load them is tests/interop's."""

import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.atomic import MANIFEST_NAME
from draftsmith.export import ExportError, ExportOptions, export, write_head_folder
from draftsmith.heads import HEADS
from draftsmith.target import FrozenTarget
from draftsmith.testing import REPO, load_script, tiny_causal_lm, tiny_tokenizer

V, H, N = len(tiny_tokenizer()), 64, 8


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    tok = tiny_tokenizer()
    model = tiny_causal_lm("llama", vocab_size=len(tok), hidden_size=H, num_layers=N, seed=0)
    folder = tmp_path_factory.mktemp("target") / "tiny"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, FrozenTarget(model, tok, source=str(folder))


def head_folder(target, tmp_path, kind, **cfg):
    """A random head of `kind` saved as a draftsmith export, the source every format starts from."""
    folder, tgt = target
    cls = HEADS[kind]
    torch.manual_seed(0)
    head = cls(cls.config_class(**cfg), tgt.dims)
    head.init_from_target(tgt)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    if kind in ("eagle3", "dflash") and 0 < head.cfg.draft_vocab_size < tgt.dims.vocab_size:
        # A draft vocabulary that is not a prefix of the target's: every 2nd id from 10.
        ids = torch.arange(head.cfg.draft_vocab_size) * 2 + 10
        head.d2t.copy_(ids - torch.arange(head.cfg.draft_vocab_size))
        head.t2d.zero_()
        head.t2d[ids] = True
    dims = tgt.dims
    info = {"path": str(folder), "hidden_size": dims.hidden_size, "vocab_size": dims.vocab_size, "num_layers": dims.num_layers,
            "model_type": "llama", "hf_config": dims.hf_config}  # fmt: skip
    return write_head_folder(head.eval(), info, tmp_path / f"src-{kind}"), head


def same_logits(fixture, head, folder, **load):
    """The folder loaded back through draftsmith's drafter loader computes the head's logits."""
    from draftsmith.runtime.load import load_drafter

    _, tgt = fixture
    loaded = load_drafter(folder, **{"dtype": "float32", "device": "cpu", **load})
    ids = torch.randint(3, V, (1, 12), generator=torch.Generator().manual_seed(1))
    feats = tgt.features(ids, layers=head.required_layers())
    with torch.no_grad():
        want, got = head(feats), loaded.drafter.head(feats)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    torch.testing.assert_close(got[finite], want[finite])
    return loaded


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_eagle3_in_each_engine_layout(target, tmp_path, fmt):
    src, head = head_folder(target, tmp_path, "eagle3", draft_vocab_size=24, aux_layer_ids=[2, 4, 5])
    out = export(src, tmp_path / f"eagle3-{fmt}", fmt, ExportOptions(num_speculative_tokens=3, verifier=str(target[0])))
    tensors = load_file(str(out / "model.safetensors"))
    layer = "layers.0." if fmt == "speculators" else "midlayer."
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t"} | ({"t2d"} if fmt == "speculators" else set()) | {
        layer + n for n in (
            "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
            "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
            "mlp.up_proj.weight", "mlp.down_proj.weight",
        )
    }  # fmt: skip
    assert set(tensors) == expected  # no bias (an engine drops unknown *.bias silently), no embedding
    assert tensors["fc.weight"].shape == (H, 3 * H) and tensors[layer + "self_attn.q_proj.weight"].shape[1] == 2 * H
    assert tensors["lm_head.weight"].shape == (24, H)
    assert (torch.arange(24) + tensors["d2t"]).tolist() == list(range(10, 58, 2))
    if fmt == "speculators":
        assert tensors["t2d"].nonzero().flatten().tolist() == list(range(10, 58, 2))
    config = json.loads((out / "config.json").read_text())
    if fmt == "speculators":
        assert "model_type" not in config and config["speculators_model_type"] == "eagle3"
        assert config["speculators_config"]["verifier"]["name_or_path"] == str(target[0])
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
        layer_config = config["transformer_layer_config"]
        assert config["norm_before_residual"] is False  # written: vLLM's default on this path is true
    else:
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
        layer_config = config
    assert layer_config["num_hidden_layers"] == 1 and layer_config["hidden_act"] == "silu"
    assert layer_config["num_key_value_heads"] == head.cfg.num_key_value_heads and layer_config["tie_word_embeddings"] is False
    assert config["draft_vocab_size"] == 24 and config["target_hidden_size"] == H
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM's convention, at the top level
    assert "eagle_config" not in config  # the default ids (2, N//2, N-3) for N = 8: SGLang's default too
    card = (out / "README.md").read_text()
    assert {"vllm": "vllm serve", "sglang": "--speculative-algorithm EAGLE3", "speculators": "vllm serve <this folder>"}[fmt] in card
    loaded = same_logits(target, head, out)
    assert loaded.kind == "eagle3" and loaded.meta["layout"] == ("speculators" if fmt == "speculators" else "eagle3")


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_an_engine_layout_export_drafts_the_tree_its_run_was_evaluated_with(target, tmp_path, fmt):
    """eval on the run and eval on its export measure the same weights the same way: the export
    carries the sparse tree (before, an engine-layout folder drafted the default tree)."""
    from draftsmith.runtime.load import load_drafter
    from draftsmith.runtime.tree import sparse_tree

    folder, tgt = target
    _, head = head_folder(target, tmp_path, "eagle3", draft_vocab_size=24, aux_layer_ids=[2, 4, 5])
    tree = sparse_tree([[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.1]], 6)
    info = {"path": str(folder), "hidden_size": tgt.dims.hidden_size, "vocab_size": tgt.dims.vocab_size, "num_layers": tgt.dims.num_layers,
            "model_type": "llama", "hf_config": tgt.dims.hf_config}  # fmt: skip
    src = write_head_folder(head, info, tmp_path / "src-with-tree", tree=tree.to_dict())
    out = export(src, tmp_path / f"tree-{fmt}", fmt, ExportOptions(num_speculative_tokens=3, verifier=str(folder)))
    from_run, from_export = load_drafter(src, dtype="float32", device="cpu"), load_drafter(out, dtype="float32", device="cpu")
    assert from_export.drafter.tree.choices == from_run.drafter.tree.choices == tree.spec.choices
    assert from_export.meta["tree"] == from_run.meta["tree"] and from_export.meta["tree"].startswith("stored sparse tree, 6 nodes")


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_eagle31_switches_travel_and_come_back(target, tmp_path, fmt):
    """A head with speculators' default EAGLE-3.1 switches (norm_before_fc, norm_before_residual,
    norm_output) and one with fc_norm: the folder names every switch and holds input_norm /
    fc_norm.{i}; read back, it computes the same logits. SGLang's layout refuses them."""
    for name, switches in (("defaults", {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}), ("fc-norm", {"fc_norm": True})):
        src, head = head_folder(target, tmp_path / name, "eagle3", aux_layer_ids=[2, 4, 5], **switches)
        with torch.no_grad():
            for norm in [getattr(head, "input_norm", None), *getattr(head, "fc_norm", [])]:
                if norm is not None:
                    norm.weight.add_(torch.randn_like(norm.weight) * 0.2)  # a norm ignored on reading would show
        src = write_head_folder(head, json.loads((src / "config.json").read_text())["draftsmith"]["target"], tmp_path / name / "src2")
        out = export(src, tmp_path / name / fmt, fmt, ExportOptions(verifier=str(target[0])))
        config = json.loads((out / "config.json").read_text())
        for key in ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual"):
            assert config[key] is switches.get(key, False), (key, config)
        tensors = load_file(str(out / "model.safetensors"))
        assert ("input_norm.weight" in tensors) == switches.get("norm_before_fc", False)
        assert ("fc_norm.0.weight" in tensors) == switches.get("fc_norm", False)
        same_logits(target, head, out, target=str(target[0]))
        with pytest.raises(ExportError, match="does not carry the EAGLE-3.1 switch"):
            export(src, tmp_path / name / "sglang", "sglang")
    # A switch and its tensor that disagree: one line, as an engine would drop the tensor silently.
    config["fc_norm"] = False
    (out / "config.json").write_text(json.dumps(config))
    (out / MANIFEST_NAME).unlink()
    from draftsmith.artifacts import ArtifactError, open_drafter

    with pytest.raises(ArtifactError, match="fc_norm.0.weight is there but fc_norm is off"):
        open_drafter(out)


def test_both_eagle31_input_norms_go_to_vllm_but_not_to_speculators(target, tmp_path):
    """norm_before_fc with fc_norm: vLLM runs input_norm, then fc_norm per state (what draftsmith
    computes); speculators' config calls the pair mutually exclusive, so that layout refuses it."""
    src, head = head_folder(target, tmp_path, "eagle3", aux_layer_ids=[2, 4, 5], norm_before_fc=True, fc_norm=True)
    with pytest.raises(ExportError, match="speculators refuses head.norm_before_fc together with head.fc_norm"):
        export(src, tmp_path / "speculators", "speculators", ExportOptions(verifier=str(target[0])))
    assert not (tmp_path / "speculators").exists()
    out = export(src, tmp_path / "vllm", "vllm", ExportOptions(verifier=str(target[0])))
    assert {"input_norm.weight", "fc_norm.0.weight"} <= set(load_file(str(out / "model.safetensors")))
    same_logits(target, head, out, target=str(target[0]))


def test_eagle3_with_the_full_vocabulary_has_no_d2t_and_sglang_gets_non_default_ids(target, tmp_path):
    src, head = head_folder(target, tmp_path, "eagle3", aux_layer_ids=[3, 5, 7])
    out = export(src, tmp_path / "full-vllm", "vllm")
    assert "d2t" not in load_file(str(out / "model.safetensors"))  # vLLM refuses d2t when Vd == V
    sgl = export(src, tmp_path / "full-sglang", "sglang")
    assert json.loads((sgl / "config.json").read_text())["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [3, 5, 7]}
    same_logits(target, head, sgl)


def test_eagle1_in_vllm_and_sglang_layouts(target, tmp_path):
    src, head = head_folder(target, tmp_path, "eagle", num_layers=2, fc_bias=False)
    vllm = export(src, tmp_path / "e1-vllm", "vllm")
    names = set(load_file(str(vllm / "model.safetensors")))
    assert "fc.weight" in names and "fc.bias" not in names and "layers.1.input_layernorm.weight" in names
    assert not {"layers.0.input_layernorm.weight", "norm.weight", "lm_head.weight"} & names
    assert json.loads((vllm / "config.json").read_text())["architectures"] == ["EagleLlamaForCausalLM"]
    same_logits(target, head, vllm)
    sglang = export(src, tmp_path / "e1-sglang", "sglang")
    tensors = load_file(str(sglang / "model.safetensors"))
    assert torch.equal(tensors["fc.bias"], torch.zeros(H))  # SGLang's fc always has a bias
    assert json.loads((sglang / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]
    same_logits(target, head, sglang)


def test_medusa_in_vllm_layout(target, tmp_path):
    src, head = head_folder(target, tmp_path, "medusa", num_heads=3, num_layers=2, lm_head="own")
    out = export(src, tmp_path / "medusa-vllm", "vllm")
    tensors = load_file(str(out / "model.safetensors"))
    expected = {f"blocks.{h}.layers.{j}.{p}" for h in range(3) for j in range(2) for p in ("weight", "bias")} | {f"lm_heads.{h}.weight" for h in range(3)}
    assert set(tensors) == expected
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["num_heads"] == 3 and config["num_hidden_layers"] == 2
    assert config["medusa_fc_bias"] is True and config["original_lm_head"] is False
    # Heads sharing the target's LM head carry one copy of it: vLLM's Medusa cannot point at the target's.
    src2, _ = head_folder(target, tmp_path / "b", "medusa", num_heads=2, lm_head="target")
    shared = export(src2, tmp_path / "medusa-shared", "vllm")
    tensors = load_file(str(shared / "model.safetensors"))
    assert torch.equal(tensors["lm_head.weight"], target[1].lm_head_weight())
    assert json.loads((shared / "config.json").read_text())["original_lm_head"] is True
    # And their cards say so, where heads with their own LM heads hold only their weights.
    assert "one copy of the target's LM head" in (shared / "README.md").read_text()
    assert "holds only the head's own weights" in (out / "README.md").read_text()


DFLASH_LAYER = (
    "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)  # fmt: skip


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_dflash_in_each_engine_layout(target, tmp_path, fmt):
    """z-lab's names in every layout (Qwen3 layers, fc, hidden_norm, norm; the target's embedding
    and LM head shared, so absent); vLLM's and SGLang's dflash_config with 0-based layer ids,
    speculators' capture ids and its flag that keeps vLLM bidirectional; read back, the same logits."""
    src, head = head_folder(target, tmp_path, "dflash", num_layers=2, block_size=5, aux_layer_ids=[2, 4, 7])
    out = export(src, tmp_path / f"dflash-{fmt}", fmt, ExportOptions(verifier=str(target[0])))
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{n}" for i in range(2) for n in DFLASH_LAYER}
    Dh = head.cfg.head_dim
    assert tensors["fc.weight"].shape == (H, 3 * H) and tensors["layers.1.self_attn.k_norm.weight"].shape == (Dh,)
    assert not (out / "mask_embedding.pt").exists()
    config = json.loads((out / "config.json").read_text())
    assert "eagle_config" not in config  # vLLM's runner would prefer its ids to dflash_config's
    mask = head.cfg.mask_token_id
    if fmt == "speculators":
        assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashDraftModel"]
        assert config["aux_hidden_state_layer_ids"] == [2, 4, 7] and config["mask_token_id"] == mask and config["block_size"] == 5
        assert config["sliding_window_non_causal"] is True and config["sample_from_anchor"] is False and config["draft_vocab_size"] == V
        assert config["speculators_config"]["algorithm"] == "dflash"
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
        assert config["speculators_config"]["verifier"]["name_or_path"] == str(target[0])
        layer = config["transformer_layer_config"]
    else:
        assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 5 and config["num_target_layers"] == N
        assert config["dflash_config"] == {"mask_token_id": mask, "target_layer_ids": [1, 3, 6], "causal": False}
        assert "draft_vocab_size" not in config
        layer = config
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2 and layer["head_dim"] == Dh and layer["vocab_size"] == V
    assert layer["layer_types"] == ["full_attention"] * 2 and layer["rope_theta"] == head.cfg.rope_theta
    assert layer["tie_word_embeddings"] is False and layer["hidden_act"] == "silu"
    card = (out / "README.md").read_text()
    serve = {"vllm": '"method": "dflash", "model": "<this folder>", "num_speculative_tokens": 4', "sglang": "--speculative-algorithm DFLASH", "speculators": "vllm serve <this folder>"}
    assert serve[fmt] in card
    loaded = same_logits(target, head, out)
    assert loaded.kind == "dflash" and loaded.meta["layout"] == ("speculators" if fmt == "speculators" else "dflash")
    assert loaded.drafter.head.cfg.aux_layer_ids == [2, 4, 7] and loaded.drafter.head.cfg.block_size == 5


def test_dflash_draft_vocabulary_and_mask_vector_in_vllms_layout_only(target, tmp_path):
    src, head = head_folder(target, tmp_path, "dflash", num_layers=1, block_size=3, draft_vocab_size=24, mask_embedding=True, mask_token_id=V - 1)
    out = export(src, tmp_path / "dflash-vocab", "vllm")
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["lm_head.weight"].shape == (24, H) and (torch.arange(24) + tensors["d2t"]).tolist() == list(range(10, 58, 2))
    assert "t2d" not in tensors and "mask_embedding" not in tensors
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 24
    saved = torch.load(out / "mask_embedding.pt", weights_only=True)
    assert saved["mask_token_id"] == V - 1 and torch.equal(saved["embedding"], head.mask_embedding.detach())
    loaded = same_logits(target, head, out)
    assert loaded.drafter.head.cfg.mask_embedding and loaded.drafter.head.cfg.draft_vocab_size == 24
    for fmt, words in (("sglang", "SGLang's DFlash draft has no LM head of its own"), ("speculators", "speculators' DFlash has no learned mask vector")):
        with pytest.raises(ExportError, match=f"--format {fmt} cannot carry this dflash drafter: {words}"):
            export(src, tmp_path / f"no-{fmt}", fmt)
        assert not (tmp_path / f"no-{fmt}").exists()


def test_a_causal_dflash_head_keeps_its_causal_blocks(target, tmp_path):
    src, head = head_folder(target, tmp_path, "dflash", num_layers=1, block_size=4, causal=True)
    vllm = export(src, tmp_path / "causal-vllm", "vllm")
    assert json.loads((vllm / "config.json").read_text())["dflash_config"]["causal"] is True
    spec = export(src, tmp_path / "causal-spec", "speculators")
    config = json.loads((spec / "config.json").read_text())
    layer = config["transformer_layer_config"]
    # speculators makes a layer causal in the block only as a sliding-window layer; its window spans every position.
    assert config["sliding_window_non_causal"] is False and layer["layer_types"] == ["sliding_attention"]
    assert layer["sliding_window"] == layer["max_position_embeddings"]
    for folder in (vllm, spec):
        assert same_logits(target, head, folder).drafter.head.cfg.causal is True
    with pytest.raises(ExportError, match="SGLang's DFlash attends bidirectionally inside the block"):
        export(src, tmp_path / "causal-sglang", "sglang")


def test_a_dflash_head_is_served_with_its_block(target, tmp_path):
    src, _ = head_folder(target, tmp_path, "dflash", num_layers=1, block_size=4)
    with pytest.raises(ExportError, match=r"trained on blocks of 4 .* use --num-speculative-tokens 3 or leave it out"):
        export(src, tmp_path / "k5", "vllm", ExportOptions(num_speculative_tokens=5))
    assert '"num_speculative_tokens": 3' in (export(src, tmp_path / "k3", "vllm", ExportOptions(num_speculative_tokens=3)) / "README.md").read_text()
    with pytest.raises(ExportError, match="whose path contains 'eagle3' as method eagle3"):
        export(src, tmp_path / "my-eagle3-dflash", "vllm")


@pytest.mark.parametrize(
    "kind, cfg, fmt, message",
    [
        ("hydra", {}, "vllm", "vLLM has no drafter of kind hydra"),
        ("hydra", {}, "sglang", "SGLang runs EAGLE-3, EAGLE and DFlash drafters"),
        ("medusa", {}, "speculators", "a medusa drafter has no speculators layout"),
        ("eagle", {"fc_bias": True}, "vllm", "vLLM's EAGLE-1 fc has no bias and drops one without an error"),
        ("eagle3", {"aux_layer_ids": [1, 4, 6]}, "sglang", "start at 1, which SGLang reads as [2, 5, 7] since 2026-05"),
        ("eagle3", {"aux_layer_ids": [2, 4, 6], "norm_before_residual": True}, "sglang", "does not read norm_before_residual"),
        ("eagle3", {"aux_layer_ids": [2, 4, 8]}, "sglang", "auxiliary layer id 8 (the last layer's output) is one SGLang would mis-read"),
    ],
)
def test_a_format_that_cannot_carry_the_drafter_refuses_in_one_line(target, tmp_path, kind, cfg, fmt, message):
    src, _ = head_folder(target, tmp_path, kind, **cfg)
    out = tmp_path / "out"
    with pytest.raises(ExportError, match=f"--format {fmt} cannot carry this {kind} drafter: .*" + re.escape(message)):
        export(src, out, fmt)
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))


def test_clover_exports_in_draftsmith_format_only(target, tmp_path):
    """No engine runs Clover: --format draftsmith writes it and loads back with the same logits; each
    engine layout refuses it in one line (the speculators refusal points nowhere else, since vLLM
    refuses it too) and writes nothing."""
    src, head = head_folder(target, tmp_path, "clover", depth=3)
    native = export(src, tmp_path / "native", "draftsmith")
    assert json.loads((native / "config.json").read_text())["draftsmith"]["head"]["kind"] == "clover"
    loaded = same_logits(target, head, native)
    assert type(loaded.drafter.head).__name__ == "CloverHead"
    for fmt, words in (
        ("vllm", "vLLM has no drafter of kind clover"),
        ("sglang", "SGLang runs EAGLE-3, EAGLE and DFlash drafters (as draft heads), not clover"),
        ("speculators", "a clover drafter has no speculators layout here"),
    ):
        out = tmp_path / f"out-{fmt}"
        with pytest.raises(ExportError) as err:
            export(src, out, fmt)
        message = str(err.value)
        assert message.startswith(f"--format {fmt} cannot carry this clover drafter: ") and words in message, message
        assert "\n" not in message and "--format vllm)" not in message, message
        assert not out.exists()
    assert not list(tmp_path.glob(".tmp-*"))


def test_cli_refusals_exit_2_with_one_line_and_write_nothing(target, tmp_path):
    src, _ = head_folder(target, tmp_path, "hydra")
    empty = tmp_path / "empty"
    empty.mkdir()

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "draftsmith.cli", "export", *map(str, args)], capture_output=True, text=True, cwd=REPO)

    dflash, _ = head_folder(target, tmp_path, "dflash", num_layers=1, block_size=4, draft_vocab_size=24)
    for args, words in (
        ((src, "--format", "vllm", "--out", tmp_path / "a"), "vLLM has no drafter of kind hydra"),
        ((empty, "--format", "vllm", "--out", tmp_path / "b"), "neither a draftsmith checkpoint nor a run folder"),
        ((dflash, "--format", "vllm", "--num-speculative-tokens", "5", "--out", tmp_path / "d"), "trained on blocks of 4"),
        ((dflash, "--format", "sglang", "--out", tmp_path / "e"), "SGLang's DFlash draft has no LM head of its own"),
    ):
        proc = cli(*args)
        errors = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(errors) == 1 and words in errors[0], proc.stderr
    assert not any((tmp_path / name).exists() for name in "abde")
    ok = cli(head_folder(target, tmp_path, "eagle3", aux_layer_ids=[2, 4, 5])[0], "--format", "vllm", "--out", tmp_path / "c")
    assert ok.returncode == 0 and "README.md" in ok.stdout, ok.stderr


def test_a_vllm_path_that_names_another_method_is_refused(target, tmp_path):
    src, _ = head_folder(target, tmp_path, "medusa", num_heads=2, lm_head="own")
    with pytest.raises(ExportError, match="whose path contains 'eagle3' as method eagle3"):
        export(src, tmp_path / "my-eagle3-medusa", "vllm")


# ----------------------------------------------------------------------------- folders written by others


def _specforge_folder(target, tmp_path):
    """An EAGLE-3 draft as SpecForge saves one: midlayer names, a copy of the target's embedding,
    t2d, and auxiliary ids in eagle_config in the older "output of layer L" convention."""
    _, tgt = target
    src, head = head_folder(target, tmp_path, "eagle3", draft_vocab_size=24, aux_layer_ids=[2, 4, 6])
    tensors = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in head.state_dict().items()}
    tensors["embed_tokens.weight"] = tgt.model.get_input_embeddings().weight.detach().clone()
    folder = tmp_path / "specforge"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    cfg = head.cfg
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads, "num_hidden_layers": 1,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "max_position_embeddings": 1024, "vocab_size": V,
        "draft_vocab_size": 24, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]},
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder, head


def test_a_specforge_folder_loads_with_its_older_layer_ids(target, tmp_path):
    folder, head = _specforge_folder(target, tmp_path)
    loaded = same_logits(target, head, folder, target=str(target[0]))
    assert loaded.drafter.head.cfg.aux_layer_ids == [2, 4, 6]  # [1, 3, 5] + 1, as SGLang reads them


def test_a_speculators_folder_names_its_target(target, tmp_path):
    src, head = head_folder(target, tmp_path, "eagle3", aux_layer_ids=[2, 4, 5], norm_before_residual=True)
    out = export(src, tmp_path / "spec", "speculators", ExportOptions(verifier=str(target[0])))
    config = json.loads((out / "config.json").read_text())
    del config["draftsmith_source"]  # as speculators itself writes it: only the verifier names the target
    (out / "config.json").write_text(json.dumps(config))
    (out / MANIFEST_NAME).unlink()  # and without draftsmith's manifest
    loaded = same_logits(target, head, out)
    assert loaded.target_path == str(target[0]) and loaded.drafter.head.cfg.norm_before_residual is True


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda c, t: c.update(draft_vocab_size=30), "lm_head.weight has 24 rows but the config says draft_vocab_size 30"),
        (lambda c, t: t.pop("norm.weight"), "describes a tensor norm.weight that the weights do not hold"),
        (lambda c, t: t.update({"midlayer.extra.weight": torch.zeros(2)}), "tensor layers.0.extra.weight"),
        (lambda c, t: c.update(num_attention_heads=2, num_key_value_heads=2, head_dim=0), "tensor layers.0.self_attn"),
        (lambda c, t: t.update({"embed_tokens.weight": torch.zeros(V, H)}), "carries an embedding that is not the target's"),
    ],
)
def test_a_foreign_folder_whose_config_and_tensors_disagree_fails_in_one_line(target, tmp_path, damage, message):
    from draftsmith.artifacts import ArtifactError
    from draftsmith.runtime.load import load_drafter

    folder, _ = _specforge_folder(target, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    damage(config, tensors)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ArtifactError) as err:
        load_drafter(folder, target=str(target[0]), device="cpu")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_foreign_folder_may_carry_the_targets_embedding_in_bf16(target, tmp_path):
    # speculators 0.9.0 writes its whole checkpoint in bf16, the target's embedding included.
    from draftsmith.artifacts import ArtifactError
    from draftsmith.runtime.load import load_drafter

    # Embedding entries of real models' size (SmolLM2's reach 1.96), where a bf16 rounding is
    # larger than a fixed fp32 tolerance.
    model = tiny_causal_lm("llama", vocab_size=V, hidden_size=H, num_layers=N, seed=0)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(100.0)
    src = tmp_path / "large-embedding"
    model.save_pretrained(src)
    target[1].tokenizer.save_pretrained(src)
    target = (src, FrozenTarget(model, target[1].tokenizer, source=str(src)))
    folder, _ = _specforge_folder(target, tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    embedding = model.get_input_embeddings().weight.detach()
    assert (embedding.to(torch.bfloat16).float() - embedding).abs().max() > 1e-2
    tensors["embed_tokens.weight"] = embedding.to(torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"))
    load_drafter(folder, target=str(target[0]), device="cpu")
    # One bf16 step off in one place is another embedding.
    tensors["embed_tokens.weight"][3, 5] += 0.5
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ArtifactError, match="carries an embedding that is not the target's"):
        load_drafter(folder, target=str(target[0]), device="cpu")


def _speculators_dflash_folder(target, tmp_path):
    """A DFlash draft as speculators 0.9.0 writes one with its trainer's defaults (the config keys
    of a real ``speculators train --speculator-type dflash --dry-run``, scripts/check_speculators_dflash.py):
    sliding-window layers, causal inside the block, no manifest, no draftsmith block."""
    src, head = head_folder(target, tmp_path, "dflash", num_layers=2, block_size=4, aux_layer_ids=[2, 4, 5], causal=True, mask_token_id=V - 1)
    folder = tmp_path / "speculators-written"
    folder.mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in head.state_dict().items()}, str(folder / "model.safetensors"))
    cfg = head.cfg
    layer = {
        "attention_bias": False, "head_dim": cfg.head_dim, "hidden_act": "silu", "hidden_size": H, "intermediate_size": cfg.intermediate_size,
        "layer_types": ["sliding_attention"] * 2, "max_position_embeddings": 4096, "max_window_layers": 28, "model_type": "qwen3",
        "num_attention_heads": cfg.num_attention_heads, "num_hidden_layers": 2, "num_key_value_heads": cfg.num_key_value_heads,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"}, "sliding_window": 2048,
        "tie_word_embeddings": False, "use_sliding_window": True, "vocab_size": V,
    }  # fmt: skip
    config = {
        "architectures": ["DFlashDraftModel"], "auto_map": {"": "config.DFlashSpeculatorConfig"}, "aux_hidden_state_layer_ids": [2, 4, 5],
        "block_size": 4, "draft_vocab_size": V, "dtype": "bfloat16", "mask_token_id": V - 1, "sample_from_anchor": False,
        "sliding_window_non_causal": False, "speculators_model_type": "dflash", "speculators_version": "0.9.0", "target_hidden_size": None,
        "tie_word_embeddings": False, "transformer_layer_config": layer,
        "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy", "proposal_methods": [
            {"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1}],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": str(target[0])}},
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder, head


def test_a_dflash_folder_written_by_speculators_decodes_causal_as_trained(target, tmp_path, capsys):
    from draftsmith.runtime.load import load_drafter

    folder, head = _speculators_dflash_folder(target, tmp_path)
    loaded = load_drafter(folder, dtype="float32", device="cpu")
    assert loaded.target_path == str(target[0]) and loaded.meta["layout"] == "speculators"
    got = loaded.drafter.head
    assert got.cfg.causal is True and got.cfg.aux_layer_ids == [2, 4, 5] and got.cfg.block_size == 4 and got.cfg.num_layers == 2
    assert "sliding window of 2048 is not applied" in capsys.readouterr().err
    ids = torch.randint(3, V, (1, 12), generator=torch.Generator().manual_seed(1))
    feats = target[1].features(ids, layers=head.required_layers())
    with torch.no_grad():
        bf16 = type(head)(head.cfg, head.dims)
        bf16.load_state_dict({k: v.to(torch.bfloat16).float() if v.is_floating_point() else v for k, v in head.state_dict().items()})
        torch.testing.assert_close(got(feats), bf16.eval()(feats))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda c: c.update(sample_from_anchor=True), "sample_from_anchor is set; draftsmith's DFlash head has no such variant"),
        (lambda c: c["transformer_layer_config"].update(layer_types=["sliding_attention", "full_attention"]), "layers mix sliding-window and full attention"),
        (lambda c: c.pop("mask_token_id"), "no mask_token_id"),
        (lambda c: c.update(aux_hidden_state_layer_ids=[2, 4]), "tensor fc.weight has shape"),
    ],
)
def test_a_dflash_folder_draftsmith_cannot_compute_fails_in_one_line(target, tmp_path, damage, message):
    from draftsmith.artifacts import ArtifactError
    from draftsmith.runtime.load import load_drafter

    folder, _ = _speculators_dflash_folder(target, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    damage(config)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError) as err:
        load_drafter(folder, dtype="float32", device="cpu")
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_bench_vllm_refuses_an_out_that_vllm_would_misread_before_exporting_anything(target, tmp_path, capsys, monkeypatch):
    """vLLM picks the method from a draft's path: a DFlash drafter benchmarked under an --out naming
    eagle3 is refused in one line, and no drafter listed before it is exported there first."""
    from draftsmith.cli import script_main

    bench = load_script("scripts/bench_vllm.py")
    monkeypatch.delenv("DRAFTSMITH_DEBUG", raising=False)
    eagle3, _ = head_folder(target, tmp_path, "eagle3")
    dflash, _ = head_folder(target, tmp_path, "dflash", num_layers=1, block_size=4)
    out = tmp_path / "bench-eagle3-against-dflash"
    monkeypatch.setattr(sys, "argv", ["bench_vllm.py", "--drafter", f"e3={eagle3}", "--drafter", f"df={dflash}", "--out", str(out)])
    assert script_main(bench.main) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --drafter df={dflash}") and "contains 'eagle3' as method eagle3" in err and err.count("\n") == 1
    assert not out.exists()


def test_bench_vllm_refuses_more_tokens_than_heads_and_a_missing_venv_before_writing(target, tmp_path, capsys, monkeypatch):
    """--k 5 for a 3-head Medusa is refused before vLLM starts; a good command without a vLLM venv
    is refused before the drafter is exported into --out (the rerun found a folder it refused)."""
    from draftsmith.cli import script_main

    bench = load_script("scripts/bench_vllm.py")
    monkeypatch.delenv("DRAFTSMITH_DEBUG", raising=False)
    monkeypatch.setenv("DRAFTSMITH_VLLM_VENV", str(tmp_path / "no-venv"))
    medusa, _ = head_folder(target, tmp_path, "medusa", num_heads=3, num_layers=1)
    out = tmp_path / "bench"
    for k, words in [("5", [f"--drafter m={medusa}", "3 heads", "--num-speculative-tokens 3"]), ("3", ["no vLLM venv"])]:
        monkeypatch.setattr(sys, "argv", ["bench_vllm.py", "--drafter", f"m={medusa}", "--k", k, "--out", str(out), "--limit", "1"])
        assert script_main(bench.main) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and all(w in err for w in words), err
        assert not out.exists()


def test_medusa_export_refuses_more_tokens_per_step_than_heads(target, tmp_path):
    src, _ = head_folder(target, tmp_path, "medusa", num_heads=3, num_layers=1)
    with pytest.raises(ExportError, match="3 heads"):
        export(src, tmp_path / "m5", "vllm", ExportOptions(num_speculative_tokens=5))
    assert not (tmp_path / "m5").exists()
    out = export(src, tmp_path / "m3", "vllm", ExportOptions(num_speculative_tokens=3))
    assert '"num_speculative_tokens": 3' in (out / "README.md").read_text()


@pytest.mark.parametrize("recorded, named, opened", [
    ("smollm2-135m", None, "smollm2-135m"),  # the verifier is the built-in's Hub id: decode offline with the built-in
    ("smollm2-135m", "someone/other-model", "someone/other-model"),  # a verifier the user named wins
])  # fmt: skip
def test_a_speculators_folder_that_records_a_built_in_target_opens_with_it(target, tmp_path, recorded, named, opened):
    """speculators' config names the verifier by its Hub id; a built-in target recorded beside it
    is the same model, read offline, where the Hub id would be fetched (and fail offline)."""
    from draftsmith.artifacts import open_drafter
    from draftsmith.target import BUILTIN_MODELS

    src, _ = head_folder(target, tmp_path, "eagle3", draft_vocab_size=24, aux_layer_ids=[2, 4, 5])
    config = json.loads((src / "config.json").read_text())
    config["draftsmith"]["target"]["path"] = recorded
    (src / "config.json").write_text(json.dumps(config))
    (src / MANIFEST_NAME).unlink()  # edited on purpose
    out = export(src, tmp_path / "spec", "speculators", ExportOptions(verifier=named))
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
    assert verifier == (named or BUILTIN_MODELS[recorded]["hub_id"])
    assert open_drafter(out).target["path"] == opened


def test_a_draft_model_whose_vocabulary_differs_is_refused_from_the_configs_alone(tmp_path):
    """vLLM's draft_model method needs equal vocab_size in both configs; deciding that reads the
    two config.json files and loads no weights (the loader here fails if it is called)."""
    from draftsmith.artifacts import DraftLMArtifact
    from draftsmith.export import vllm
    from draftsmith.testing import save_tiny_model

    target = save_tiny_model(tmp_path / "target", "llama")
    draft = tmp_path / "draft"
    tiny_causal_lm("llama", vocab_size=len(tiny_tokenizer()) + 24).save_pretrained(draft)

    def no_weights():
        raise AssertionError("a refusal must not load the draft's weights")

    artifact = DraftLMArtifact("standalone", draft, "hf", {"path": str(target)}, loader=no_weights, config_source=(str(draft), None))
    reason = vllm.refusal(artifact, tmp_path / "out", ExportOptions())
    assert reason and f"({len(tiny_tokenizer()) + 24}) to equal the target's ({len(tiny_tokenizer())})" in reason
    same = DraftLMArtifact("standalone", target, "hf", {"path": str(target)}, loader=no_weights, config_source=(str(target), None))
    assert vllm.refusal(same, tmp_path / "out", ExportOptions()) is None


def test_each_format_writes_exactly_the_head_kinds_the_layout_table_holds():
    """What a format says it carries (its refusal's list) and what draftsmith.layouts can write
    for it are one set: a kind added to one and not the other fails here, not in a user's export."""
    from draftsmith.export import sglang, speculators, vllm
    from draftsmith.layouts import WRITERS

    carried = {
        "vllm": set(vllm.METHODS) - {"standalone"},  # a draft LM is an HF folder, not a head layout
        "sglang": set(sglang.ALGORITHMS),
        "speculators": set(speculators.KINDS),
    }
    for fmt, kinds in carried.items():
        assert {k for f, k in WRITERS if f == fmt} == kinds, fmt
    assert {f for f, _ in WRITERS} == set(carried)


@pytest.mark.parametrize("kind, name", [("eagle3", "EAGLE-3"), ("dflash", "DFlash")])
def test_every_engine_format_refuses_a_target_family_without_auxiliary_states(kind, name, tmp_path):
    """EAGLE-3 and DFlash read auxiliary hidden states the engines expose for some families only;
    each format says so in one line, before it looks at the head."""
    from types import SimpleNamespace

    from draftsmith.export import sglang, speculators, vllm

    drafter = SimpleNamespace(kind=kind, target={"model_type": "gpt2"})
    for module, prefix in ((vllm, "vLLM's "), (sglang, ""), (speculators, "")):
        reason = module.refusal(drafter, tmp_path / "out", ExportOptions())
        assert reason.startswith(f"{prefix}{name} reads auxiliary hidden states from llama, ") and reason.endswith("this target is gpt2"), module.NAME
