"""The LayerSkip trainer on tiny random models: the early-exit loss makes early exits predict
better than training the last layer alone does; layer dropout skips layers per sample (the skipped
row's residual passes through) and never in evaluation; checkpoints record "early_exit" and
resume exactly; LoRA checkpoints hold the adapter; the export is a plain HF causal LM that
transformers' generate(assistant_early_exit=E) runs token-identical to greedy decoding with our
acceptance; eval and the exit-layer sweep; bad input in one line with exit 2 and nothing written."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.recipe import RecipeError
from draftsmith.runs import list_checkpoints, read_state
from draftsmith.testing import cli, logged, run_trainer, save_tiny_model, tiny_tokenizer, write_chats, write_recipe

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("layerskip-model") / "target", "llama", num_layers=LAYERS)


def make_recipe(tmp_path: Path, model_dir: Path, name: str, *overrides: str):
    data = write_chats(tmp_path / "chats.jsonl", words=3)
    text = f"""
trainer: layerskip
output_dir: {tmp_path / name}
target: {{path: {model_dir}}}
data: {{path: {data}, eval_size: 8, max_length: 64, seed: 1}}
layerskip: {{layer_dropout: {{max_rate: 0.2}}, early_exit: {{scale: 1.0, curriculum: rotational, rotation: 2}}}}
train: {{micro_batch_size: 4, max_steps: 24, lr: 0.003, warmup_steps: 2, log_every: 1, eval_every: 24, save_every: 8}}
"""
    return write_recipe(tmp_path / f"{name}.yaml", text, *overrides)


def evals(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, model_dir):
    """A full fine-tune with the early-exit loss, and the same run with the last layer's loss only."""
    tmp = tmp_path_factory.mktemp("layerskip-runs")
    runs = {}
    for name, scale in (("exits", "1.0"), ("last", "0.0")):
        recipe = make_recipe(tmp, model_dir, name, f"layerskip.early_exit.scale={scale}")
        runs[name] = (recipe, *run_trainer(recipe))
    return tmp, runs


def test_early_exit_loss_trains_the_early_exits(trained):
    tmp, runs = trained
    with_exits, last_only = evals(tmp / "exits"), evals(tmp / "last")
    assert [e["step"] for e in with_exits] == [0, 24]
    first, end = with_exits
    # Every exit predicts the answers better than before, and the model itself too.
    assert all(b < a for a, b in zip(first["exit_loss"], end["exit_loss"])), (first["exit_loss"], end["exit_loss"])
    assert end["full_loss"] < 0.7 * first["full_loss"]
    # Training the last layer alone leaves the early exit behind (exit 2; exit 1, the first layer's
    # output, has loss weight e(0) = 0 and trains only through the deeper exits).
    other = last_only[-1]
    assert end["exit_loss"][1] < other["exit_loss"][1] - 0.1, (end["exit_loss"], other["exit_loss"])
    assert end["exit_expected_acceptance"][1] > other["exit_expected_acceptance"][1] + 0.05
    losses = logged(tmp / "exits")
    assert sum(losses[s] for s in range(21, 25)) < 0.6 * sum(losses[s] for s in range(1, 5)), losses
    # The rotational curriculum (every 2nd exit) plus the model's own output, layers counted from 1;
    # exit 1 carries no weight, so it is not computed.
    exits = logged(tmp / "exits", key="exits")
    assert exits[1] == [2, 4] and exits[2] == [3, 4] and exits[3] == [2, 4]


def test_the_model_itself_trains_and_checkpoints_record_early_exit(trained):
    tmp, runs = trained
    recipe, trainer, summary, before = runs["exits"]
    after = trainer.lm.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before if "layers.1." in k)
    ckpt = list_checkpoints(tmp / "exits")[-1]
    state = read_state(ckpt)
    assert state["drafter"] == {"kind": "early_exit"} and state["trainer"] == "layerskip"
    weights = load_file(str(ckpt / "model.safetensors"))
    assert {f"model.{k}" for k in after} == set(weights)
    assert summary["best_exit"] in range(1, LAYERS) and summary["eval_exits"] == [1, 2, 3] and len(summary["exit_expected_acceptance"]) == 3


def test_layer_dropout_skips_layers_per_sample_and_never_in_eval(model_dir):
    from draftsmith.target import load_causal_lm
    from draftsmith.trainers.layerskip import LayerSkipStep

    model, _ = load_causal_lm(str(model_dir), "float32")
    step = LayerSkipStep(model).train()
    ids = torch.randint(4, 90, (2, 10), generator=torch.Generator().manual_seed(0))
    attention, select = torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool)
    last = LAYERS - 1

    def final(drop):
        return step(ids, attention, None, select, [last], drop=drop, unembed=False)[0].view(2, 10, -1)

    drop = torch.zeros(2, LAYERS, dtype=torch.bool)
    drop[0, 1:] = True  # row 0 skips every layer after the first; row 1 skips nothing
    dropped, plain = final(drop), final(None)
    stack = step.stack
    with torch.no_grad():
        hidden = stack.embed(ids[:1])
        only_first = stack.norm(stack.run(hidden, 0, 1, torch.arange(10).unsqueeze(0)))
    torch.testing.assert_close(dropped[0], only_first[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dropped[1], plain[1])
    assert not torch.allclose(dropped[0], plain[0])
    # A layer every row skips gets no gradient; the others do.
    drop = torch.zeros(2, LAYERS, dtype=torch.bool)
    drop[:, 2] = True
    final(drop).sum().backward()
    grads = {i: stack.layers[i].mlp.down_proj.weight.grad for i in range(LAYERS)}
    assert torch.count_nonzero(grads[2]) == 0 and all(torch.count_nonzero(grads[i]) > 0 for i in (0, 1, 3))
    # Never in evaluation.
    step.eval()
    with torch.no_grad():
        torch.testing.assert_close(final(torch.ones(2, LAYERS, dtype=torch.bool)), plain.detach())


def test_resume_reproduces_the_uninterrupted_run(tmp_path, model_dir):
    full, *_ = run_trainer(make_recipe(tmp_path, model_dir, "full", "train.max_steps=10", "train.save_every=5", "train.eval_every=10"))
    reference = logged(tmp_path / "full")
    recipe = make_recipe(tmp_path, model_dir, "resumed", "train.max_steps=10", "train.save_every=5", "train.eval_every=10")
    run_trainer(recipe, interrupt_at=6)
    assert list_checkpoints(tmp_path / "resumed")[-1].name == "step-000006"
    run_trainer(recipe)
    resumed = logged(tmp_path / "resumed")
    assert sorted(resumed) == sorted(reference)
    for step in reference:
        assert resumed[step] == pytest.approx(reference[step], rel=1e-5, abs=1e-6), step


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [{"prompt": "say red cat sun"}, {"prompt": "say dog moon tree"}, {"prompt": "say blue green"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_lora_checkpoint_holds_the_adapter_and_exports_merged(tmp_path, model_dir):
    from transformers import AutoModelForCausalLM

    from draftsmith.export import export

    recipe = make_recipe(
        tmp_path, model_dir, "lora", "layerskip.lora.enabled=true", "layerskip.lora.r=4", "layerskip.exit_layer=2",
        "train.max_steps=6", "train.save_every=6", "train.eval_every=6", "train.lr=0.01",
    )
    trainer, _, before = run_trainer(recipe)
    weights = load_file(str(list_checkpoints(tmp_path / "lora")[-1] / "model.safetensors"))
    assert weights and all("lora_" in k for k in weights)
    out = export(tmp_path / "lora", tmp_path / "lora-export")
    again = export(out, tmp_path / "again")  # an export exports again, card and all
    assert (again / "README.md").read_text() == (out / "README.md").read_text()
    assert json.loads((again / "config.json").read_text())["layerskip"] == json.loads((out / "config.json").read_text())["layerskip"]
    config = json.loads((out / "config.json").read_text())
    assert config["layerskip"]["exit_layer"] == 2 and "layerskip.exit_layer in the recipe" in config["layerskip"]["chosen_by"]
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in k for k in merged.state_dict())
    # The merged weights are the base plus the trained adapters: what the peft model computes.
    ids = torch.tensor([[5, 9, 14, 3, 22, 7]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, trainer.lm(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
        base = AutoModelForCausalLM.from_pretrained(model_dir)
        assert not torch.allclose(merged(ids).logits, base(ids).logits, atol=1e-4)


def test_export_runs_in_transformers_assistant_early_exit_like_our_runtime(trained, prompts, tmp_path):
    """transformers' generate(assistant_early_exit=E) on the export is token-identical to its plain
    greedy decoding, and its tokens per verification forward (drafting the same chain) are within
    5% of our runtime's mean accepted length: the same drafts, judged by the same model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.data.chat import encode_prompt
    from draftsmith.export import export
    from draftsmith.runtime.generate import speculative_generate
    from draftsmith.runtime.load import load_drafter

    tmp, runs = trained
    # The run trained with the last layer's loss only: its early exits agree with it partly.
    out = export(tmp / "last", tmp_path / "export")
    E = json.loads((out / "config.json").read_text())["layerskip"]["exit_layer"]
    assert (out / "README.md").read_text().count(f"assistant_early_exit={E}") == 1
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    config = model.generation_config
    config.num_assistant_tokens, config.num_assistant_tokens_schedule, config.assistant_confidence_threshold = 3, "constant", 0.0
    loaded = load_drafter(out, exit_layer=1, tree="1,1,1", dtype="float32", device="cpu")
    assert loaded.cache == "auto"  # the dynamic cache on the CPU, the static one (CUDA graphs) on a GPU
    on_static = load_drafter(out, exit_layer=1, tree="1,1,1", dtype="float32", device="cpu", cache="static")
    assert on_static.cache == "static"
    counted = {"full": 0}
    model.register_forward_pre_hook(lambda m, *_: counted.__setitem__("full", counted["full"] + (m.config.num_hidden_layers == LAYERS)))
    ours_tokens = ours_steps = hf_tokens = 0
    accepted = 0
    for row in map(json.loads, prompts.read_text().splitlines()):
        ids = torch.tensor([encode_prompt(tokenizer, [{"role": "user", "content": row["prompt"]}])])
        kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=30, eos_token_id=2, pad_token_id=0)
        with torch.no_grad():
            plain = model.generate(ids, **kwargs)
            before = counted["full"]
            assisted = model.generate(ids, assistant_early_exit=1, **kwargs)
        hf_forwards = counted["full"] - before
        ours, stats = speculative_generate(loaded.target, loaded.drafter, ids, 30, eos_token_id=2, cache=loaded.cache)
        static, static_stats = speculative_generate(on_static.target, on_static.drafter, ids, 30, eos_token_id=2, cache=on_static.cache)
        assert assisted.tolist() == plain.tolist() == ours.tolist() == static.tolist()
        assert static_stats.accept_lens == stats.accept_lens
        ours_tokens += stats.new_tokens
        ours_steps += stats.steps
        hf_tokens += (assisted.shape[1] - ids.shape[1]) / hf_forwards * stats.steps
        accepted += sum(stats.accept_lens)
    assert 0 < accepted < 3 * ours_steps  # partial acceptance: the comparison means something
    assert hf_tokens / ours_steps == pytest.approx(ours_tokens / ours_steps, rel=0.05)


def test_eval_cli_and_the_exit_layer_sweep(trained, prompts, tmp_path, model_dir):
    from draftsmith.export import export

    tmp, _ = trained
    proc = cli("eval", "--drafter", tmp / "last", "--exit-layer", 2, "--prompts", prompts, "--max-new-tokens", 16, "--out", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["drafter_kind"] == "early_exit" and report["exit_layer"] == 2
    assert report["greedy_identical_to_baseline"] == "3/3" and report["assisted_tokens_per_target_forward"] > 1
    out = export(tmp / "last", tmp_path / "export")
    proc = cli("eval", "--drafter", out, "--exit-layer", "sweep", "--prompts", prompts, "--max-new-tokens", 12, "--no-assisted", "--out", tmp_path / "sweep")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "sweep" / "report.json").read_text())
    rows = report["exit_sweep"]
    assert [r["exit_layer"] for r in rows] == [1, 2, 3]
    best = max(rows, key=lambda r: r["speedup"])["exit_layer"]
    assert report["exit_layer"] == best and report["greedy_identical_to_baseline"] == "3/3"
    recorded = json.loads((out / "config.json").read_text())["layerskip"]
    assert recorded["exit_layer"] == best and recorded["chosen_by"].startswith("eval --exit-layer sweep: best measured speedup over plain decoding among exits 1..3")
    # The sweep's rows are a table of their own in report.md, a row an exit.
    markdown = (tmp_path / "sweep" / "report.md").read_text()
    assert "## exit_sweep" in markdown and "| exit_layer | mean_accepted_length |" in markdown and "{'exit_layer'" not in markdown
    card = (out / "README.md").read_text()
    assert f"Exit layer: {best} of {LAYERS} (eval --exit-layer sweep" in card
    # The prose and the transformers snippet follow the choice too.
    assert f"drafts with its first {best} layers" in card and f"assistant_early_exit={best}," in card
    assert card.count("assistant_early_exit=") == 1
    # An untrained model drafts for itself too (the baseline of LayerSkip training).
    proc = cli("generate", "--drafter", model_dir, "--exit-layer", 1, "--prompt", "say red cat", "--max-new-tokens", 8)
    assert proc.returncode == 0 and "[early_exit drafter, exit layer 1, chain of 4; on " in proc.stderr and "verification: exact" in proc.stderr, proc.stderr[-2000:]
    # An exit layer the model does not have: one line, exit 2, no report.
    proc = cli("eval", "--drafter", out, "--exit-layer", LAYERS, "--prompts", prompts, "--out", tmp_path / "bad")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == f"error: exit layer {LAYERS} is outside 1..{LAYERS - 1}: the model has {LAYERS} decoder layers"
    assert not (tmp_path / "bad").exists()


def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, model_dir, capsys):
    from draftsmith.cli import main

    make_recipe(tmp_path, model_dir, "base")
    recipe = tmp_path / "base.yaml"
    gpt2 = tmp_path / "gpt2"
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=len(tiny_tokenizer()), n_embd=32, n_layer=2, n_head=2, n_positions=128, bos_token_id=1, eos_token_id=2)
    GPT2LMHeadModel(config).save_pretrained(gpt2)
    tiny_tokenizer().save_pretrained(gpt2)
    capsys.readouterr()
    cases = {
        "layerskip.exit_layer=4": f"recipe key 'layerskip.exit_layer' must be in 1..3 ({model_dir} has 4 decoder layers), got 4",
        "layerskip.exit_layer=0": "recipe key 'layerskip.exit_layer' must be in 1..L-1 (L = the model's decoder layers), got 0",
        "layerskip.layer_dropout.max_rate=1.0": "recipe key 'layerskip.layer_dropout.max_rate' must be in [0, 1), got 1.0",
        "layerskip.layer_dropout.max_rate=-0.1": "recipe key 'layerskip.layer_dropout.max_rate' must be in [0, 1), got -0.1",
        f"trainer=distill draft.path={model_dir}": "recipe section 'layerskip' is read by trainer 'layerskip', not by this recipe's trainer 'distill'; remove it",
        f"target.path={gpt2}": f"recipe key 'target.path' ({gpt2}): GPT2LMHeadModel (model_type gpt2): its decoder layers cannot be skipped",
    }
    for override, message in cases.items():
        assert main(["train", str(recipe), *override.split()]) == 2, override
        err = capsys.readouterr().err
        # One error line, the last (checks that need the model run after it loads, which logs).
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(f"error: {message}"), (override, err)
        assert err.strip().splitlines()[-1] == errors[0] and "Traceback" not in err
        assert not (tmp_path / "base").exists(), override
    with pytest.raises(RecipeError, match="rotation"):
        make_recipe(tmp_path, model_dir, "bad", "layerskip.early_exit.rotation=0")
    with pytest.raises(RecipeError, match=r"layerskip.early_exit.scale' must be in \[0, 1\]"):
        make_recipe(tmp_path, model_dir, "bad", "layerskip.early_exit.scale=1.5")
    # ZeRO-3 partitions the model being trained anyway; loading it partitioned is not offered.
    with pytest.raises(RecipeError, match="deepspeed.shard_target"):
        make_recipe(tmp_path, model_dir, "bad", "deepspeed.zero_stage=3", "deepspeed.shard_target=true")


def test_export_cli_writes_the_native_folder_and_every_engine_format_refuses(trained, tmp_path, capsys):
    """`draftsmith export` on a layerskip run: --format draftsmith writes the plain HF folder with its
    exit layer; vllm, sglang and speculators have no early-exit method and refuse in one line, exit 2,
    writing nothing."""
    from draftsmith.cli import main

    tmp, runs = trained
    out = tmp_path / "native"
    assert main(["export", str(tmp / "exits"), "--out", str(out)]) == 0
    block = json.loads((out / "config.json").read_text())["layerskip"]
    assert block["exit_layer"] in range(1, LAYERS) and block["num_layers"] == LAYERS
    capsys.readouterr()
    for fmt in ("vllm", "sglang", "speculators"):
        target = tmp_path / fmt
        assert main(["export", str(tmp / "exits"), "--format", fmt, "--out", str(target)]) == 2, fmt
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: --format {fmt} cannot carry this early_exit drafter: {fmt} has no self-speculative (early-exit) method; "
                       "--format draftsmith writes a plain HF causal LM that transformers (assistant_early_exit) and draftsmith decode with"], err
        assert not target.exists()
