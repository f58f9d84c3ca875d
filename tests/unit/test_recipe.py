"""Recipes load strictly: typos, wrong types and missing values fail at load time, naming the key."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.recipe import RecipeError, all_recipe_files, engine_fragments, load_recipe, recipe_to_yaml

REPO = Path(__file__).resolve().parents[2]

BASE = """\
trainer: heads
output_dir: {out}
target: {{path: some/model}}
data: {{path: data.jsonl}}
head: {{kind: medusa, num_heads: 3}}
"""


@pytest.fixture
def recipe_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(BASE.format(out=tmp_path / "run"))
    return path


def test_every_recipe_in_the_repo_loads():
    files = all_recipe_files(REPO / "recipes")
    assert files, "no recipes found under recipes/"
    for path in files:
        recipe = load_recipe(path)
        assert recipe.output_dir
    # Engine fragments load merged after a recipe whose trainer runs under DeepSpeed.
    fragments = engine_fragments(REPO / "recipes")
    assert fragments, "no engine fragments found under recipes/deepspeed"
    for fragment in fragments:
        assert load_recipe(REPO / "recipes/medusa/smollm2-135m.yaml", fragment).deepspeed.zero_stage in (1, 2, 3)


def test_yaml_files_merge_in_order_then_overrides(recipe_file, tmp_path):
    extra = tmp_path / "extra.yaml"
    extra.write_text("train: {lr: 0.5, max_steps: 7}\nhead: {num_layers: 2}\n")
    recipe = load_recipe(recipe_file, extra, overrides=["train.lr=0.25", "head.lm_head=own"])
    assert recipe.train.lr == 0.25  # the override beats the later file
    assert recipe.train.max_steps == 7  # the later file beats the schema default
    assert recipe.head.num_heads == 3 and recipe.head.num_layers == 2 and recipe.head.lm_head == "own"
    assert type(recipe.head).__name__ == "MedusaConfig"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.lrr=1", "unknown recipe key 'train.lrr' (did you mean 'train.lr'?)"),
        ("data.regenerate.enabld=true", "'data.regenerate.enabld' (did you mean 'data.regenerate.enabled'?)"),
        ("head.num_head=2", "'head.num_head' (did you mean 'head.num_heads'?)"),
        ("head.kind=medusaa", "unknown draft head 'medusaa' (did you mean 'medusa'?)"),
        ("trainer=head", "unknown trainer 'head' (did you mean 'heads'?)"),
        ("train.lr=fast", "recipe key 'train.lr'"),
        ("train.mixed_precision=fp8", "recipe key 'train.mixed_precision'"),
        ("train.micro_batch_size=0", "'train.micro_batch_size' must be positive"),
        ("outputdir=x", "did you mean 'output_dir'"),
        ("train.max_steps=[1,2]", "recipe key 'train.max_steps': Value '[1, 2]' (a list) could not be converted to Integer"),
    ],
)
def test_bad_values_name_the_key(recipe_file, override, expected):
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe_file, overrides=[override])
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_required_value_names_the_key(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("trainer: heads\ntarget: {path: m}\ndata: {path: d}\nhead: {kind: medusa}\n")
    with pytest.raises(RecipeError, match="recipe key 'output_dir': is missing: every recipe sets it"):
        load_recipe(path)


def test_head_section_required_for_head_trainer(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("trainer: heads\noutput_dir: o\ntarget: {path: m}\ndata: {path: d}\n")
    with pytest.raises(RecipeError, match="recipe key 'head' is missing"):
        load_recipe(path)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(RecipeError, match="cannot parse recipe file"):
        load_recipe(bad)
    # What went wrong and where, not only YAML's context line.
    for text, said in [
        ("trainer: heads\ntrainer: distill\n", "found duplicate key trainer at line 2, column 1"),
        ("trainer: heads\n  bad: x: y\n", "mapping values are not allowed in this context at line 2, column 6"),
    ]:
        bad.write_text(text)
        with pytest.raises(RecipeError, match=f"cannot parse recipe file .*bad.yaml: {said}"):
            load_recipe(bad)


def test_resolved_recipe_round_trips(recipe_file, tmp_path):
    recipe = load_recipe(recipe_file, overrides=["train.lr=0.125"])
    saved = tmp_path / "resolved.yaml"
    saved.write_text(recipe_to_yaml(recipe))
    assert load_recipe(saved) == recipe


def _cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "draftsmith.cli", *args], cwd=cwd, capture_output=True, text=True)


def test_cli_typo_is_one_line_exit_2_no_traceback(recipe_file):
    proc = _cli("train", str(recipe_file), "train.lrr=1")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["error: unknown recipe key 'train.lrr' (did you mean 'train.lr'?); valid keys here: "
                     + lines[0].split("valid keys here: ")[1]]


def test_cli_validate_and_ls():
    proc = _cli("validate")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok    recipes/medusa/smollm2-135m.yaml" in proc.stdout
    assert "ok    recipes/deepspeed/zero3.yaml  (engine fragment, merged after" in proc.stdout
    proc = _cli("ls")
    assert proc.returncode == 0, proc.stderr
    assert "medusa" in proc.stdout and "heads" in proc.stdout and "smollm2-135m.yaml" in proc.stdout
    # Away from a clone there are no recipes: ls says where it looked and how to point it elsewhere.
    proc = _cli("ls", "--root", "no-such-folder")
    assert proc.returncode == 0 and "recipes:  none under no-such-folder/" in proc.stdout and "--root" in proc.stdout, proc.stdout
    version = _cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"draftsmith {__import__('draftsmith').__version__}"


def test_validate_reports_a_fragment_that_breaks_a_recipe(tmp_path):
    (tmp_path / "medusa").mkdir()
    (tmp_path / "medusa" / "r.yaml").write_text(BASE.format(out=tmp_path / "run"))
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "bad.yaml").write_text("deepspeed: {zero_stage: 2, offload_param: cpu}\n")
    proc = _cli("validate", "--root", str(tmp_path))
    assert proc.returncode == 2
    assert f"FAIL  {tmp_path / 'deepspeed' / 'bad.yaml'}: merged after {tmp_path / 'medusa' / 'r.yaml'}: recipe key 'deepspeed.offload_param' needs" in proc.stdout


def test_override_values_may_name_yaml_files():
    from draftsmith.cli import _split_recipe_args

    paths, overrides = _split_recipe_args(["a.yaml", "runs/x=1/b.yaml", "data.path=chats.yaml", "train.lr=0.1"])
    assert paths == ["a.yaml", "runs/x=1/b.yaml"]
    assert overrides == ["data.path=chats.yaml", "train.lr=0.1"]


def test_trainer_sections_exist_only_for_the_trainers_that_read_them(recipe_file, tmp_path):
    recipe = load_recipe(recipe_file)
    assert recipe.draft is None and recipe.distill is None and recipe.online is None
    with pytest.raises(RecipeError, match="recipe section 'distill' is read by trainer 'distill' or 'online', not by this recipe's trainer 'heads'; remove it"):
        load_recipe(recipe_file, overrides=["distill.divergence=rkl"])
    with pytest.raises(RecipeError, match="recipe section 'online' is read by trainer 'online'"):
        load_recipe(recipe_file, overrides=["online.update_every=2"])
    # A trainer that reads a section gets it typed and checked, defaults filling an absent one.
    distill = tmp_path / "d.yaml"
    distill.write_text(f"trainer: distill\noutput_dir: {tmp_path / 'run'}\ntarget: {{path: t}}\ndata: {{path: d}}\ndraft: {{path: small}}\n")
    recipe = load_recipe(distill)
    assert recipe.head is None and recipe.distill.divergence == "fkl" and recipe.online is None
    with pytest.raises(RecipeError, match="recipe section 'head' is read by trainer 'heads'"):
        load_recipe(distill, overrides=["head.kind=medusa"])
    with pytest.raises(RecipeError, match="recipe key 'draft' is missing: trainer 'distill' trains a draft LM"):
        load_recipe(distill, overrides=["draft=null"])
    assert load_recipe(distill, overrides=["trainer=online"]).online.update_every == 4


def test_range_checks_name_the_section_key(recipe_file):
    cases = {
        "data.regenerate.top_p=1.5": "recipe key 'data.regenerate.top_p' must be in (0, 1], got 1.5",
        "data.features.top_k_logits=-1": "recipe key 'data.features.top_k_logits' must be >= 0",
        "train.min_lr_ratio=2": "recipe key 'train.min_lr_ratio' must be in [0, 1], got 2",
        "head.num_heads=0": "recipe key 'head.num_heads' must be >= 1, got 0",
        "deepspeed.zero_stage=4": "recipe key 'deepspeed.zero_stage' must be 0, 1, 2 or 3, got 4",
        "train.global_batch_size=6": "'train.global_batch_size'=6 is not a multiple of train.micro_batch_size=4",
        "train.tree_nodes=-1": "recipe key 'train.tree_nodes' must be >= 0, got -1",
    }
    for override, message in cases.items():
        with pytest.raises(RecipeError) as err:
            load_recipe(recipe_file, overrides=[override])
        assert message in str(err.value), (override, str(err.value))


def test_dtypes_default_to_auto(recipe_file):
    recipe = load_recipe(recipe_file)
    assert recipe.target.dtype == "auto" and recipe.data.features.dtype == "auto" and recipe.train.mixed_precision == "auto"
    assert load_recipe(recipe_file, overrides=["target.dtype=float32"]).target.dtype == "float32"
    with pytest.raises(RecipeError, match="recipe key 'target.dtype'"):
        load_recipe(recipe_file, overrides=["target.dtype=fp32"])


def test_yaml_booleans_go_back_to_the_words_a_choice_spells(tmp_path):
    """YAML 1.1 reads `no` as False: `train.mixed_precision=no` (and `mixed_precision: no` in a file)
    must still mean the choice "no", not fail on a boolean."""
    from draftsmith.recipe import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text("trainer: heads\noutput_dir: out\ntarget: {path: t}\ndata: {path: d.jsonl}\nhead: {kind: medusa}\ntrain: {mixed_precision: no}\n")
    assert load_recipe(path).train.mixed_precision == "no"
    assert load_recipe(path, overrides=["train.mixed_precision=bf16"]).train.mixed_precision == "bf16"
    assert load_recipe(path, overrides=["train.mixed_precision=no"]).train.mixed_precision == "no"


def test_an_engine_fragment_alone_says_what_it_is_for():
    with pytest.raises(RecipeError, match=r"recipes/deepspeed/zero2.yaml is an engine fragment, merged after a recipe: draftsmith train RECIPE.yaml recipes/deepspeed/zero2.yaml"):
        load_recipe("recipes/deepspeed/zero2.yaml")
    assert load_recipe("recipes/medusa/smollm2-135m.yaml", "recipes/deepspeed/zero2.yaml").deepspeed.zero_stage == 2


def test_a_recipe_in_a_folder_named_deepspeed_is_a_recipe(tmp_path):
    (tmp_path / "deepspeed").mkdir()
    mine = tmp_path / "deepspeed" / "my.yaml"
    mine.write_text(Path("recipes/medusa/smollm2-135m.yaml").read_text())
    assert load_recipe(mine).trainer == "heads"


def test_the_copies_draftsmith_writes_beside_runs_are_not_listed_as_recipes(tmp_path):
    (tmp_path / "mine.yaml").write_text("trainer: heads\n")
    for folder, marker in [("run", "command.txt"), ("run/checkpoints/step-000002", "trainer_state.json"), ("export", "draftsmith-manifest.json")]:
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / "recipe.yaml").write_text("trainer: heads\n")
        (tmp_path / folder / marker).write_text("{}\n")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "recipe.yaml").write_text("trainer: heads\n")  # a user's recipe of that name
    assert all_recipe_files(tmp_path) == [tmp_path / "mine.yaml", tmp_path / "plain" / "recipe.yaml"]


def test_the_summary_a_command_prints_is_json_a_key_a_line():
    from draftsmith.cli import one_key_a_line

    summary = {"step": 30, "top1": [0.5, 0.25, 0.125], "tree": {"kind": "static", "choices": [[0], [1]]}, "checkpoint": None}
    text = one_key_a_line(summary)
    assert json.loads(text) == summary and len(text.splitlines()) == len(summary) + 2
    assert json.loads(one_key_a_line({})) == {}
