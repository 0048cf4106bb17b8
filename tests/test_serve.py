"""`specjax serve` through the real `openai` client and raw HTTP, against a server started on 127.0.0.1
inside the test: completions and chat, streaming and not, stop strings, every refusal the OpenAI way,
cancellation mid-stream, a full queue, SIGTERM, /metrics, and a load test of 64 concurrent requests
whose greedy and seeded outputs must equal offline `specjax.generate` whatever else is in the batch.

The LLM is a tiny random LLaMA that carries SmolLM2's tokenizer and chat template (real text handling,
cheap passes); its outputs are nonsense words, which is all the equality checks need.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx2 as httpx  # the HTTP client the openai package is built on
import openai
import pytest

import specjax
from specjax.serving.scheduler import Submission, Ticket
from tests.conftest import make_hf_model, requires_smollm2

pytestmark = requires_smollm2

NAME = "tiny-chat"
MAX_PROMPT, MAX_TOKENS, CONTEXT = 128, 200, 2048
LONG = 1500  # tokens of a request that is still running when the test acts on it


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_chat"))
    make_hf_model("llama", path, vocab_size=49152, num_attention_heads=4, num_key_value_heads=2, eos_token_id=2,
                  max_position_embeddings=CONTEXT)
    specjax.describe_model("smollm2-135m-instruct").tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chat_model(chat_dir):
    return specjax.load_model(chat_dir, progress=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_dir: str, tmp: str, *extra: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(tmp, f"serve-{self.port}.log"), "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specjax", "serve", "--model", model_dir, "--served-model-name", NAME, "--port",
             str(self.port), "--max-prompt-tokens", str(MAX_PROMPT), *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ, SPECJAX_CACHE_DIR=tmp))
        deadline = time.time() + 600
        while time.time() < deadline:
            assert self.proc.poll() is None, f"the server exited: {self.output()}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError(f"the server did not come up: {self.output()}")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=300)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        lines = [line for line in text.splitlines() if line.startswith(name + " ")]
        assert lines, f"{name} not in /metrics"
        return float(lines[0].split()[-1])

    def close(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def _given_pass_costs(model, cache_dir: str, slots: int) -> None:
    """The tree budget's cost table for this model, written where the server reads it: its measurement
    is tested in test_lookup.py; here it would only add minutes. Cheap small trees, so the budget
    speculates and also switches levels."""
    import jax.numpy as jnp

    from specjax.models.params import layers_split
    from specjax.speculation.cost import pass_head, table_key

    costs = {1: 1e-3, 2: 1.1e-3, 3: 1.2e-3, 5: 1.4e-3, 9: 1.8e-3, 17: 3e-3}
    # the server's default verifier is seeded: its passes decide each node's seeded token (their own key)
    key = table_key(model.config, jnp.float32, slots, "xla", split=layers_split(model.params),
                    head=pass_head("seeded"))
    with open(os.path.join(cache_dir, "tree_costs.json"), "w") as f:
        json.dump({key: {str(n): c for n, c in costs.items()}}, f)


@pytest.fixture(scope="module")
def server(chat_dir, chat_model, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("serve"))
    _given_pass_costs(chat_model, tmp, slots=4)
    s = Server(chat_dir, tmp, "--slots", "4", "--max-tokens", str(MAX_TOKENS))
    assert "measuring" not in s.output()  # the given table was used
    assert "(4 slots, queue 256; drafting: lookup(" in s.output()  # the chat model's default: lookup alone
    yield s
    s.close()


def _offline(model, requests):
    """Offline generation of every request, one batch (a request's tokens do not depend on its batch
    mates): a dict request index -> generated token ids at the largest max_tokens of them all."""
    prompts = [r["ids"] for r in requests]
    sampling = [specjax.SamplingParams(temperature=r.get("temperature", 0.0), top_p=r.get("top_p", 1.0),
                                       top_k=r.get("top_k", 0), seed=r.get("seed", 0)) for r in requests]
    # the incremental reference decoder: what every speculative configuration must reproduce
    out = specjax.generate(model, prompts, max_new_tokens=max(r["max_tokens"] for r in requests), sampling=sampling,
                           mode="incremental")
    return out.token_ids


def _expected(model, tokens: list[int], max_tokens: int, stops=()) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) a client must get for offline tokens ``tokens``."""
    eos = set(model.config.eos_token_ids)
    n = next((i + 1 for i, t in enumerate(tokens[:max_tokens]) if t in eos), None)
    reason = "stop" if n is not None else "length"
    n = n or max_tokens
    for k in range(1, n + 1):  # token by token: the first stop string ends the text
        text = model.tokenizer.decode(tokens[:k], skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)], "stop", k
    return model.tokenizer.decode(tokens[:n], skip_special_tokens=True), reason, n


def _ids(model, request) -> list[int]:
    tok = model.tokenizer
    if request["kind"] == "chat":
        return tok.apply_chat_template([{"role": "user", "content": request["text"]}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"]
    return tok(request["text"])["input_ids"]


def _call(server: Server, r: dict) -> tuple[str, str, int]:
    """Send one request through the openai client: (text, finish_reason, completion tokens)."""
    kw = dict(model=NAME, max_tokens=r["max_tokens"], temperature=r.get("temperature", 0.0), stream=r["stream"])
    if "seed" in r:
        kw["seed"] = r["seed"]
    if "top_p" in r:
        kw["top_p"] = r["top_p"]
    if r.get("stop"):
        kw["stop"] = r["stop"]
    if r["stream"]:
        kw["stream_options"] = {"include_usage": True}
    if r["kind"] == "chat":
        res = server.client.chat.completions.create(messages=[{"role": "user", "content": r["text"]}], **kw)
    else:
        res = server.client.completions.create(prompt=r["text"], **kw)
    if not r["stream"]:
        c = res.choices[0]
        return (c.message.content if r["kind"] == "chat" else c.text), c.finish_reason, res.usage.completion_tokens
    text, reason, usage = "", None, None
    for chunk in res:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for c in chunk.choices:
            text += (c.delta.content or "") if r["kind"] == "chat" else c.text
            reason = c.finish_reason or reason
    return text, reason, usage


WORDS = ("the river", "a small house", "seven", "green lights", "Summarise this:", "Paris", "def f(x):", "2 + 2 =")


def _requests(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = {"kind": rng.choice(["chat", "completion"]), "stream": rng.random() < 0.5,
             "text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))), "max_tokens": rng.randint(1, 24)}
        if rng.random() < 0.5:  # seeded sampling
            r.update(temperature=rng.choice([0.7, 1.0, 1.3]), seed=rng.randrange(2**31))
            if rng.random() < 0.5:
                r["top_p"] = 0.9
        out.append(r)
    return out


def test_models_health_and_metrics_endpoints(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [NAME]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok"
    text = httpx.get(server.url + "/metrics").text
    for name in ("specjax_requests_total", "specjax_prompt_tokens_total", "specjax_generation_tokens_total",
                 "specjax_tokens_per_llm_pass", "specjax_time_to_first_token_seconds",
                 "specjax_time_per_output_token_seconds", "specjax_queue_length", "specjax_busy_slots"):
        assert name in text, name
    assert server.metric("specjax_slots") == 4


def test_completions_and_chat_equal_offline_generation_streamed_or_not(server, chat_model):
    requests = [dict(kind=k, stream=s, text="Name three primes.", max_tokens=24, **sampling)
                for k in ("completion", "chat") for s in (False, True)
                for sampling in ({}, {"temperature": 0.9, "seed": 1234, "top_p": 0.95})]
    for r in requests:
        r["ids"] = _ids(chat_model, r)
    offline = _offline(chat_model, requests)
    for r, tokens in zip(requests, offline):
        assert _call(server, r) == _expected(chat_model, tokens, r["max_tokens"]), r


def test_stop_strings_cut_the_text_and_end_the_request(server, chat_model):
    base = dict(kind="completion", text="the river", max_tokens=30)
    base["ids"] = _ids(chat_model, base)
    tokens = _offline(chat_model, [base])[0]
    full = chat_model.tokenizer.decode(tokens, skip_special_tokens=True)
    at = next(i for i in range(len(full) // 2, len(full) - 3) if full[i:i + 3].isalpha())
    stop = full[at:at + 3]  # three letters the output really contains, past its middle
    want = _expected(chat_model, tokens, 30, (stop,))
    assert want[1] == "stop" and want[2] < 30 and stop not in want[0]
    observed = server.metric("specjax_tokens_per_llm_pass_count")
    for stream in (False, True):
        assert _call(server, dict(base, stream=stream, stop=[stop, "never-in-the-output"])) == want
    # the engine ends them at its next step, after the client has its text: their passes still count
    deadline = time.time() + 30
    while server.metric("specjax_tokens_per_llm_pass_count") < observed + 2 and time.time() < deadline:
        time.sleep(0.02)
    assert server.metric("specjax_tokens_per_llm_pass_count") == observed + 2


def test_null_fields_mean_not_given_and_completions_default_to_16_tokens(server, chat_model):
    """The openai client sends an explicit None as null: such fields are absent, never refused.
    Without max_tokens a completion generates OpenAI's default 16 tokens (chat: up to the server's)."""
    r = dict(kind="completion", text="the river", max_tokens=16)
    r["ids"] = _ids(chat_model, r)
    want = _expected(chat_model, _offline(chat_model, [r])[0], 16)
    nulls = {k: None for k in ("max_tokens", "top_p", "top_k", "seed", "stop", "n", "logprobs", "user", "suffix",
                               "stream", "stream_options", "presence_penalty", "logit_bias")}
    got = httpx.post(server.url + "/v1/completions", json=dict(nulls, model=NAME, prompt="the river", temperature=0),
                     timeout=120)
    assert got.status_code == 200, got.text
    body = got.json()
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]) \
        == want
    chat = server.client.chat.completions.create(model=NAME, max_completion_tokens=5, temperature=0, max_tokens=None,
                                                 top_p=None, messages=[{"role": "user", "content": "hi", "name": None}])
    assert chat.usage.completion_tokens <= 5 and chat.choices[0].finish_reason in ("stop", "length")


BAD = [  # (path, body, status, param or code in the error)
    ("completions", b"{not json", 400, None),
    ("completions", b"[1, 2]", 400, None),
    ("completions", {"prompt": "hi", "max_tokens": 4}, 400, "model"),
    ("completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("completions", {"model": NAME, "prompt": "hi", "max_tokens": "4"}, 422, "max_tokens"),
    ("completions", {"model": NAME, "prompt": "hi", "temperature": "hot"}, 422, "temperature"),
    ("completions", {"model": NAME, "prompt": 5}, 422, "prompt"),
    ("completions", {"model": NAME, "prompt": "hi", "stream": "yes"}, 422, "stream"),
    ("completions", {"model": NAME, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"model": NAME, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("completions", {"model": NAME, "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("completions", {"model": NAME, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"model": NAME, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"model": NAME, "prompt": "hi", "top_p": 1e-46}, 400, "top_p"),  # 0 as a float32
    ("completions", {"model": NAME, "prompt": "hi", "temperature": 10**400}, 400, "temperature"),  # past float
    ("completions", {"model": NAME, "prompt": "hi", "temperature": 1e39}, 400, "temperature"),  # past float32
    ("completions", {"model": NAME, "prompt": "a\ud800b"}, 400, "prompt"),  # an unpaired surrogate
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "a\udcffb"}]}, 400, "messages[0]"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2,
                          "max_tokens": "x"}, 422, "max_tokens"),  # checked though the other one wins
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi", "name": "ann"}]}, 400,
     "messages[0]"),  # the chat template has no place for a name: refused, not dropped
    ("completions", b"[" * 100_000, 400, None),  # nested past the parser's recursion
    ("completions", b'{"model": "tiny-chat", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400, None),
    ("completions", {"model": None, "prompt": "hi"}, 400, "model"),  # null is "not given", so: required
    ("completions", {"model": NAME, "prompt": None}, 400, "prompt"),
    ("chat/completions", {"model": NAME, "messages": None}, 400, "messages"),
    ("completions", {"model": NAME, "prompt": ""}, 400, "prompt"),
    ("completions", {"model": NAME, "prompt": []}, 400, "prompt"),
    ("completions", {"model": NAME, "prompt": [1, 49152]}, 400, "prompt"),
    ("completions", {"model": NAME, "prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {"model": NAME, "prompt": "hi", "n": 2}, 400, "n"),
    ("completions", {"model": NAME, "prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("completions", {"model": NAME, "prompt": "hi", "logprobs": 2}, 400, "logprobs"),
    ("completions", {"model": NAME, "prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ("completions", {"model": NAME, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("completions", {"model": NAME, "prompt": "hi", "max_tokens": CONTEXT}, 400, "context_length_exceeded"),
    ("completions", {"model": NAME, "prompt": "hi", "max_tokens": MAX_TOKENS + 1}, 400, "max_tokens"),
    ("completions", {"model": NAME, "prompt": "word " * 200, "max_tokens": 4}, 400, "context_length_exceeded"),
    ("completions", {"model": NAME, "prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("chat/completions", {"model": NAME, "messages": []}, 400, "messages"),
    ("chat/completions", {"model": NAME, "messages": "hi"}, 422, "messages"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0]"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": 3}]}, 422, "messages[0].content"),
    ("chat/completions", {"model": NAME, "prompt": "hi"}, 400, "prompt"),
    ("models/x", None, 404, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_openai_errors_and_the_server_lives_on(server, path, body, status, param):
    url = f"{server.url}/v1/{path}"
    if body is None:
        r = httpx.get(url)
    else:
        r = httpx.post(url, content=body if isinstance(body, bytes) else json.dumps(body),
                       headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert param in (error["param"], error["code"]), error
    assert httpx.get(server.url + "/health").status_code == 200


def test_openai_client_raises_the_matching_errors(server):
    with pytest.raises(openai.NotFoundError, match="does not exist here"):
        server.client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="'temperature' must be 0"):
        server.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                              temperature=-1)


def test_64_concurrent_requests_all_complete_and_equal_offline(server, chat_model):
    requests = _requests(64, seed=7)
    for r in requests:
        r["ids"] = _ids(chat_model, r)
    offline = _offline(chat_model, requests)
    before = {k: server.metric(f'specjax_requests_total{{outcome="{k}"}}') for k in ("stop", "length")}
    generated_before = server.metric("specjax_generation_tokens_total")
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda r: _call(server, r), requests))
    assert len(results) == 64
    for i, (r, tokens, got) in enumerate(zip(requests, offline, results)):
        assert got == _expected(chat_model, tokens, r["max_tokens"]), f"request {i}: {r}"
    after = {k: server.metric(f'specjax_requests_total{{outcome="{k}"}}') for k in ("stop", "length")}
    assert sum(after.values()) - sum(before.values()) == 64
    assert server.metric("specjax_generation_tokens_total") - generated_before == sum(g[2] for g in results)
    assert server.metric("specjax_queue_length") == 0 and server.metric("specjax_busy_slots") == 0


@pytest.fixture(scope="module")
def one_slot(chat_dir, tmp_path_factory):
    """One slot, a queue of one, no speculation (one token per pass: a long request stays running)."""
    s = Server(chat_dir, str(tmp_path_factory.mktemp("serve1")), "--slots", "1", "--max-queue", "1", "--max-tokens",
               str(LONG), "--drafter", "none", "--shutdown-grace", "1")
    yield s
    s.close()


LONG_BODY = {"model": NAME, "prompt": "the river", "max_tokens": LONG, "temperature": 0}


def test_a_client_that_leaves_mid_stream_frees_its_slot(one_slot):
    s = one_slot
    cancelled = s.metric('specjax_requests_total{outcome="cancelled"}')
    with httpx.stream("POST", s.url + "/v1/completions", json=dict(LONG_BODY, stream=True), timeout=60) as r:
        assert next(r.iter_lines()).startswith("data: ")  # generation has started; now leave
    deadline = time.time() + 30
    while httpx.get(s.url + "/health").json()["busy_slots"] != 0 and time.time() < deadline:
        time.sleep(0.02)
    assert httpx.get(s.url + "/health").json()["busy_slots"] == 0
    assert s.metric('specjax_requests_total{outcome="cancelled"}') == cancelled + 1
    assert s.metric("specjax_generation_tokens_total") < LONG  # it was stopped, not run to the end


def test_a_client_that_leaves_a_whole_response_request_frees_its_slot(one_slot):
    """Non-streaming: nothing is written until the end, so the server polls for the disconnect while
    tokens flow; the request is cancelled in the engine long before its max_tokens."""
    s = one_slot
    cancelled = s.metric('specjax_requests_total{outcome="cancelled"}')
    generated = s.metric("specjax_generation_tokens_total")
    body = json.dumps(LONG_BODY).encode()
    with socket.create_connection(("127.0.0.1", s.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.time() + 60
        while httpx.get(s.url + "/health").json()["busy_slots"] != 1 and time.time() < deadline:
            time.sleep(0.02)
        assert httpx.get(s.url + "/health").json()["busy_slots"] == 1, s.output()
        time.sleep(0.5)  # tokens are flowing
    deadline = time.time() + 30
    while httpx.get(s.url + "/health").json()["busy_slots"] != 0 and time.time() < deadline:
        time.sleep(0.02)
    assert httpx.get(s.url + "/health").json()["busy_slots"] == 0
    assert s.metric('specjax_requests_total{outcome="cancelled"}') == cancelled + 1
    assert s.metric("specjax_generation_tokens_total") - generated < LONG  # stopped, not run to the end


def test_full_queue_answers_429_and_sigterm_ends_everything_cleanly(one_slot):
    """The first request runs, the second waits, the third is refused with 429. SIGTERM then fails the
    waiting one with a 503 at once, ends the running stream (finished, or failed with a clear error
    event after the grace period) and the process exits."""
    s = one_slot
    with httpx.stream("POST", s.url + "/v1/completions", json=dict(LONG_BODY, stream=True), timeout=60) as running:
        events = running.iter_lines()
        assert next(events).startswith("data: ")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(httpx.post, s.url + "/v1/completions", json=dict(LONG_BODY, max_tokens=4),
                                  timeout=60)
            deadline = time.time() + 30
            while s.metric("specjax_queue_length") < 1 and time.time() < deadline:
                time.sleep(0.02)
            refused = httpx.post(s.url + "/v1/completions", json=LONG_BODY, timeout=60)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full", refused.text
            t0 = time.time()
            s.proc.send_signal(signal.SIGTERM)
            w = waiting.result(timeout=30)
            assert w.status_code == 503 and w.json()["error"]["code"] == "shutting_down", w.text
        tail = [line for line in events if line.startswith("data: ")]
    assert tail[-1] == "data: [DONE]"
    last = json.loads(tail[-2][len("data: "):])
    if "error" in last:
        assert last["error"]["code"] == "shutting_down" and "shut down" in last["error"]["message"]
    else:
        assert last["choices"][0]["finish_reason"] == "length"
    # uvicorn shuts down cleanly, then re-raises the signal: the status says SIGTERM, the log says how
    assert s.proc.wait(60) in (0, -signal.SIGTERM) and time.time() - t0 < 30, s.output()
    failed = 1 if "error" in last else 0  # the running request, failed at the grace period's end
    assert f"# specjax serve: stopped ({failed} running request(s) failed at shutdown)" in s.output()


@pytest.mark.parametrize("args,message", [
    (["--slots", "0"], "--slots must be >= 1, got 0"),
    (["--max-queue", "0"], "--max-queue must be >= 1"),
    (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1, got 0"),
    (["--port", "70000"], "--port must be in [1, 65535]"),
    (["--drafter", "none", "--drafter", "lookup:4"], "--drafter none turns speculation off"),
    (["--drafter", "none", "--budget", "auto"], "--drafter none drafts nothing"),
    (["--drafter", "nope:1"], "expected NAME:ARG with NAME one of"),
    (["--budget", "auto", "--drafter", "ssm:derived:1"], "--budget auto needs drafters that estimate"),
    (["--max-prompt-tokens", "1024", "--max-tokens", "1025"], f"exceeds the context window of {CONTEXT}"),
    # 10 TiB of cache: more than any host has free (specjax.memory)
    (["--slots", "10000000"], "--slots 10000000 with --max-prompt-tokens 1536 and --max-tokens 512: the KV cache of "
                              "10000000 requests x 2,560 positions needs 11.9 TiB"),
    # found only after the weights loaded before, or never
    (["--shutdown-grace", "nan"], "--shutdown-grace must be a finite number of seconds >= 0, got nan"),
    (["--expansion", "2,2", "--drafter", "lookup:auto"], "--expansion shapes SSM drafts, but no --drafter ssm:ARG"),
    (["--drafter", "lookup:depth=31,branches=2", "--drafter", "lookup:depth=31,branches=2,ngram=2"],
     "make a token tree of 125 nodes; the limit is 64"),
])
def test_bad_serve_flags_fail_before_loading(chat_dir, args, message, capsys):
    from tests.test_cli import cli_here

    code, err = cli_here(capsys, "serve", "--model", chat_dir, *args)
    assert code == 2, err
    assert message in err and "Traceback" not in err and "loading" not in err, err


def test_an_address_in_use_or_a_model_without_tokenizer_fail_before_loading(chat_dir, tiny_llama_dir):
    """Both were found after loading, compiling and measuring (an address in use: after the log had said
    "# serving ... on http://..."), with status 3 and 2."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "specjax", "serve", "--model", chat_dir, "--port", str(port),
                            "--drafter", "none"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}: Address already in use" in r.stderr, r.stderr
    assert "loading" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "specjax", "serve", "--model", tiny_llama_dir, "--drafter", "none"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "serving needs a tokenizer" in r.stderr and "loading" not in r.stderr, r.stderr


def test_a_server_of_one_token_per_request_warms_up(chat_model):
    """--max-tokens 1 (or a prompt limit one short of the window) never started: the warm-up asked for 2."""
    from specjax.serving.server import build_state, warm_up

    state = build_state(chat_model, model_name=NAME, slots=1, max_prompt_tokens=8, max_tokens=1, max_queue=1,
                        drafters=(), budget=None)
    warm_up(state.scheduler.engine)


def test_an_engine_failure_while_admitting_fails_only_that_request(chat_model, monkeypatch):
    """A prefill that raises (here: injected for one prompt) ends that request with an engine_error;
    the scheduler lives on and its batch mates get their offline tokens."""
    import asyncio

    from specjax.serving.scheduler import Failed, Finished, Tokens
    from specjax.serving.server import build_state

    state = build_state(chat_model, model_name=NAME, slots=2, max_prompt_tokens=16, max_tokens=8, max_queue=8,
                        drafters=(), budget=None)
    engine, scheduler = state.scheduler.engine, state.scheduler
    poisoned = [7, 7, 7]
    real_prefill = engine.prefill

    def prefill(prompt, *args, **kwargs):
        if list(prompt) == poisoned:
            raise RuntimeError("injected prefill failure")
        return real_prefill(prompt, *args, **kwargs)

    monkeypatch.setattr(engine, "prefill", prefill)
    greedy = specjax.SamplingParams(temperature=0.0)
    prompts = [[5, 6, 7], poisoned, [9, 10], [11]]
    want = _offline(chat_model, [dict(ids=p, max_tokens=8) for p in prompts if p != poisoned])

    async def run_all():
        loop = asyncio.get_running_loop()
        tickets = [Ticket(Submission(p, greedy, 8, state.stop_ids), loop) for p in prompts]
        for t in tickets:
            scheduler.submit(t)

        async def collect(t):
            ids = []
            while True:
                event = await t.events.get()
                if isinstance(event, Tokens):
                    ids += event.ids
                else:
                    return ids, event
        return await asyncio.gather(*(collect(t) for t in tickets))

    scheduler.start()
    try:
        results = asyncio.run(asyncio.wait_for(run_all(), 300))
    finally:
        scheduler.stop()
    ok = [r for p, r in zip(prompts, results) if p != poisoned]
    bad = results[prompts.index(poisoned)]
    assert bad[0] == [] and isinstance(bad[1], Failed) and bad[1].code == "engine_error"
    assert "injected prefill failure" in bad[1].message
    for (ids, end), tokens in zip(ok, want):
        assert isinstance(end, Finished) and ids == [int(t) for t in tokens[:len(ids)]] and ids
    assert scheduler.counts() == (0, 0)


async def _asgi(app, method: str, path: str, chunks=(), headers=(), sent=None) -> dict:
    """One request to the app in-process (ASGI). ``chunks``: the body's parts as they arrive (after them
    the client stays connected). Returns the status, headers and body, and how many parts the app read;
    ``sent`` collects the response's messages even if the app raises."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), *headers],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    parts = [{"type": "http.request", "body": c, "more_body": i + 1 < len(chunks)} for i, c in enumerate(chunks)]
    parts = parts or [{"type": "http.request", "body": b"", "more_body": False}]
    read, sent = [], [] if sent is None else sent

    async def receive():
        if len(read) < len(parts):
            read.append(parts[len(read)])
            return read[-1]
        await asyncio.Event().wait()  # the client stays connected

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return {"status": start["status"], "headers": dict(start["headers"]), "parts_read": len(read),
            "body": b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")}


def _scripted_app(tokenizer, engine=None, **limits):
    """The app over a scheduler (not started) with a scripted engine: no model, no compilation."""
    from specjax.serving.app import ServerState, create_app
    from specjax.serving.metrics import Metrics
    from specjax.serving.protocol import Limits
    from specjax.serving.scheduler import Scheduler
    from tests.test_scheduler import ScriptedEngine

    scheduler = Scheduler(engine or ScriptedEngine(end_at=3), max_queue=4)
    limits = Limits(**{"model_name": NAME, "max_prompt_tokens": 16, "max_tokens": 8, "context_window": 64,
                       "max_stop_tokens": 1, **limits})
    state = ServerState(scheduler=scheduler, metrics=Metrics(1), tokenizer=tokenizer, vocab=100, stop_ids=(2,),
                        limits=limits)
    return create_app(state), scheduler


class _FailingDecoder:
    """Decoding the generated token (the scripted engine's 7: the text of an admitted request) fails."""

    def decode(self, ids, skip_special_tokens=True):
        if 7 in ids:
            raise RuntimeError("injected decode failure")
        return "".join(chr(96 + t) for t in ids)


def _outcomes(app) -> dict:
    text = asyncio.run(_asgi(app, "GET", "/metrics"))["body"].decode()
    return {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("specjax_requests_total{")}


def test_an_error_after_admission_is_a_500_in_openai_shape():
    """A whole response whose text cannot be decoded answers 500 with OpenAI's error object, as every other
    error does, and /metrics counts it as an error, not as a client that went away."""
    app, scheduler = _scripted_app(_FailingDecoder())
    body = json.dumps({"model": NAME, "prompt": [5, 6, 8], "max_tokens": 4, "temperature": 0}).encode()
    sent = []
    scheduler.start()
    try:
        with pytest.raises(RuntimeError, match="injected decode failure"):  # re-raised for the server's log
            asyncio.run(asyncio.wait_for(_asgi(app, "POST", "/v1/completions", [body], sent=sent), 60))
    finally:
        scheduler.stop()
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert start["status"] == 500 and dict(start["headers"]).get(b"content-type") == b"application/json", body
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "internal_error" and "injected decode failure" in error["message"]
    assert _outcomes(app) == {"stop": 0, "length": 0, "cancelled": 0, "error": 1, "rejected": 0}


class _WordTokenizer:
    """SentencePiece-like: token t is the word "w<t>" after a space, and a decoded text drops its first space."""

    chat_template = "words"

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" w{t}" for t in ids)[1:]

    def __call__(self, text):
        return {"input_ids": [int(w[1:]) for w in text.split()]}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, return_dict=True):
        return {"input_ids": self(" ".join(m["content"] for m in messages))["input_ids"]}


def test_a_completion_keeps_its_leading_space_and_a_chat_answer_is_decoded_alone():
    """prompt text + completion text = the whole sequence's text (OpenAI's and vLLM's completions); a chat
    answer is the generated tokens' own text, as offline generation's."""
    app, scheduler = _scripted_app(_WordTokenizer())
    scheduler.start()
    try:
        completion = asyncio.run(asyncio.wait_for(_asgi(app, "POST", "/v1/completions", [json.dumps(
            {"model": NAME, "prompt": "w5 w6", "max_tokens": 8, "temperature": 0}).encode()]), 60))
        chat = asyncio.run(asyncio.wait_for(_asgi(app, "POST", "/v1/chat/completions", [json.dumps(
            {"model": NAME, "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 8,
             "temperature": 0}).encode()]), 60))
    finally:
        scheduler.stop()
    assert json.loads(completion["body"])["choices"][0]["text"] == " w7 w7 w7", completion
    assert json.loads(chat["body"])["choices"][0]["message"]["content"] == "w7 w7 w7", chat


def test_after_an_engine_failure_requests_are_refused_naming_it_and_the_server_exits():
    from tests.test_scheduler import ScriptedEngine

    app, scheduler = _scripted_app(_ByteFallbackTokenizer(), engine=ScriptedEngine(fail="step"))
    exits = []
    scheduler.on_failure = lambda: exits.append(True)
    body = json.dumps({"model": NAME, "prompt": [5, 6, 8], "max_tokens": 4, "temperature": 0}).encode()
    scheduler.start()
    try:
        victim = asyncio.run(asyncio.wait_for(_asgi(app, "POST", "/v1/completions", [body]), 60))
        later = asyncio.run(asyncio.wait_for(_asgi(app, "POST", "/v1/completions", [body]), 60))
    finally:
        scheduler.stop()
    assert victim["status"] == 500 and json.loads(victim["body"])["error"]["code"] == "engine_error"
    error = json.loads(later["body"])["error"]
    assert later["status"] == 503 and error["code"] == "engine_failed", later
    assert "the engine failed: RuntimeError: injected step failure" in error["message"]
    assert exits == [True] and "injected step failure" in scheduler.failure


def test_a_request_still_queued_at_shutdown_counts_as_rejected():
    import time as _time

    from tests.test_scheduler import ScriptedEngine

    app, scheduler = _scripted_app(_ByteFallbackTokenizer(), engine=ScriptedEngine(
        end_at=10**6, during_step=lambda: _time.sleep(0.005)))
    body = json.dumps({"model": NAME, "prompt": [97, 98], "max_tokens": 4, "temperature": 0}).encode()

    async def scenario():
        running = asyncio.create_task(_asgi(app, "POST", "/v1/completions", [body]))
        while scheduler.counts()[1] < 1:
            await asyncio.sleep(0.01)
        queued = asyncio.create_task(_asgi(app, "POST", "/v1/completions", [body]))
        while scheduler.counts()[0] < 1:
            await asyncio.sleep(0.01)
        scheduler.begin_shutdown()
        refused = await queued
        await asyncio.to_thread(scheduler.stop)
        return refused, await running

    scheduler.start()
    try:
        refused, failed = asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        scheduler.stop()
    assert refused["status"] == 503 and json.loads(refused["body"])["error"]["code"] == "shutting_down"
    assert failed["status"] == 503 and scheduler.failed_at_stop == 1
    outcomes = _outcomes(app)
    assert outcomes["rejected"] == 1 and outcomes["error"] == 1, outcomes  # the queued one, the running one


class _BlockingTokenizer:
    """Encoding waits until the test releases it (``timed_out`` if nobody did: the event loop was blocked)."""

    def __init__(self):
        self.entered, self.release, self.timed_out = threading.Event(), threading.Event(), None

    def __call__(self, text):
        self.entered.set()
        self.timed_out = not self.release.wait(20)
        return {"input_ids": [5, 6, 7]}

    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


def test_a_prompt_tokenizes_off_the_event_loop():
    """While one request's prompt is being tokenized (10M characters take seconds), the server still answers:
    here /health, sent after the tokenizer started and answered before it is let go."""
    tokenizer = _BlockingTokenizer()
    app, scheduler = _scripted_app(tokenizer)
    body = json.dumps({"model": NAME, "prompt": "a long prompt", "max_tokens": 2, "temperature": 0}).encode()

    async def scenario():
        first = asyncio.create_task(_asgi(app, "POST", "/v1/completions", [body]))
        assert await asyncio.to_thread(tokenizer.entered.wait, 20)
        health = await asyncio.wait_for(_asgi(app, "GET", "/health"), 20)
        tokenizer.release.set()
        return health, await asyncio.wait_for(first, 60)

    scheduler.start()
    try:
        health, done = asyncio.run(scenario())
    finally:
        scheduler.stop()
    assert tokenizer.timed_out is False, "the event loop waited for the tokenizer"
    assert health["status"] == 200 and json.loads(health["body"])["status"] == "ok"
    # the scripted engine ends every request at 3 tokens
    assert done["status"] == 200 and json.loads(done["body"])["choices"][0]["text"] == "xxx", done


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_byte_limit_is_refused_unread(chunked):
    """413 in OpenAI's shape, from Content-Length before a byte is read, or as soon as a chunked body passes
    the limit; a body of exactly the limit is served."""
    tokenizer = _BlockingTokenizer()
    tokenizer.release.set()
    ok = json.dumps({"model": NAME, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}).encode()
    cap = len(ok)
    app, scheduler = _scripted_app(tokenizer, max_request_bytes=cap)
    big = ok[:-1] + b" " * 30 + b"}"  # cap + 30 bytes, in 10-byte parts when chunked
    parts = [big[i:i + 10] for i in range(0, len(big), 10)] if chunked else [big]
    headers = () if chunked else [(b"content-length", str(len(big)).encode())]
    scheduler.start()
    try:
        refused = asyncio.run(asyncio.wait_for(_asgi(app, "POST", "/v1/completions", parts, headers), 20))
        served = asyncio.run(asyncio.wait_for(_asgi(app, "POST", "/v1/completions", [ok[:10], ok[10:]]), 60))
    finally:
        scheduler.stop()
    assert refused["status"] == 413, refused
    error = json.loads(refused["body"])["error"]
    assert error["code"] == "request_too_large" and f"at most {cap} bytes" in error["message"]
    assert "--max-request-bytes" in error["message"]
    assert refused["parts_read"] == (cap // 10 + 1 if chunked else 0)  # stopped at the first part past the limit
    assert served["status"] == 200 and json.loads(served["body"])["choices"][0]["text"] == "xxx", served


def test_the_request_byte_limit_default_is_the_one_the_help_names():
    from specjax.serving.protocol import DEFAULT_MAX_REQUEST_BYTES, Limits

    assert DEFAULT_MAX_REQUEST_BYTES == 16 * 2**20
    assert Limits(NAME, 1, 1, 2, 1).max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
    r = subprocess.run([sys.executable, "-m", "specjax", "serve", "--help"], capture_output=True, text=True,
                       timeout=300)
    assert "(default: 16 MiB)" in " ".join(r.stdout.split()), r.stdout


class _ByteFallbackTokenizer:
    """Token i < 256 is byte i; decoding gives one U+FFFD per byte of an unfinished UTF-8 character at the end,
    as the byte-fallback tokenizers of LLaMA-2 and Mistral do (SmolLM2's gives one for the whole character)."""

    def decode(self, ids, skip_special_tokens=True):
        data = bytes(ids)
        for cut in range(len(data), max(len(data) - 4, -1), -1):
            try:
                return data[:cut].decode("utf-8") + "\ufffd" * (len(data) - cut)
            except UnicodeDecodeError:
                continue
        raise AssertionError(f"not UTF-8 before its last 3 bytes: {data!r}")


@pytest.mark.parametrize("stops", [(), ("zz",)])
def test_text_holds_back_every_byte_of_an_unfinished_character(stops):
    from specjax.serving.protocol import TextTracker

    text = "a中b€c😀d"
    ids = list(text.encode("utf-8"))
    for chunk in (1, 2, 3):  # tokens arrive one, two or three at a time
        tracker = TextTracker(_ByteFallbackTokenizer(), stops)
        deltas = [tracker.feed(ids[i:i + chunk]) for i in range(0, len(ids), chunk)] + [tracker.finish()]
        assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas), (chunk, deltas)


class _RefusingTokenizer:
    """A tokenizer whose chat template refuses every conversation and whose encoder fails."""

    chat_template = "{{ raise_exception('roles must alternate') }}"

    def apply_chat_template(self, *a, **k):
        raise ValueError("roles must alternate")

    def __call__(self, text):
        raise ValueError("cannot encode")


def _parse(body, chat, tokenizer, vocab=49152):
    from specjax.serving.protocol import Limits, parse_request

    limits = Limits(model_name=NAME, max_prompt_tokens=64, max_tokens=32, context_window=256, max_stop_tokens=1)
    return parse_request(body, chat=chat, limits=limits, tokenizer=tokenizer, vocab=vocab, stop_ids=(2,))


def test_tokenizer_and_template_failures_are_400_errors_naming_the_field(chat_model):
    from specjax.serving.protocol import APIError

    with pytest.raises(APIError, match="chat template refused 'messages'.*roles must alternate") as e:
        _parse({"model": NAME, "messages": [{"role": "user", "content": "hi"}]}, True, _RefusingTokenizer())
    assert e.value.status == 400 and e.value.param == "messages"
    with pytest.raises(APIError, match="'prompt' could not be tokenized.*cannot encode") as e:
        _parse({"model": NAME, "prompt": "hi"}, False, _RefusingTokenizer())
    assert e.value.status == 400 and e.value.param == "prompt"
    # a tokenizer with more tokens than the model's vocabulary: refused, never clipped
    with pytest.raises(APIError, match="outside the model's vocabulary") as e:
        _parse({"model": NAME, "prompt": "hello there"}, False, chat_model.tokenizer, vocab=10)
    assert e.value.status == 400
    assert _parse({"model": NAME, "prompt": "hi"}, False, chat_model.tokenizer).submission.max_new_tokens == 16
    assert _parse({"model": NAME, "messages": [{"role": "user", "content": "hi"}]}, True,
                  chat_model.tokenizer).submission.max_new_tokens == 32


@pytest.mark.parametrize("context,given,want", [
    (8192, (None, None), (2048, 512)),
    (2048, (None, None), (1536, 512)),
    (512, (None, None), (256, 256)),
    (512, (400, None), (400, 112)),
    (512, (None, 100), (412, 100)),
    (2048, (1024, 1025), (1024, 1025)),  # given values are kept (and then refused by the window check)
])
def test_serve_length_defaults_fit_the_context_window(context, given, want):
    import argparse

    from specjax.cli.serve import _lengths

    args = argparse.Namespace(max_prompt_tokens=given[0], max_tokens=given[1])
    _lengths(args, context)
    assert (args.max_prompt_tokens, args.max_tokens) == want
