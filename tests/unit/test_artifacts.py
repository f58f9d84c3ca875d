"""draftsmith.artifacts: one place reads drafter folders, verifies what it reads, and says in one
line what is wrong; export never deletes what the user did not ask it to replace."""

import json

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.artifacts import ArtifactError, DraftLMArtifact, HeadArtifact, open_drafter
from draftsmith.atomic import MANIFEST_NAME, DestinationError, sha256_file
from draftsmith.cli import main
from draftsmith.export import export
from draftsmith.heads import MedusaConfig, MedusaHead
from draftsmith.target import FrozenTarget
from draftsmith.testing import tiny_causal_lm


def checkpoint(tmp_path, manifest=True):
    """A head-trainer checkpoint with the sha256 manifest the trainer writes."""
    target = FrozenTarget(tiny_causal_lm("llama", vocab_size=40, hidden_size=32))
    head = MedusaHead(MedusaConfig(num_heads=2, lm_head="own"), target.dims)
    head.init_from_target(target)
    ckpt = tmp_path / "run" / "checkpoints" / "step-000010"
    ckpt.mkdir(parents=True)
    save_file({f"head.{k}": v.contiguous() for k, v in head.state_dict().items()}, str(ckpt / "model.safetensors"))
    (ckpt / "recipe.yaml").write_text("trainer: heads\n")
    files = ["model.safetensors", "recipe.yaml"]
    state = {
        "step": 10, "trainer": "heads", "drafter": {"kind": "medusa"},
        "head": {"kind": "medusa", "num_heads": 2, "num_layers": 1, "lm_head": "own"},
        "target": {"path": "org/tiny", "hidden_size": 32, "vocab_size": 40, "num_layers": 3, "model_type": "llama"},
    }  # fmt: skip
    if manifest:
        state["files"] = {f: (ckpt / f).stat().st_size for f in files}
        state["sha256"] = {f: sha256_file(ckpt / f) for f in files}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    return tmp_path / "run", ckpt, head


def one_line_exit_2(capsys, *argv, naming=()):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    text = capsys.readouterr().err
    err = [line for line in text.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(err) == 1 and "Traceback" not in text, (code, text)
    for word in naming:
        assert word in err[0], err[0]
    return err[0]


def flip_a_byte(path, offset=-20):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_each_kind_of_folder_opens_as_its_artifact(tmp_path, tiny_llama_dir):
    run, ckpt, head = checkpoint(tmp_path)
    from_run = open_drafter(run)
    assert isinstance(from_run, HeadArtifact) and from_run.layout == "checkpoint" and from_run.folder == ckpt
    for name, value in head.state_dict().items():
        assert torch.equal(from_run.head.state_dict()[name], value), name
    exported = open_drafter(export(run, tmp_path / "export"))
    assert exported.layout == "draftsmith" and exported.kind == "medusa"
    lm = open_drafter(tiny_llama_dir)
    assert isinstance(lm, DraftLMArtifact) and lm.kind == "standalone" and lm.layout == "hf"
    assert open_drafter(tiny_llama_dir, exit_layer=1).kind == "early_exit"


def test_an_export_naming_an_unknown_head_kind_is_one_line_exit_2(tmp_path, capsys):
    run, _, _ = checkpoint(tmp_path)
    out = export(run, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    config["draftsmith"]["head"]["kind"] = "teleport"
    (out / "config.json").write_text(json.dumps(config))
    (out / MANIFEST_NAME).unlink()  # edited by hand: not the export draftsmith wrote, and not damaged either
    with pytest.raises(ArtifactError, match="names head kind 'teleport', which this draftsmith does not know"):
        open_drafter(out)
    one_line_exit_2(capsys, "export", out, "--out", tmp_path / "again", naming=["teleport", "config.json"])
    assert not (tmp_path / "again").exists()


def test_a_damaged_checkpoint_is_refused_wherever_it_is_opened(tmp_path, capsys):
    run, ckpt, _ = checkpoint(tmp_path)
    flip_a_byte(ckpt / "model.safetensors")  # same size: only the sha256 tells
    with pytest.raises(ArtifactError, match="model.safetensors does not match the sha256"):
        open_drafter(ckpt)
    # A run folder has no other checkpoint to fall back on.
    with pytest.raises(ArtifactError, match="every checkpoint of .* is damaged"):
        open_drafter(run)
    one_line_exit_2(capsys, "export", ckpt, "--out", tmp_path / "out", naming=["sha256", "model.safetensors"])
    one_line_exit_2(capsys, "generate", "--drafter", ckpt, "--prompt", "hi", naming=["sha256"])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda state: state.update(drafter="medusa"), "'drafter' is 'medusa', not"),
        (lambda state: state.update(step="ten"), "'step' is 'ten'"),
        (lambda state: state.update(files=["model.safetensors"]), "'files' is not a manifest"),
    ],
    ids=["no drafter kind", "step not a number", "files not a manifest"],
)
def test_a_malformed_checkpoint_state_is_one_line_exit_2(tmp_path, capsys, edit, words):
    """A trainer_state.json that parses but lacks a key draftsmith writes was a KeyError reported
    as "unexpected", exit 1; it names the file and the key, exit 2, and a run folder skips it."""
    from draftsmith.runs import MalformedStateError, list_checkpoints, read_state

    run, ckpt, _ = checkpoint(tmp_path)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    edit(state)
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(MalformedStateError, match=words):
        read_state(ckpt)
    one_line_exit_2(capsys, "export", ckpt, "--out", tmp_path / "out", naming=["trainer_state.json"])
    assert list_checkpoints(run, warn=lambda message: None) == [] and not (tmp_path / "out").exists()


def test_a_checkpoint_that_does_not_say_what_it_holds_resumes_but_does_not_export(tmp_path, capsys):
    from draftsmith.runs import list_checkpoints, read_state

    run, ckpt, _ = checkpoint(tmp_path)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    del state["drafter"]
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    assert read_state(ckpt).drafter_kind is None and list_checkpoints(run) == [ckpt]
    one_line_exit_2(capsys, "export", ckpt, "--out", tmp_path / "out", naming=["records no drafter kind", "trainer_state.json"])


def test_a_checkpoint_state_is_parsed_once_and_typed(tmp_path):
    from draftsmith.runs import read_state

    _, ckpt, _ = checkpoint(tmp_path)
    state = read_state(ckpt)
    assert read_state(ckpt) is state and state.step == 10 and state.drafter_kind == "medusa" and state["head"]["num_heads"] == 2
    assert state.engine == {"kind": "accelerate", "zero_stage": None, "world_size": 1} and set(state.files) == {"model.safetensors", "recipe.yaml"}


def test_a_run_folder_falls_back_to_its_newest_sound_checkpoint(tmp_path, capsys):
    run, older, head = checkpoint(tmp_path)
    newer = older.with_name("step-000020")
    import shutil

    shutil.copytree(older, newer)
    flip_a_byte(newer / "model.safetensors")
    assert open_drafter(run).folder == older
    assert "skipping damaged checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:100]), ["model.safetensors"]),
        (lambda f: (f / "config.json").write_text((f / "config.json").read_text()[:40]), ["config.json"]),
        (lambda f: flip_a_byte(f / "model.safetensors"), ["model.safetensors", "sha256"]),
    ],
)
def test_a_damaged_export_is_one_line_with_or_without_its_manifest(tmp_path, capsys, damage, words):
    run, _, _ = checkpoint(tmp_path)
    for keep_manifest in (True, False):
        out = export(run, tmp_path / f"export-{keep_manifest}")
        if not keep_manifest:
            (out / MANIFEST_NAME).unlink()
        damage(out)
        if not keep_manifest and words[-1] == "sha256":
            continue  # without a manifest a flipped byte inside a tensor cannot be told
        one_line_exit_2(capsys, "export", out, "--out", tmp_path / f"copy-{keep_manifest}", naming=words[:1])


def test_export_never_deletes_what_the_user_did_not_ask_to_replace(tmp_path, capsys):
    run, _, _ = checkpoint(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("a day of work")
    one_line_exit_2(capsys, "export", run, "--out", mine, naming=[str(mine), "--overwrite"])
    assert (mine / "notes.txt").read_text() == "a day of work" and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    # Around the source, the source itself, or inside the checkpoint it reads: never, --overwrite or not.
    for out in (tmp_path, run, run / "checkpoints", run / "checkpoints" / "step-000010" / "export"):
        with pytest.raises(DestinationError, match="the input"):
            export(run, out, overwrite=True)
    assert (run / "checkpoints" / "step-000010" / "model.safetensors").is_file()
    assert export(run, run / "export") == run / "export"  # beside the checkpoints, inside the run: fine
    # A previous export of draftsmith's own is replaced; one the user added a file to is not.
    out = export(run, tmp_path / "export")
    assert export(run, out) == out
    (out / "extra.txt").write_text("mine")
    with pytest.raises(DestinationError, match="holds files draftsmith did not write"):
        export(run, out)
    assert export(run, mine, overwrite=True) == mine and not (mine / "notes.txt").exists()
