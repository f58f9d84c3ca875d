"""data.regenerate.backend=server against a small OpenAI-compatible server (tests/openai_server.py)
answering with the same tiny model as the hf backend: the same answers, token for token; retries
through transient failures; a run stopped by a failing server keeps every finished conversation
and a rerun asks only for the rest; one line for each kind of bad server."""

import json
import socket
import sys
from pathlib import Path

import pytest
import torch

from draftsmith.data import DataError, regenerate_conversations, tokenize_conversation
from draftsmith.data.server import RegenerationServer, ServerError, run_pool
from draftsmith.recipe import RecipeError, RegenerateConfig, ServerConfig, load_recipe
from draftsmith.testing import answering_model, tiny_tokenizer

sys.path.insert(0, str(Path(__file__).parents[1]))
from openai_server import FakeOpenAIServer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def U(text):
    return {"role": "user", "content": text}


CONVERSATIONS = [
    [U("Hi"), {"role": "assistant", "content": "replaced"}],
    [{"role": "system", "content": "Be terse."}, U("What is the capital of France?"), {"role": "assistant", "content": "Paris."}, U("And of Italy?")],
    [U("Tell me a story about a dragon.")],
    [U("x"), U("y"), U("z")],
    [U("Name three colors")],
    [U("Why is the sky blue?")],
]
MAX_NEW = 12


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return answering_model(tok)


def config(url="http://127.0.0.1:1/v1", **server):
    settings = dict(model="tiny", concurrency=3, timeout=10.0, max_retries=2, backoff=0.0)
    settings.update(server)
    return RegenerateConfig(enabled=True, backend="server", max_new_tokens=MAX_NEW, server=ServerConfig(url=url, **settings))


def regenerate(model, tok, path, cfg, conversations=CONVERSATIONS):
    return regenerate_conversations(model if cfg.backend == "hf" else None, tok, conversations, cfg, path, progress=False)


def test_server_answers_equal_the_hf_backend_token_for_token(model, tok, tmp_path):
    hf = regenerate(model, tok, tmp_path / "hf.jsonl", RegenerateConfig(enabled=True, max_new_tokens=MAX_NEW, batch_size=4))
    with FakeOpenAIServer(model, tok) as server:
        got = regenerate(model, tok, tmp_path / "server.jsonl", config(server.url))
    assert got == hf
    answers = [m for c in got for m in c if m["role"] == "assistant"]
    assert all(m["token_ids"] is not None for m in answers)
    assert any(m["complete"] for m in answers) and any(not m["complete"] for m in answers)
    assert len(got[3]) == 6  # multi-turn: each prompt carried the earlier answers
    # Every request asked for what the recipe says and nothing the model's defaults could change.
    body = server.bodies[0]
    assert body["temperature"] == 0.0 and body["repetition_penalty"] == 1.0 and body["return_token_ids"] is True
    assert body["model"] == "tiny" and all(isinstance(t, int) for t in body["prompt"])


def test_answers_train_on_the_token_ids_the_target_produced(tok):
    # An answer with a special token inside: its text (specials skipped) tokenizes to other ids.
    produced = tok("hel", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_start|>")] + tok("lo", add_special_tokens=False)["input_ids"]
    text = tok.decode(produced, skip_special_tokens=True)
    assert tok(text, add_special_tokens=False)["input_ids"] != produced  # the round trip changes them
    messages = [U("Hi"), {"role": "assistant", "content": text, "complete": True, "token_ids": produced}]
    example = tokenize_conversation(tok, messages, 256)
    prompt = tok(tok.apply_chat_template([U("Hi")], tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    n = len(prompt)
    assert example["input_ids"][:n] == prompt
    assert example["input_ids"][n : n + len(produced)] == produced
    assert example["input_ids"][n + len(produced)] == tok.eos_token_id  # <|im_end|> closes the answer
    assert example["loss_mask"] == [0] * n + [1] * (len(produced) + 1) + [0] * (len(example["input_ids"]) - n - len(produced) - 1)
    # Where the ids are what the text tokenizes to, both paths give the same example.
    plain = [U("Hi"), {"role": "assistant", "content": "hello there", "complete": False}]
    with_ids = [U("Hi"), {**plain[1], "token_ids": tok("hello there", add_special_tokens=False)["input_ids"]}]
    assert tokenize_conversation(tok, with_ids, 256) == tokenize_conversation(tok, plain, 256)
    assert tokenize_conversation(tok, with_ids, 7) == tokenize_conversation(tok, plain, 7)


def test_sampled_answers_are_seeded_per_turn_whatever_the_concurrency(model, tok, tmp_path):
    def sampled(path, concurrency, seed=0):
        cfg = config(server.url, concurrency=concurrency)
        cfg.temperature, cfg.top_p, cfg.seed = 1.0, 0.9, seed
        return regenerate(model, tok, path, cfg)

    with FakeOpenAIServer(model, tok) as server:
        a = sampled(tmp_path / "a.jsonl", 3)
        b = sampled(tmp_path / "b.jsonl", 1)
        c = sampled(tmp_path / "c.jsonl", 3, seed=1)
        seeds = {b_["seed"] for b_ in server.bodies}
    assert a == b and a != c
    assert len(seeds) > len(CONVERSATIONS)  # one per (conversation, turn, recipe seed)


def test_transient_failures_are_retried(model, tok, tmp_path):
    expected = regenerate(model, tok, tmp_path / "hf.jsonl", RegenerateConfig(enabled=True, max_new_tokens=MAX_NEW))
    script = {1: ("status", 503), 2: ("drop",), 4: ("status", 429), 5: ("sleep", 1.5)}
    with FakeOpenAIServer(model, tok, faults=lambda n, path: script.get(n)) as server:
        got = regenerate(model, tok, tmp_path / "s.jsonl", config(server.url, concurrency=1, timeout=1.0))
    assert got == expected
    turns = sum(m["role"] == "assistant" for c in got for m in c)
    assert server.completions == turns + 4  # three refused outright, one answered too late
    with FakeOpenAIServer(model, tok, faults=lambda n, path: ("status", 400) if n == 2 else None) as server:
        with pytest.raises(ServerError, match=r"refused with HTTP 400: .*scripted failure 400"):
            regenerate(model, tok, tmp_path / "t.jsonl", config(server.url, concurrency=1))
        assert server.completions == 2  # a client error is not retried


def test_a_failing_server_loses_nothing_and_a_rerun_redoes_nothing(model, tok, tmp_path):
    cache = tmp_path / "regen.jsonl"
    down_after = 4  # completions answered before the server starts failing for good
    with FakeOpenAIServer(model, tok, faults=lambda n, path: ("status", 500) if n > down_after else None) as server:
        with pytest.raises(ServerError, match=r"failed 3 times \(last: HTTP 500"):
            regenerate(model, tok, cache, config(server.url, concurrency=2))
    saved = [json.loads(line) for line in cache.read_text().splitlines()]
    assert 0 < len(saved) < len(CONVERSATIONS)
    # Every answer received belongs to a saved conversation, unless its conversation was cut short.
    saved_turns = sum(1 for r in saved for m in r["messages"] if m["role"] == "assistant")
    assert saved_turns <= down_after
    with FakeOpenAIServer(model, tok) as server:
        full = regenerate(model, tok, cache, config(server.url))
        redone = server.answered
    with FakeOpenAIServer(model, tok) as fresh_server:
        assert regenerate(model, tok, tmp_path / "fresh.jsonl", config(fresh_server.url)) == full
    assert redone == fresh_server.answered - saved_turns  # only the unfinished conversations were asked for
    with FakeOpenAIServer(model, tok, faults=lambda n, path: pytest.fail("asked for a cached answer")) as server:
        assert regenerate(model, tok, cache, config(server.url)) == full


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_servers_are_refused_in_one_line_before_any_request(model, tok, tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    with pytest.raises(ServerError, match=rf"GET {url}/models failed 3 times \(last: ConnectionRefusedError.*is the server up"):
        regenerate(model, tok, tmp_path / "a.jsonl", config(url))
    with FakeOpenAIServer(model, tok, name="other") as server:
        with pytest.raises(ServerError, match=r"serves 'other', not 'tiny' \(data.regenerate.server.model"):
            regenerate(model, tok, tmp_path / "b.jsonl", config(server.url))
    shifted = lambda text: [t + 1 if i == 3 else t for i, t in enumerate(tok(text, add_special_tokens=False)["input_ids"])]  # noqa: E731
    with FakeOpenAIServer(model, tok, tokenize=shifted) as server:
        with pytest.raises(ServerError, match=r"tokenizes differently .* first differs at token 3"):
            regenerate(model, tok, tmp_path / "c.jsonl", config(server.url))
        assert server.completions == 0
    for path in tmp_path.glob("*.jsonl"):
        assert path.read_text() == ""  # nothing cached


@pytest.mark.parametrize(
    "answer, message",
    [
        ({"choices": []}, "not a completion"),
        ({"error": "nope"}, "not a completion"),
        ({"choices": [{"text": "hi", "finish_reason": "stop", "token_ids": ["a"]}]}, "malformed token_ids"),
        ({"choices": [{"text": 3, "finish_reason": "stop"}]}, "malformed choice"),
        ({"choices": [{"text": "x", "finish_reason": "stop", "token_ids": list(range(99))}]}, "more than the"),
    ],
)
def test_malformed_answers_stop_the_run_in_one_line(model, tok, tmp_path, answer, message):
    with FakeOpenAIServer(model, tok, faults=lambda n, path: ("json", answer) if n == 5 else None) as server:
        with pytest.raises(ServerError, match=message) as err:
            regenerate(model, tok, tmp_path / "r.jsonl", config(server.url, concurrency=1))
    assert "\n" not in str(err.value) and server.url in str(err.value)
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) >= 1  # what came before is kept


def test_a_server_without_token_ids_is_used_through_its_text_with_a_warning(model, tok, tmp_path):
    with FakeOpenAIServer(model, tok, token_ids=False) as server:
        with pytest.warns(UserWarning, match="text only"):
            got = regenerate(model, tok, tmp_path / "r.jsonl", config(server.url))
    hf = regenerate(model, tok, tmp_path / "hf.jsonl", RegenerateConfig(enabled=True, max_new_tokens=MAX_NEW))
    strip = lambda c: [{k: v for k, v in m.items() if k != "token_ids"} for m in c]  # noqa: E731
    assert [strip(c) for c in got] == [strip(c) for c in hf]
    assert all("token_ids" not in m for c in got for m in c)


def test_the_pool_delivers_finished_work_and_raises_the_first_failure():
    seen = []

    def task(i):
        if i == 5:
            raise DataError("five")
        return i * i

    with pytest.raises(DataError, match="five"):
        run_pool(list(range(8)), task, 1, lambda i, v: seen.append((i, v)))
    assert seen == [(i, i * i) for i in range(5)]  # one worker: everything before 5, nothing after
    seen.clear()
    run_pool(list(range(20)), lambda i: -i, 4, lambda i, v: seen.append((i, v)))
    assert sorted(seen) == [(i, -i) for i in range(20)]


def test_recipe_keys(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("trainer: heads\noutput_dir: out\ntarget: {path: smollm2-135m}\ndata: {path: sharegpt}\nhead: {kind: medusa}\n")
    with pytest.raises(RecipeError, match=r"'data.regenerate.server.url' is missing"):
        load_recipe(path, overrides=["data.regenerate.enabled=true", "data.regenerate.backend=server"])
    with pytest.raises(RecipeError, match=r"'data.regenerate.server.url' must be an http"):
        load_recipe(path, overrides=["data.regenerate.server.url=127.0.0.1:8000"])
    with pytest.raises(RecipeError, match=r"'data.regenerate.server.concurrency' must be positive"):
        load_recipe(path, overrides=["data.regenerate.server.concurrency=0"])
    with pytest.raises(RecipeError, match=r"data.regenerate.backend"):
        load_recipe(path, overrides=["data.regenerate.backend=vllm"])
    recipe = load_recipe(path, overrides=["data.regenerate.enabled=true", "data.regenerate.backend=server", "data.regenerate.server.url=http://127.0.0.1:8000/v1"])
    assert recipe.data.regenerate.server.model == "smollm2-135m"  # the target's name by default


def test_client_urls():
    server = RegenerationServer("http://h:1/v1/", "m")
    assert (server.url, server.root) == ("http://h:1/v1", "http://h:1")


def test_draftsmith_prepare_through_a_server_gives_the_hf_backends_examples(tiny_llama_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith import cli

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS * 2))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"trainer: heads\noutput_dir: {tmp_path / 'run'}\ntarget: {{path: {tiny_llama_dir}, dtype: float32}}\nhead: {{kind: medusa}}\n"
        f"data: {{path: {chats}, eval_size: 2, max_length: 96, regenerate: {{enabled: true, max_new_tokens: {MAX_NEW}}}}}\n"
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert cli.main(["prepare", str(recipe), f"data.cache_dir={tmp_path / 'hf'}"]) == 0
    # `draftsmith serve-target` logs into the data cache it serves before prepare has written anything
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "vllm-server.log").write_text("INFO Started server process\n")
    with FakeOpenAIServer(model, tokenizer, name=str(tiny_llama_dir)) as server:
        assert cli.main(["prepare", str(recipe), f"data.cache_dir={tmp_path / 'server'}", "data.regenerate.backend=server", f"data.regenerate.server.url={server.url}"]) == 0
    hf, served = (torch.load(next((tmp_path / d).glob("examples-*.pt")), weights_only=True) for d in ("hf", "server"))
    for split in ("train", "eval"):
        for key in ("lengths", "input_ids", "loss_mask"):
            assert torch.equal(hf[split][key], served[split][key]), (split, key)
    capsys.readouterr()
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    overrides = [f"data.cache_dir={tmp_path / 'down'}", "data.regenerate.backend=server", f"data.regenerate.server.url={url}", "data.regenerate.server.backoff=0"]
    assert cli.main(["prepare", str(recipe), *overrides]) == 1  # the environment, not the input
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: GET ") and "is the server up" in err[-1]


def test_a_user_folder_with_a_server_log_in_it_is_still_refused(tiny_llama_dir, tmp_path, capsys):
    from draftsmith import cli

    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("a day of work\n")
    (user / "vllm-server.log").write_text("INFO Started server process\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"trainer: heads\noutput_dir: {tmp_path / 'run'}\ntarget: {{path: {tiny_llama_dir}}}\ndata: {{path: x.jsonl}}\nhead: {{kind: medusa}}\n")
    assert cli.main(["prepare", str(recipe), f"data.cache_dir={user}"]) == 2
    assert "not a draftsmith data cache" in capsys.readouterr().err
    assert sorted(p.name for p in user.iterdir()) == ["notes.txt", "vllm-server.log"]


def test_serve_target_without_a_vllm_venv_says_how_to_get_one(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    from draftsmith import cli

    monkeypatch.setenv("DRAFTSMITH_VLLM_VENV", str(tmp_path / "no-venv"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"trainer: heads\noutput_dir: {tmp_path / 'run'}\ntarget: {{path: {tiny_llama_dir}}}\ndata: {{path: x.jsonl}}\nhead: {{kind: medusa}}\n")
    assert cli.main(["serve-target", str(recipe)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no vLLM venv at" in err[0] and "make vllm" in err[0]
