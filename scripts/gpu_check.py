"""The GPU check: everything draftsmith claims about CUDA, run in one go on a bare GPU machine.

    make gpu-wheels                       # once, where the package registries are: wheels into .whl/
    make gpu-check                        # on the GPU machine (bash scripts/gpu_check.sh): installs
                                          # .whl/ offline, then runs this script
    python scripts/gpu_check.py --out DIR [--budget 540] [--workers 12] [--only gpu-tests suite ...]

Steps, each under its own time limit (its share of --budget seconds, default 540), logged as it
goes (DIR/<step>.log) so that a machine taken away mid-run still leaves what it saw:

1. the machine: GPU, driver, torch / CUDA / triton / transformers versions;
2. tests/gpu: the fused kernels at real sizes, every trainer and drafter kind on CUDA, one-rank
   DDP and DeepSpeed ZeRO-2/3 over nccl, the bf16 identity rate (a file to a worker, four side
   by side, where pytest-xdist is there);
3. tests/unit and tests/integration (not slow, not interop) with CUDA visible, in parallel
   (pytest-xdist, --workers);
4. scripts/bench_verify.py --reps 10: fused kernel against the torch reference, full grid;
5. scripts/bench_gpu.py: a speculative step's cost against a plain one per drafter kind, at the
   SmolLM2-135M and Llama-3.1-8B shapes, on transformers' cache and on the graphed static one;
6. scripts/bench_gpu_train.py: EAGLE-3 and DFlash head training at the Llama-3.1-8B shape (tokens/s,
   ms a step, peak and step memory) on cached features with the LM head frozen as speculators keeps
   it, FlexAttention against attention kept, with an operator profile per row;
7. scripts/peers/speculators_gpu_train.py: the same heads, shape and schedule trained by speculators
   0.9.0 (its flex attention, fused Triton losses, or eager ones where those fail, and
   torch.compile on), on the image's own
   transformers with only .whl/speculators/ on its path (installed by the step into --speculators-site).

Writes DIR/report.md and DIR/report.json (every step's command, exit code, seconds, pytest
counts, failing tests and the tail of its output). Exit code 0 only when every step passed.
Standard library only: it runs before anything is known to import.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from shlex import quote

REPO = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+|no tests ran)\s+in [\d.]+s", re.M)
COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")


def machine(env: dict) -> dict:
    probe = (
        "import json, platform, torch\n"
        "out = {'python': platform.python_version(), 'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
        "       'cuda_available': torch.cuda.is_available()}\n"
        "if torch.cuda.is_available():\n"
        "    out.update(gpu=torch.cuda.get_device_name(), gpus=torch.cuda.device_count(), bf16=torch.cuda.is_bf16_supported())\n"
        "for name in ('triton', 'transformers', 'accelerate', 'deepspeed', 'omegaconf', 'datasets', 'huggingface_hub', 'peft'):\n"
        "    try:\n"
        "        out[name] = __import__(name).__version__\n"
        "    except Exception as err:\n"
        "        out[name] = f'missing ({type(err).__name__})'\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    info = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {"error": done.stderr[-2000:]}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["nvidia_smi"] = "not available"
    return info


def run_step(name: str, cmd: list[str], limit: float, out: Path, env: dict) -> dict:
    """Run one step under `limit` seconds, its output streamed into out/<name>.log."""
    log = out / f"{name}.log"
    started = time.time()
    print(f"[gpu-check] {name}: {' '.join(cmd)} (limit {limit:.0f} s)", flush=True)
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            code = "timeout"
    text = log.read_text(errors="replace")
    summary = SUMMARY.findall(text)
    counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in COUNTS.findall(summary[-1])} if summary else {}
    # "FAILED id" in the short summary, "[gw3] [ 40%] FAILED id" as xdist goes (-v): a step
    # stopped at its limit has no summary
    failing = sorted(set(re.findall(r"^(?:\[gw\d+\] \[ *\d+%\] )?(?:FAILED|ERROR) (\S+)", text, flags=re.M)))
    row = {
        "step": name, "command": " ".join(cmd), "exit_code": code, "seconds": round(time.time() - started, 1),
        "counts": counts, "failing": failing, "tail": text[-3000:], "log": log.name,
    }  # fmt: skip
    print(f"[gpu-check] {name}: exit {code} in {row['seconds']} s {counts or ''}", flush=True)
    return row


def speculators_command(py: str, site: str, out: Path) -> str:
    """The bench-train-speculators step: .whl/speculators/ unpacked into `site`, then the speculators
    side of the training benchmark at bench-train's schedule with only `site` on PYTHONPATH."""
    return (
        'ls .whl/speculators/*.whl >/dev/null 2>&1 || { echo "no .whl/speculators/: run make gpu-wheels where the registries are"; exit 2; }; '
        f"{quote(py)} -m pip install --quiet --no-index --no-deps --target {quote(site)} .whl/speculators/*.whl && "
        f"PYTHONPATH={quote(site)} exec {quote(py)} scripts/peers/speculators_gpu_train.py --steps 5 --warmup 2 --out {quote(str(out))}"
    )


def write_report(out: Path, info: dict, rows: list[dict]) -> None:
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": info, "steps": rows}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# draftsmith GPU check, {report['date']}", "",
        f"- GPU: {info.get('gpu', '-')} x{info.get('gpus', 0)} ({info.get('nvidia_smi', '')}), bf16 {info.get('bf16')}",
        f"- Python {info.get('python')}, torch {info.get('torch')} (CUDA {info.get('cuda')}), triton {info.get('triton')}, "
        f"transformers {info.get('transformers')}, accelerate {info.get('accelerate')}, deepspeed {info.get('deepspeed')}", "",
        "| step | exit | seconds | passed | failed | errors | skipped |", "| --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for r in rows:
        c = r["counts"]
        lines.append(f"| {r['step']} | {r['exit_code']} | {r['seconds']} | {c.get('passed', '-')} | {c.get('failed', '-')} | {c.get('error', '-')} | {c.get('skipped', '-')} |")
    for r in rows:
        if r["failing"] or r["exit_code"] not in (0,):
            lines += ["", f"## {r['step']}: exit {r['exit_code']}", ""]
            lines += [f"- `{t}`" for t in r["failing"][:60]]
            lines += ["", "```", r["tail"][-1500:], "```"]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu-check", help="report folder (default $OUT, else runs/gpu-check)")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for all steps together (a device call may run 600)")
    p.add_argument("--workers", type=int, default=12, help="pytest-xdist workers for the unit and integration suites")
    p.add_argument("--only", nargs="*", default=None, help="steps to run, in this order (gpu-tests, suite, bench-verify, bench-gpu, bench-train, bench-train-speculators)")
    p.add_argument("--share", nargs="*", default=[], metavar="STEP=FRACTION", help="a step's share of the budget instead of its default")
    p.add_argument("--gpu-tests", nargs="*", default=["tests/gpu"], help="what the gpu-tests step runs (files or test ids)")
    p.add_argument("--suite-tests", nargs="*", default=["tests/unit", "tests/integration"], help="what the suite step runs (files or test ids; @FILE: those listed in FILE)")
    p.add_argument("--bench-args", default="--prompts 1 --new-tokens 32 --caches static", help="arguments for scripts/bench_gpu.py (besides --out)")
    p.add_argument("--speculators-site", default="/tmp/draftsmith-speculators-site", help="where bench-train-speculators unpacks .whl/speculators/")
    args = p.parse_args(argv)
    args.suite_tests = [t for item in args.suite_tests for t in (Path(item[1:]).read_text().split() if item.startswith("@") else [item])]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DRAFTSMITH_FAILURE_LOG": str((out / "failures.log").resolve()), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    info = machine(env)
    print(f"[gpu-check] machine: {json.dumps(info)}", flush=True)
    py = sys.executable
    # Shares of the budget: the GPU tests first (they are the point), the suite next, the benchmark last.
    # The suite in parallel where pytest-xdist is there (make gpu-wheels brings it), else in one process.
    # -v there (net of -q): a line per test as it finishes, which a step stopped at its limit keeps.
    parallel = ["-n", str(args.workers), "-vv"] if importlib.util.find_spec("xdist") else []
    # The GPU tests a file to a worker (--dist loadfile): each file's tests run in the order and
    # with the module fixtures they run with in one process, the files side by side on the GPU.
    by_file = ["-n", "4", "--dist", "loadfile", "-vv"] if importlib.util.find_spec("xdist") else []
    steps = [
        # The CUDA tests only: their simulated twins are CI's.
        ("gpu-tests", [py, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *by_file, "-m", "gpu", *args.gpu_tests], 0.35),
        ("suite", [py, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *parallel,
                   "-m", "not slow and not interop and not assets", *args.suite_tests], 0.35),
        ("bench-verify", [py, "scripts/bench_verify.py", "--reps", "10", "--out", str(out / "bench-verify.md")], 0.12),
        ("bench-gpu", [py, "scripts/bench_gpu.py", *args.bench_args.split(), "--out", str(out / "bench-gpu.md")], 0.18),
        # Cached features only (speculators' offline case), the LM head frozen as speculators keeps it
        # (the same work), FlexAttention against attention kept; warm-up 2 for the compiles; an operator
        # profile per row.
        ("bench-train", [py, "scripts/bench_gpu_train.py", "--steps", "5", "--warmup", "2", "--modes", "cached", "--lm-head", "frozen", "--attention", "flex", "keep",
                         "--profile", str(out / "train-profiles"), "--out", str(out / "bench-train.md")], 0.12),  # fmt: skip
        # Its own PYTHONPATH: speculators wants transformers <= 5.19, the image's, not ours. Two warm-up
        # steps: its forward compiles and its Triton losses autotune there.
        ("bench-train-speculators", ["bash", "-c", speculators_command(py, args.speculators_site, out / "bench-train-speculators.md")], 0.3),
    ]  # fmt: skip
    unknown = sorted(set(args.only or []) - {name for name, _, _ in steps})
    if unknown:
        p.error(f"--only: no step named {', '.join(unknown)}")
    shares = {}
    for item in args.share:
        name, _, fraction = item.partition("=")
        try:
            shares[name] = float(fraction)
        except ValueError:
            p.error(f"--share {item}: expected STEP=FRACTION")
    steps = [(name, cmd, shares.get(name, share)) for name, cmd, share in steps]
    if args.only is not None:
        steps = sorted((step for step in steps if step[0] in args.only), key=lambda step: args.only.index(step[0]))
    whole = sum(share for _, _, share in steps)  # the shares of the steps chosen split the whole budget
    deadline = time.time() + args.budget
    rows = []
    for name, cmd, share in steps:
        limit = min(args.budget * share / whole, deadline - time.time())
        if limit < 10:
            rows.append({"step": name, "command": " ".join(cmd), "exit_code": "not run (budget spent)", "seconds": 0, "counts": {}, "failing": [], "tail": "", "log": ""})
            continue
        rows.append(run_step(name, cmd, limit, out, env))
        write_report(out, info, rows)  # after every step: a machine taken away keeps what was seen
    write_report(out, info, rows)
    print(f"[gpu-check] report: {(out / 'report.md').resolve()} (and report.json)", flush=True)
    return 0 if rows and all(r["exit_code"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
