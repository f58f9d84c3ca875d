"""Export of a distilled drafter: a plain HF causal-LM folder (LoRA merged, tied embeddings kept) that
the runtime and transformers' assisted generation load directly, both lossless against greedy."""

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from draftsmith.cli import main
from draftsmith.recipe import load_recipe
from draftsmith.testing import save_tiny_model, tiny_tokenizer, write_chats
from draftsmith.trainers import TRAINERS


def tied_draft(folder: Path) -> Path:
    """A one-layer draft whose LM head is tied to its embeddings (as Qwen2.5-0.5B's is)."""
    tokenizer = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=0, eos_token_id=2, bos_token_id=1,
    )
    torch.manual_seed(3)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_export_loads_in_runtime_and_transformers(tmp_path):
    from draftsmith.runtime.drafters import StandaloneDrafter
    from draftsmith.runtime.generate import autoregressive_generate, speculative_generate
    from draftsmith.runtime.tree import TreeSpec
    from draftsmith.target import FrozenTarget

    target_dir = save_tiny_model(tmp_path / "target", "llama", seed=0)
    draft_dir = tied_draft(tmp_path / "draft")
    data = write_chats(tmp_path / "chats.jsonl", n=16, words=3)
    (tmp_path / "r.yaml").write_text(f"""
trainer: distill
output_dir: {tmp_path / 'run'}
target: {{path: {target_dir}}}
draft: {{path: {draft_dir}, lora: {{enabled: true, r: 4, target_modules: [q_proj, v_proj, down_proj]}}}}
data: {{path: {data}, eval_size: 4, max_length: 64}}
train: {{micro_batch_size: 4, max_steps: 3, lr: 0.05, log_every: 1, eval_every: 3, save_every: 3}}
""")
    recipe = load_recipe(tmp_path / "r.yaml")
    trainer = TRAINERS["distill"](recipe, argv=["test"]).setup()
    try:
        trainer.train()
        probe = torch.tensor([[5, 17, 40, 41, 42, 9]])
        where = next(trainer.draft.parameters()).device  # the trainer's device (CUDA where one is visible)
        trained_logits = trainer.draft(input_ids=probe.to(where)).logits.detach().cpu()
    finally:
        trainer.close()

    out = tmp_path / "export"
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert "draftsmith" not in config and config["tie_word_embeddings"] is True
    for name in ("README.md", "recipe.yaml", "metrics.json", "tokenizer.json"):
        assert (out / name).is_file(), name
    assert load_recipe(out / "recipe.yaml").target.path == str(target_dir)

    draft = AutoModelForCausalLM.from_pretrained(out).eval()
    # The export is the trained draft (LoRA merged), not the starting one, and holds nothing else.
    assert torch.allclose(draft(input_ids=probe).logits, trained_logits, atol=1e-5)
    assert not torch.allclose(AutoModelForCausalLM.from_pretrained(draft_dir)(input_ids=probe).logits, trained_logits, atol=1e-3)
    assert draft.num_parameters() == AutoModelForCausalLM.from_pretrained(draft_dir).num_parameters()
    assert not any("lora" in k for k in draft.state_dict())

    target = FrozenTarget.load(str(target_dir))
    prompt = torch.tensor([[1, 60, 61, 62, 63, 64]])
    plain = target.model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
    assisted = target.model.generate(prompt, assistant_model=draft, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(assisted, plain)

    spec_out, _ = speculative_generate(target, StandaloneDrafter(draft, TreeSpec.chain(3)), prompt, 24)
    base_out, _ = autoregressive_generate(target, prompt, 24)
    assert torch.equal(spec_out, base_out) and torch.equal(spec_out, plain)

    # The run folder itself is a drafter as well (`draftsmith eval --drafter RUN`): the trained
    # draft with LoRA merged, drafting for the target its recipe names.
    from draftsmith.runtime.load import load_drafter

    loaded = load_drafter(tmp_path / "run", dtype="float32", device="cpu")
    assert loaded.kind == "standalone" and loaded.target_path == str(target_dir)
    assert torch.allclose(loaded.draft_model(input_ids=probe).logits, trained_logits, atol=1e-5)
    run_out, _ = speculative_generate(loaded.target, loaded.drafter, prompt, 24)
    assert torch.equal(run_out, plain)
