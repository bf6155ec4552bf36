"""The openai generation backend over several endpoints, against fake vLLM-like HTTP servers (no model): spreading,
per-endpoint concurrency, seeds independent of the server, the adapter loaded everywhere, a failing server dropped
and its prompts retried elsewhere, start checks and the config's validation. test_vllm.py runs two real servers."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pipeline.config import ConfigError, GeneratorConfig, config_from_dict
from pipeline.engines.generation import GenerationError, Sampling, make_generator
from pipeline.engines.generation.openai_server import OpenAIGenerator

MODEL = "embedded:smollm2-135m-instruct"


class FakeVLLM:
    """Serves `smol`: /version, /v1/models, /v1/load_lora_adapter and /v1/completions, whose token ids are
    (seed + choice, prompt length): an answer depends on the request only. `fail`: completions answer this status."""

    def __init__(self, fail: int | None = None, vllm: bool = True, delay_s: float = 0.05):
        self.fail, self.vllm, self.delay_s = fail, vllm, delay_s
        self.completions: list[dict] = []
        self.adapters: list[str] = []
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/v1"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def _handler(self):
        srv = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/version" and srv.vllm:
                    return self.reply(200, {"version": "fake"})
                if self.path == "/v1/models":
                    ids = ["smol", *srv.adapters]
                    return self.reply(200, {"object": "list", "data": [
                        {"id": i, "object": "model", "created": 0, "owned_by": "fake"} for i in ids]})
                self.reply(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/v1/load_lora_adapter":
                    srv.adapters.append(body["lora_name"])
                    return self.reply(200, {})
                with srv.lock:
                    srv.completions.append(body)
                    srv.in_flight += 1
                    srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
                time.sleep(srv.delay_s)
                with srv.lock:
                    srv.in_flight -= 1
                if srv.fail:
                    return self.reply(srv.fail, {"error": {"message": "boom"}})
                self.reply(200, {"id": "c", "object": "text_completion", "created": 0, "model": body["model"],
                                 "choices": [srv.choice(body, j) for j in range(body["n"])]})

        return H

    @staticmethod
    def choice(body: dict, j: int) -> dict:
        ids = [body["seed"] + j, len(body["prompt"])]
        return {"index": j, "text": "ok", "finish_reason": "length", "token_ids": ids,
                "logprobs": {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": [-0.5, -0.25],
                             "text_offset": [0, 1], "top_logprobs": None}}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    made: list[FakeVLLM] = []

    def make(**kw) -> FakeVLLM:
        made.append(FakeVLLM(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.fixture
def adapter(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")  # adapter_id only checks the folder is a peft one
    return str(tmp_path)


PROMPTS = [f"prompt {'x' * i}" for i in range(8)]
SAMPLING = Sampling(n=2, temperature=1.0, max_new_tokens=4, seed=5)


def generator(*urls: str, **kw) -> OpenAIGenerator:
    return OpenAIGenerator(MODEL, list(urls), concurrency=kw.pop("concurrency", 2), max_retries=0, **kw)


def ids(rows) -> list[list[list[int]]]:
    return [[c.token_ids for c in row] for row in rows]


def test_prompts_spread_with_the_seeds_of_one_server(servers, adapter):
    a, b, solo = servers(), servers(), servers()
    with generator(a.url, b.url) as gen:
        rows = gen.generate(PROMPTS, SAMPLING, adapter)
    assert len(a.completions) > 0 and len(b.completions) > 0
    assert len(a.completions) + len(b.completions) == len(PROMPTS)
    assert a.max_in_flight <= 2 and b.max_in_flight <= 2  # concurrency is per endpoint
    assert a.adapters == b.adapters and len(a.adapters) == 1  # loaded once on each
    assert {r["model"] for r in a.completions + b.completions} == {a.adapters[0]}
    with generator(solo.url) as one:
        assert ids(rows) == ids(one.generate(PROMPTS, SAMPLING, adapter))  # same seeds, same order
    assert sorted(r["seed"] for r in a.completions + b.completions) == sorted(r["seed"] for r in solo.completions)
    c = rows[0][1]
    assert c.token_logprobs == [-0.5, -0.25] and not c.retokenized and c.finish_reason == "length"


def test_two_calls_sampled_as_one_keep_their_seeds(servers):
    """Sampling.seeds: prompts of two calls sent in one keep the seeds their own calls gave them (rollout.choice_step
    writes several batches' workflows in one call this way); seeds that do not match the prompts are refused."""
    solo = servers()
    with generator(solo.url) as gen:
        first, second = SAMPLING, replace(SAMPLING, seed=90)
        apart = gen.generate(PROMPTS[:3], first) + gen.generate(PROMPTS[3:], second)
        sent_apart = [r["seed"] for r in solo.completions]
        seeds = tuple(first.prompt_seed(i) for i in range(3)) + tuple(second.prompt_seed(i) for i in range(5))
        assert seeds[:4] == (5, 7, 9, 90)  # seed + i * n, n = 2
        merged = gen.generate(PROMPTS, replace(SAMPLING, seeds=seeds))
        assert ids(merged) == ids(apart)
        assert sorted(r["seed"] for r in solo.completions[len(sent_apart):]) == sorted(sent_apart)
        with pytest.raises(GenerationError, match="3 seeds for 8 prompts"):
            gen.generate(PROMPTS, replace(SAMPLING, seeds=seeds[:3]))


def test_light_load_still_reaches_every_endpoint(servers):
    a, b = servers(), servers()
    with generator(a.url, b.url, concurrency=1) as gen:
        for p in PROMPTS[:4]:  # one prompt at a time: ties go to the endpoint that served least
            gen.generate([p], SAMPLING)
    assert len(a.completions) == len(b.completions) == 2


def test_failing_endpoint_is_dropped_and_its_prompts_retried(servers, caplog):
    good, bad = servers(), servers(fail=503)
    with caplog.at_level(logging.WARNING,
                         "pipeline.engines.generation.openai_server"), generator(bad.url, good.url) as gen:
        rows = gen.generate(PROMPTS, SAMPLING)
        assert [ep.failed is not None for ep in gen.endpoints] == [True, False]
        gen.generate(PROMPTS[:2], SAMPLING)  # stays dropped
    lens = [len(row[0].prompt_token_ids) for row in rows]
    assert ids(rows) == [[[5 + 2 * i, k], [6 + 2 * i, k]] for i, k in enumerate(lens)]  # every prompt, its seeds
    assert len(good.completions) == len(PROMPTS) + 2 and 1 <= len(bad.completions) <= 2  # in flight when it failed
    assert f"generator endpoint {bad.url} failed" in caplog.text


def test_no_endpoint_left_is_an_error_naming_each(servers):
    a, b = servers(fail=500), servers(fail=502)
    with generator(a.url, b.url) as gen, pytest.raises(GenerationError, match="every generator endpoint failed") as e:
        gen.generate(PROMPTS, SAMPLING)
    assert a.url in str(e.value) and b.url in str(e.value) and "re-run" in str(e.value)


def test_a_bad_request_is_not_retried_elsewhere(servers):
    a, b = servers(fail=400), servers()
    with generator(a.url, b.url, concurrency=1) as gen, pytest.raises(GenerationError, match="failed a request"):
        gen.generate(PROMPTS[:1], SAMPLING)
    assert not b.completions


def test_start_checks_name_the_endpoint(servers):
    a = servers()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with pytest.raises(GenerationError, match=f"{down} is not reachable"):
        generator(a.url, down)
    with pytest.raises(GenerationError, match="mix vLLM and other servers"):
        generator(a.url, servers(vllm=False).url)
    with pytest.raises(GenerationError, match="needs generator.base_url or generator.endpoints"):
        OpenAIGenerator(MODEL, [])


def test_make_generator_takes_endpoints(servers):
    a, b = servers(), servers()
    with make_generator(GeneratorConfig(model=MODEL, backend="openai", endpoints=[a.url, b.url])) as gen:
        assert gen.urls == [a.url, b.url] and gen.concurrency == 8 and gen.is_vllm and gen.model == "smol"


@pytest.mark.parametrize(("generator_cfg", "error"), [
    ({"backend": "openai"}, "not neither"),
    ({"backend": "openai", "base_url": "http://a:1/v1", "endpoints": ["http://b:1/v1"]}, "not both"),
    ({"backend": "openai", "endpoints": ["localhost:8000/v1"]}, "'localhost:8000/v1' is not an http"),
    ({"backend": "openai", "endpoints": ["http://a:99999/v1"]}, "is not an http"),
    ({"base_url": "ftp://a/v1"}, "generator.base_url: .*is not an http"),
    ({"backend": "openai", "endpoints": ["http://a:1/v1", "http://a:1/v1/"]}, "listed twice"),
])
def test_endpoints_config_is_validated(generator_cfg, error):
    with pytest.raises(ConfigError, match=error):
        config_from_dict({"generator": generator_cfg})


def test_endpoints_config_accepted():
    cfg = config_from_dict({"generator": {"backend": "openai", "endpoints": ["http://h1:8000/v1", "https://h2/v1"]}})
    assert cfg.generator.endpoints == ["http://h1:8000/v1", "https://h2/v1"]
    assert GeneratorConfig(endpoints=[]).endpoints == []  # other backends: nothing needed
