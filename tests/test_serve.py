"""`deepinfer serve` against the official openai client on a live server (uvicorn on a free port):
completions, chat, streaming, stop strings, seeds, logprobs, error shapes and codes, limits, and a
load test of 64 concurrent streaming clients, a quarter of them cancelled mid-stream."""
from __future__ import annotations

import asyncio
import random
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

import deepinfer  # noqa: E402
from deepinfer.engine import Engine, default_model_dir  # noqa: E402
from deepinfer.serve import build  # noqa: E402
from deepinfer.serve.app import ServerLimits  # noqa: E402

NAME = "deepseek-v3-nano"
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, item):", "for i in range(10):",
           "with open(path) as f:\n", "x = [1, 2, 3]\ny =", "# sort a list\n", "try:\n    import numpy"]


def _config():
    cpu = [c for c in deepinfer.candidates() if c.ok and c.name == "cpu"]
    return {"backend": "cpu" if cpu else "reference", "precision": "f32", "max_batch": 16, "max_seq_len": 256,
            "max_queue": 200}


class LiveServer:
    def __init__(self, config, limits=None, model=None):
        self.app, self.aengine = build(model, config, limits, NAME, drain_timeout=5)
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            assert time.time() - t0 < 60 and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def server():
    s = LiveServer(_config(), ServerLimits(max_body_bytes=64 << 10, max_prompt_tokens=200))
    yield s
    s.stop()
    assert not s.aengine._thread.is_alive()      # shutdown stops the engine thread


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def offline():
    return Engine.from_pretrained(default_model_dir(), config={**_config(), "enable_prefix_cache": False})


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    text = httpx.get(server.url + "/metrics").text
    for name in ("deepinfer_requests_running", "deepinfer_requests_waiting", "deepinfer_kv_blocks_used",
                 "deepinfer_generation_tokens_per_second", "deepinfer_time_to_first_token_seconds_bucket",
                 "deepinfer_time_per_output_token_seconds_bucket"):
        assert name in text


def test_completion_greedy_equals_offline_generate(client, offline):
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    assert r.choices[0].text == offline.generate(PROMPTS[0], max_new_tokens=16)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPTS[0])) and r.usage.completion_tokens <= 16


def test_streaming_equals_non_streaming(client):
    full = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=20, temperature=0).choices[0].text
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=20, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full and len(chunks) > 2
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_chat_and_chat_streaming(client, offline):
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == offline.chat(msgs, max_new_tokens=8)
    parts = []
    usage = None
    for c in client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}):
        if c.choices:
            parts.append(c.choices[0].delta.content or "")
        else:
            usage = c.usage
    assert "".join(parts) == r.choices[0].message.content and usage.completion_tokens == r.usage.completion_tokens


def test_stop_strings(client):
    full = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=24, temperature=0).choices[0].text
    stop = full.strip()[2:5]
    if len(stop) < 3:
        pytest.skip("continuation too short")
    r = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_seed_reproducible_and_n(client):
    a = client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=12, temperature=1.0, seed=7, n=2)
    b = client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=12, temperature=1.0, seed=7, n=2)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 2
    assert [c.index for c in a.choices] == [0, 1]


def test_logprobs(client):
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == 4 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) == 3 and max(t.values()) == pytest.approx(l, abs=1e-5)
               for t, l in zip(lp.top_logprobs, lp.token_logprobs))         # greedy: the chosen token is the top one


def test_errors_have_the_openai_shape(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", max_tokens=10_000)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="x", presence_penalty=5)     # outside [-2, 2]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="x", temperature=-1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="x " * 400)                 # > max_prompt_tokens
    r = httpx.post(server.url + "/v1/completions", content=b"{" + b" " * (70 << 10) + b"}",
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(server.url + "/v1/completions", content=b"not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    assert httpx.get(server.url + "/v1/nothing").status_code == 404


def test_queue_full_is_503():
    s = LiveServer({**_config(), "max_queue": 0})
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=NAME, prompt="x", max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
    finally:
        s.stop()


def test_64_concurrent_streaming_clients_with_cancellations(server, offline):
    """Random prompts and lengths; every fourth client hangs up mid-stream. Every other request
    completes with exactly its own greedy text, and the KV blocks all come back."""
    rng = random.Random(1)
    jobs = []
    for i in range(64):
        p = rng.choice(PROMPTS) + rng.choice(["", " ", "\n", "  # note\n", "(x)"]) * rng.randint(0, 3)
        jobs.append((i, p, rng.randint(4, 24), i % 4 == 3))
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)

    async def one(i, prompt, n, cancel):
        stream = await aclient.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0, stream=True)
        text, got = "", 0
        async for chunk in stream:
            text += chunk.choices[0].text
            got += 1
            if cancel and got >= 2:
                await stream.close()           # hang up mid-stream
                return i, None
        return i, text

    async def main():
        return await asyncio.gather(*(one(*j) for j in jobs))

    results = dict(asyncio.run(main()))
    # the same requests offline, all queued at once on another engine (no server, no prefix cache)
    rid = {offline.add_request(p, max_new_tokens=n): i for i, p, n, cancel in jobs if not cancel}
    want = {i: "" for i in rid.values()}
    while offline.has_unfinished():
        for o in offline.step():
            want[rid[o.request_id]] += o.text
    for i, p, n, cancel in jobs:
        if not cancel:
            assert results[i] == want[i], (i, p, n)
    t0 = time.time()
    while time.time() - t0 < 30:       # aborts reach the engine thread between steps
        s = server.aengine.snapshot()
        if s["kv_blocks_used"] == 0 and s["running"] == 0 and s["waiting"] == 0:
            break
        time.sleep(0.1)
    s = server.aengine.snapshot()
    assert (s["kv_blocks_used"], s["running"], s["waiting"]) == (0, 0, 0)
    assert s["requests_aborted"] >= 1


def test_cli_serve_answers_then_stops_cleanly_on_sigterm():
    """`deepinfer serve` as users start it: binds 127.0.0.1, answers, and exits 0 on SIGTERM after
    finishing the request that was running."""
    import os
    import signal
    import subprocess
    import sys

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    cfg = _config()
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer.cli", "serve", "--port", str(port), "--backend",
                             cfg["backend"], "--precision", "f32", "--max-seq-len", "256", "--drain-timeout", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        t0 = time.time()
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() - t0 < 120, "server did not come up"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        models = c.models.list().data
        out = {}

        def long_request():
            out["r"] = c.completions.create(model=models[0].id, prompt="def f(x):", max_tokens=120, temperature=0,
                                            extra_body={"ignore_eos": True})

        th = threading.Thread(target=long_request)
        th.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        th.join(timeout=60)
        assert out["r"].usage.completion_tokens == 120          # the running request finished
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)


def test_metrics_with_an_expert_cache():
    """With expert_cache on, /metrics carries its counters, and they move once a request ran."""
    s = LiveServer({**_config(), "precision": "bf16", "max_batch": 2, "expert_cache": {"capacity": 0.5}})
    try:
        r = httpx.post(s.url + "/v1/completions", json={"model": NAME, "prompt": "def f(x):", "max_tokens": 8,
                                                        "temperature": 0}, timeout=60)
        assert r.status_code == 200
        text = httpx.get(s.url + "/metrics").text
        vals = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith("deepinfer_expert_cache_")}
        assert vals["deepinfer_expert_cache_hits"] + vals["deepinfer_expert_cache_misses"] > 0
        assert vals["deepinfer_expert_cache_bytes_streamed"] > 0 and 0 < vals["deepinfer_expert_cache_hit_ratio"] <= 1
    finally:
        s.stop()


def test_completions_with_speculative_decoding():
    """The server with speculation on: the same greedy text as without, and /metrics carries its counters."""
    plain = LiveServer({**_config(), "max_batch": 2})
    try:
        want = httpx.post(plain.url + "/v1/completions", json={"model": NAME, "prompt": "def f(x):", "max_tokens": 12,
                                                               "temperature": 0}, timeout=60).json()
    finally:
        plain.stop()
    s = LiveServer({**_config(), "max_batch": 2, "speculative": {"method": "mtp", "num_draft": 2, "confidence": 0.0}})
    try:
        r = httpx.post(s.url + "/v1/completions", json={"model": NAME, "prompt": "def f(x):", "max_tokens": 12,
                                                        "temperature": 0}, timeout=60)
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == want["choices"][0]["text"]
        assert r.json()["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
        text = httpx.get(s.url + "/metrics").text
        vals = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith("deepinfer_spec_")}
        assert vals["deepinfer_spec_steps"] > 0 and vals["deepinfer_spec_drafts_verified"] > 0
        assert 0 < vals['deepinfer_spec_acceptance{position="1"}'] <= 1
    finally:
        s.stop()
