"""A DFlash draft written by speculators 0.9.0 itself, read by draftsmith: the same logits, block for block.

    python scripts/check_speculators_dflash.py OUT [--speculators-python PY]

Builds a tiny random Llama verifier (draftsmith.testing), lets speculators write a default DFlash
draft for it (``speculators.train --dry-run``: two Qwen3 layers, every layer sliding-window and
causal inside the block, as its trainer defaults), perturbs every weight in speculators' own
process and saves it again with ``save_pretrained``; then runs speculators' training forward
(``_backbone_forward``: every answer position an anchor) and draftsmith's head read from the folder
(draftsmith.artifacts) on the same tokens, and compares the logits of every block slot. Prints the
largest relative difference; exits 1 above 1e-4. Needs speculators' venv (docs/peers.md:
``~/.cache/draftsmith/venvs/speculators-0.9.0``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from draftsmith.cli import OneLineParser, script_main

SPECULATORS_PYTHON = Path.home() / ".cache/draftsmith/venvs/speculators-0.9.0/bin/python"

# Run by speculators' python: perturb the draft it wrote, save it, and dump its training forward.
SPECULATORS_SIDE = r"""
import json, sys, torch
from speculators import SpeculatorModel
folder, ids_file, out_file = sys.argv[1:4]
model = SpeculatorModel.from_pretrained(folder).float().eval()
torch.manual_seed(0)
with torch.no_grad():
    for name, p in model.named_parameters():
        if not name.startswith(("embed_tokens", "lm_head", "verifier_")):
            p.add_(torch.randn_like(p) * 0.3)
model.save_pretrained(folder)
model = SpeculatorModel.from_pretrained(folder).float().eval()  # what the folder holds (speculators saves bf16)
data = json.load(open(ids_file))
ids = torch.tensor([data["ids"]])
aux = torch.tensor(data["aux"]).unsqueeze(0)
T = ids.shape[1]
mask = torch.tensor([data["loss_mask"]])
with torch.no_grad():
    hidden, logits, _, _, blocks = model._backbone_forward(
        hidden_states=aux, input_ids=ids, loss_mask=mask, verifier_last_hidden_states=torch.zeros(1, T, aux.shape[-1] // 3),
        document_ids=torch.zeros(1, T, dtype=torch.long), max_anchors=T,
    )
_, _, _, valid = model._build_attention_mask(mask, T, torch.zeros(1, T, dtype=torch.long), aux.device)
json.dump({"logits": logits[0].tolist(), "positions": blocks.tolist(), "valid": valid.flatten().tolist()}, open(out_file, "w"))
"""


def main(argv=None) -> int:
    p = OneLineParser(prog=Path(__file__).name, description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--speculators-python", default=str(SPECULATORS_PYTHON))
    args = p.parse_args(argv)
    import torch

    from draftsmith.runtime.load import load_drafter
    from draftsmith.target import FrozenTarget
    from draftsmith.testing import save_tiny_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    verifier = save_tiny_model(out / "verifier", "llama", num_layers=8)
    draft = out / "speculators-dflash"
    subprocess.run(
        [args.speculators_python, "-m", "speculators.train", "--speculator-type", "dflash", "--verifier-name-or-path", str(verifier),
         "--data-path", str(out / "data"), "--save-path", str(draft), "--dry-run", "--mask-token-id", "103", "--draft-attn-impl", "sdpa",
         "--num-layers", "2", "--block-size", "4", "--loss-implementation", "eager", "--on-missing", "raise"],
        check=True, cwd=out, capture_output=True,
    )  # fmt: skip
    target = FrozenTarget.load(str(verifier), "float32")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 100, (1, 40), generator=gen)
    loss_mask = [0] * 12 + [1] * 28
    aux_ids = json.loads((draft / "config.json").read_text())["aux_hidden_state_layer_ids"]
    with torch.no_grad():
        states = target.model(ids, output_hidden_states=True).hidden_states  # [i] = input of layer i: speculators' id i (< N)
    aux = torch.cat([states[i][0] for i in aux_ids], -1)
    (out / "inputs.json").write_text(json.dumps({"ids": ids[0].tolist(), "aux": aux.tolist(), "loss_mask": loss_mask}))
    subprocess.run([args.speculators_python, "-c", SPECULATORS_SIDE, str(draft), str(out / "inputs.json"), str(out / "theirs.json")], check=True, capture_output=True)
    theirs = json.loads((out / "theirs.json").read_text())
    head = load_drafter(str(draft), dtype="float32").drafter.head
    print(f"read back: causal={head.cfg.causal}, aux_layer_ids={head.cfg.aux_layer_ids}, block_size={head.cfg.block_size}, mask_token_id={head.cfg.mask_token_id}")
    with torch.no_grad():
        ours = head(target.features(ids, layers=head.required_layers()))[0]  # [T,K,V]: slot k of the block anchored at x_{t+1}
    B = head.cfg.block_size
    logits = torch.tensor(theirs["logits"]).view(-1, B, ours.shape[-1])  # [anchors, slots, V]
    anchors = torch.tensor(theirs["positions"]).view(-1, B)[:, 0]
    worst, blocks = 0.0, 0
    for block, a, valid in zip(logits, anchors.tolist(), theirs["valid"]):
        if not valid:
            continue  # speculators pads its anchor list to max_anchors
        blocks += 1
        want, got = block[1:], ours[a - 1]  # slots 1..B-1 of the block anchored at x_a: our position a - 1
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    print(f"{blocks} blocks, {B - 1} slots each: largest relative difference {worst:.2e}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(script_main(main))
