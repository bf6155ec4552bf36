"""Executors: the openai client against a real local HTTP server that injects faults (refused connections,
500, 429 + Retry-After, responses slower than the timeout, malformed JSON), the backoff (tenacity, Retry-After), and
the local executor on the embedded model."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import free_port

from pipeline.config import ExecutorConfig, PriceConfig
from pipeline.engines.executors import (
    ExecutorError,
    ExecutorReply,
    LocalExecutor,
    OpenAIExecutor,
    RequestRefused,
    RetryAfterWait,
    SequenceWindow,
    cost_usd,
    make_executor,
    parse_retry_after,
)


class InFlight:
    """Requests in flight at once over one or more FaultServers. In `hold` mode a request waits until `target`
    requests have been in flight together (at most `wait_s`), and then `linger_s` more, in which a request
    beyond the target would arrive and show: their overlap does not depend on timing, an excess hardly can."""

    def __init__(self, target: int, linger_s: float = 0.3, wait_s: float = 10.0):
        self.cond = threading.Condition()
        self.now = self.max = 0
        self.reached: float | None = None  # when `target` were first in flight together
        self.target, self.linger_s, self.wait_s = target, linger_s, wait_s

    def enter(self) -> None:
        with self.cond:
            self.now += 1
            self.max = max(self.max, self.now)
            if self.reached is None and self.max >= self.target:
                self.reached = time.monotonic()
            self.cond.notify_all()

    def leave(self) -> None:
        with self.cond:
            self.now -= 1

    def hold(self) -> None:
        deadline = time.monotonic() + self.wait_s
        with self.cond:
            while time.monotonic() < deadline and self.max <= self.target and (
                    self.reached is None or time.monotonic() < self.reached + self.linger_s):
                self.cond.wait(0.05)


class FaultServer:
    """OpenAI-compatible /v1/chat/completions on 127.0.0.1. Each request takes the next mode from
    `script` (then `default`): ok | 500 | 429 | slow | hold | malformed | drop | 400 (`hold`: see InFlight)."""

    def __init__(self, default: str = "ok", slow_s: float = 1.5, gauge: InFlight | None = None):
        self.script: list[str] = []
        self.default, self.slow_s, self.gauge = default, slow_s, gauge
        self.reply: str | None = None  # fixed completion text instead of the echo
        self.finish_reason = "stop"  # "length": every choice stopped at the token cap
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    mode = outer.script.pop(0) if outer.script else outer.default
                    outer.requests.append({"mode": mode, "body": body})
                if outer.gauge:
                    outer.gauge.enter()
                try:
                    outer.respond(self, mode, body)
                finally:
                    if outer.gauge:
                        outer.gauge.leave()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def respond(self, h: BaseHTTPRequestHandler, mode: str, body: dict) -> None:
        def send(code: int, payload: bytes, headers: dict | None = None) -> None:
            h.send_response(code)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(payload)))
            for k, v in (headers or {}).items():
                h.send_header(k, v)
            h.end_headers()
            h.wfile.write(payload)

        if mode == "drop":
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if mode == "slow":
            time.sleep(self.slow_s)
            mode = "ok"
        if mode == "hold":
            self.gauge.hold()
            mode = "ok"
        if mode == "500":
            return send(500, b'{"error": {"message": "boom"}}')
        if mode == "400":
            return send(400, b'{"error": {"message": "bad request"}}')
        if mode == "429":
            return send(429, b'{"error": {"message": "slow down"}}', {"Retry-After": "1"})
        if mode == "malformed":
            return send(200, b'{"choices": [ this is not json')
        last = body["messages"][-1]["content"]
        n, seed = body.get("n") or 1, body.get("seed")

        def text(i: int) -> str:  # a seeded request says which seed sample i drew (vLLM: seed + i)
            return self.reply or f"echo {i}: {last}" + ("" if seed is None else f" (seed {seed + i})")

        out = {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
               "choices": [{"index": i, "message": {"role": "assistant", "content": text(i)},
                            "finish_reason": self.finish_reason} for i in range(n)],
               "usage": {"prompt_tokens": 7, "completion_tokens": 3 * n, "total_tokens": 7 + 3 * n}}
        send(200, json.dumps(out).encode())

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = FaultServer()
    yield s
    s.close()


@pytest.fixture
def top_jitter(monkeypatch):
    """tenacity's jitter draw pinned at the top of its range: the retry delays are the backoff schedule itself,
    0.5 * 2**(attempt - 1), or a larger Retry-After."""
    import random

    monkeypatch.setattr(random, "uniform", lambda lo, hi: hi)


def executor(url: str | list[str], sleeps: list | None = None, **kw) -> OpenAIExecutor:
    urls = url if isinstance(url, list) else [url]
    cfg = ExecutorConfig(kind="openai", model="m", base_url=urls[0], endpoints=urls if len(urls) > 1 else [],
                         timeout_s=kw.pop("timeout_s", 0.5), max_retries=kw.pop("max_retries", 2),
                         prices=PriceConfig(input_per_mtok=1.0, output_per_mtok=2.0), **kw)

    async def fake_sleep(d):
        if sleeps is not None:
            sleeps.append(d)

    return OpenAIExecutor(cfg, sleep=fake_sleep)


def complete(ex, *args, **kw) -> ExecutorReply:
    async def go():
        try:
            return await ex.complete(*args, **kw)
        finally:
            await ex.aclose()
    return asyncio.run(go())


MSG = [{"role": "user", "content": "hi"}]


def test_ok_completion_usage_and_cost(server):
    c = complete(executor(server.url), MSG, n=2, temperature=0.7)
    assert c.texts == ["echo 0: hi", "echo 1: hi"]
    assert (c.tokens_in, c.tokens_out) == (7, 6)
    assert c.cost_usd == pytest.approx((7 * 1.0 + 6 * 2.0) / 1e6)
    body = server.requests[0]["body"]
    assert body["temperature"] == 0.7 and body["max_tokens"] == 256 and body["model"] == "m" and body["n"] == 2


def test_greedy_n_is_asked_once(server):
    c = complete(executor(server.url), MSG, n=3)
    assert c.texts == ["echo 0: hi"] * 3 and c.tokens_out == 3
    body = server.requests[0]["body"]
    assert body["temperature"] == 0.0 and body["n"] == 1


def timeout_for(fault: str) -> float:
    """The call timeout of a fault test: below the slow fault's 1.5 s (that fault is a timeout), and far above an
    immediate reply for the others, so a loaded machine's late reply is never taken for a timeout."""
    return 0.5 if fault == "slow" else 10.0


@pytest.mark.parametrize("fault", ["500", "429", "slow", "malformed", "drop"])
def test_fault_is_retried_then_succeeds(server, fault, top_jitter):
    sleeps: list[float] = []
    server.script = [fault]
    c = complete(executor(server.url, sleeps, timeout_s=timeout_for(fault)), MSG)
    assert c.texts == ["echo 0: hi"]
    assert [r["mode"] for r in server.requests] == [fault, "ok"]
    # one backoff of attempt 0: 0.5 s; the 429's Retry-After (1 s) is a floor above it
    assert sleeps == ([1.0] if fault == "429" else [0.5])


@pytest.mark.parametrize("fault", ["500", "429", "malformed"])
def test_persistent_fault_gives_executor_error(server, fault, top_jitter):
    server.default = fault
    sleeps: list[float] = []
    with pytest.raises(ExecutorError, match="gave up after 3 attempts") as failed:
        complete(executor(server.url, sleeps, max_retries=2, timeout_s=timeout_for(fault)), MSG)
    assert not failed.value.refused  # an outage: the run waits for a re-score, it is not the workflow's error
    assert len(server.requests) == 3
    assert sleeps == ([1.0, 1.0] if fault == "429" else [0.5, 1.0])  # attempts 0, 1; Retry-After 1 s floors both


def test_a_reply_slower_than_the_timeout_is_asked_again_with_twice_the_time(server, top_jitter):
    """Every reply takes 1.5 s, the call timeout is 0.5 s: attempts get 0.5, 1, 2 and 4 s; the first two cannot
    see the reply, the third does (or, on a loaded machine, the fourth). With one retry (0.5 and 1 s) it never
    arrives. A fixed timeout failed every attempt of such a call."""
    server.default = "slow"
    c = complete(executor(server.url, [], max_retries=3, timeout_s=0.5), MSG)
    assert c.texts == ["echo 0: hi"] and len(server.requests) in (3, 4)
    server.requests.clear()
    with pytest.raises(ExecutorError, match="gave up after 2 attempts"):
        complete(executor(server.url, [], max_retries=1, timeout_s=0.5), MSG)
    assert len(server.requests) == 2


def test_connection_refused_is_retried_then_fails(top_jitter):
    sleeps: list[float] = []
    with pytest.raises(ExecutorError, match="APIConnectionError"):
        complete(executor(f"http://127.0.0.1:{free_port()}/v1", sleeps, max_retries=3), MSG)
    assert sleeps == [0.5, 1.0, 2.0]


def test_client_error_is_not_retried(server):
    server.default = "400"
    with pytest.raises(RequestRefused, match="BadRequestError") as refused:
        complete(executor(server.url), MSG)
    assert len(server.requests) == 1
    assert server.url.split("/v1")[0] not in str(refused.value)  # told to the workflow: not the server's address


def test_concurrency_limit_and_endpoint_spreading():
    # the first requests are held until two are in flight together, then a little longer: a limit of 2 reaches 2
    # whatever the timing, a missing or larger limit lets a third in meanwhile, a limit of 1 never gets to 2
    gauge = InFlight(target=2)
    a, b = FaultServer(default="hold", gauge=gauge), FaultServer(default="hold", gauge=gauge)
    try:
        ex = executor([a.url, b.url], timeout_s=20, concurrency=2)

        async def go():
            try:
                return await asyncio.gather(*(ex.complete(MSG) for _ in range(6)))
            finally:
                await ex.aclose()
        assert [c.texts for c in asyncio.run(go())] == [["echo 0: hi"]] * 6
        assert len(a.requests) == len(b.requests) == 3  # round robin
        assert gauge.max == 2  # over both servers: the global limit, reached and never exceeded
    finally:
        a.close()
        b.close()


def test_a_request_for_n_samples_takes_n_of_the_concurrency_slots():
    """executor.concurrency counts sequences on the server: with 4 slots, requests for 2 samples go 2 at a time
    (counted as one each, 4 would be in flight: 8 sequences)."""
    gauge = InFlight(target=2, wait_s=2.0)
    server = FaultServer(default="hold", gauge=gauge)
    try:
        ex = executor(server.url, timeout_s=20, concurrency=4)

        async def go():
            try:
                return await asyncio.gather(*(ex.complete(MSG, temperature=0.7, n=2) for _ in range(6)))
            finally:
                await ex.aclose()
        assert [c.texts for c in asyncio.run(go())] == [["echo 0: hi", "echo 1: hi"]] * 6
        assert [r["body"]["n"] for r in server.requests] == [2] * 6
        assert gauge.max == 2  # two requests of 2 fill the 4 slots; a third never joins them
    finally:
        server.close()


def test_the_sequence_window_halves_once_per_epoch_and_widens_by_one_per_window():
    async def go():
        w = SequenceWindow(32)
        epochs = [await w.acquire(4) for _ in range(8)]  # 32 sequences in flight, all in epoch 0
        assert epochs == [0] * 8 and w.used == 32
        await w.release(4, 0, timed_out=True)  # the first timeout of epoch 0: 32 -> 16
        assert (w.limit, w.epoch) == (16, 1)
        await w.release(4, 0, timed_out=True)  # the same wave's timeout: no second halving
        assert (w.limit, w.epoch) == (16, 1)
        for _ in range(6):  # 24 sequences finish: the window widens by one per 16 (16 -> 17, then 8 counted)
            await w.release(4, 0, timed_out=False)
        assert (w.limit, w.used) == (17, 0)
        assert await w.acquire(17) == 1 and w.used == 17  # a call started now is in epoch 1
        late = asyncio.ensure_future(w.acquire(1))  # the window is full: it waits
        for _ in range(5):
            await asyncio.sleep(0)
        assert not late.done()
        await w.release(17, 1, timed_out=True)  # a timeout of the current epoch halves again: 17 -> 8
        assert await late == 2 and w.limit == 8
        await w.release(1, 2, timed_out=False)
        assert await w.acquire(20) == 2  # larger than the window: runs alone once nothing is in flight
        assert w.used == 20
    asyncio.run(go())


class _CongestedServer:
    """A stand-in openai client: a request times out when more than `capacity` sequences were in flight at any
    time of its life (each lives a fixed number of event-loop turns: the outcome does not depend on the clock)."""

    def __init__(self, capacity: int):
        import httpx
        import openai

        self.capacity, self.live, self.calls = capacity, [], 0
        self.base_url = "http://congested/v1"
        self.error = openai.APITimeoutError(request=httpx.Request("POST", self.base_url))
        self.chat = type("Chat", (), {"completions": type("C", (), {"create": self.create})()})()

    async def create(self, model, messages, temperature, n, max_tokens, **kw):
        from types import SimpleNamespace

        self.calls += 1
        me = {"n": n, "max": 0}
        self.live.append(me)
        for _ in range(20):
            now = sum(r["n"] for r in self.live)
            for r in self.live:
                r["max"] = max(r["max"], now)
            await asyncio.sleep(0)
        self.live.remove(me)
        if me["max"] > self.capacity:
            raise self.error
        choice = SimpleNamespace(message=SimpleNamespace(content="ok"), finish_reason="stop")
        return SimpleNamespace(choices=[choice] * n, usage=SimpleNamespace(prompt_tokens=1, completion_tokens=1))

    async def close(self):
        pass


def test_calls_that_time_out_together_narrow_the_window_until_they_fit(monkeypatch):
    """32 calls on a server that serves 8 sequences in time: with a fixed window of 32 every attempt of every call
    times out (the livelock of docs/learning.md); the window halves on each wave (32 -> 16 -> 8 ...) and all
    finish."""
    def run() -> tuple[list, OpenAIExecutor, _CongestedServer]:
        ex = executor("http://congested/v1", concurrency=32, max_retries=3)
        fake = _CongestedServer(capacity=8)
        ex.clients = [fake]

        async def go():
            return await asyncio.gather(*(ex.complete(MSG) for _ in range(32)), return_exceptions=True)
        return asyncio.run(go()), ex, fake

    replies, ex, fake = run()
    assert [r.texts for r in replies] == [["ok"]] * 32
    assert ex._window.epoch >= 2  # at least two halvings: 32 sequences of one wave, then 16, then at most 8
    assert ex._window.limit <= 8  # it ends within what the server serves in time
    assert 32 + 16 <= fake.calls < 32 * 4  # waves 1 and 2 timed out whole; far fewer than every attempt

    monkeypatch.setattr(SequenceWindow, "release", _fixed_release)  # the premise: a fixed window never finishes
    replies, _, fake = run()
    assert all(isinstance(r, ExecutorError) for r in replies) and fake.calls == 32 * 4


async def _fixed_release(self, k, epoch, timed_out):
    self.used -= k
    async with self._cond:
        self._cond.notify_all()


def test_backoff_and_retry_after_parsing(monkeypatch):
    import random

    import httpx
    import openai
    import tenacity

    monkeypatch.setattr(random, "uniform", lambda lo, hi: hi)  # the top of tenacity's jitter range

    def after(attempt: int, headers: dict | None = None) -> float:
        state = tenacity.RetryCallState(None, None, (), {})
        state.attempt_number = attempt
        exc: BaseException = TimeoutError()
        if headers is not None:
            resp = httpx.Response(429, headers=headers, request=httpx.Request("POST", "http://x/v1"))
            exc = openai.RateLimitError("slow down", response=resp, body=None)
        state.set_exception((type(exc), exc, None))
        return RetryAfterWait()(state)

    assert after(1) == 0.5 and after(4) == 4.0  # 0.5 * 2**(attempt - 1)
    assert after(11) == 30.0  # capped
    assert after(1, {"retry-after": "4"}) == 4.0  # Retry-After is a floor
    assert after(5, {"retry-after": "4"}) == 8.0  # ... not a ceiling
    assert after(1, {"retry-after": "1000000"}) == 120.0  # ... capped
    assert parse_retry_after({"retry-after": "2.5"}) == 2.5
    assert parse_retry_after({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    assert parse_retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0.0  # a past date
    assert parse_retry_after({"retry-after": "soon"}) is None and parse_retry_after({}) is None
    assert cost_usd(PriceConfig(input_per_mtok=0.15, output_per_mtok=0.6), 1_000_000, 500_000) == pytest.approx(0.45)


def test_make_executor_checks_config():
    with pytest.raises(ValueError, match="base_url"):
        make_executor(ExecutorConfig(kind="openai"))
    assert isinstance(make_executor(ExecutorConfig(kind="local")), LocalExecutor)


@pytest.mark.slow
def test_local_executor_batches_and_is_greedy(smol_tokenizer):
    ex = LocalExecutor(ExecutorConfig(kind="local", max_tokens=12))

    async def go():
        await ex.start()
        return await asyncio.gather(ex.complete([{"role": "user", "content": "What is 2+2?"}], n=2),
                                    ex.complete([{"role": "user", "content": "What is 2+2?"}]),
                                    ex.complete([{"role": "user", "content": "Name a colour."}]))
    a, b, c = asyncio.run(go())
    assert ex.generate_calls <= 2  # three concurrent requests, batched
    assert len(a.texts) == 2 and a.texts[0] == a.texts[1] == b.texts[0] != ""  # greedy: deterministic
    assert c.texts[0] != a.texts[0]

    def prompt_tokens(content: str) -> int:
        chat = smol_tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                  tokenize=False)
        return len(smol_tokenizer(chat, add_special_tokens=False).input_ids)

    # prompts of 37 and 34 tokens in one left-padded batch: the padding is not counted
    sum_in, colour_in = prompt_tokens("What is 2+2?"), prompt_tokens("Name a colour.")
    assert (a.tokens_in, b.tokens_in, c.tokens_in) == (sum_in, sum_in, colour_in) and sum_in != colour_in
    # tokens generated up to eos (not counted), once for a greedy n=2; the colour answer runs into the 12-token cap
    assert a.tokens_out == b.tokens_out == len(smol_tokenizer(a.texts[0], add_special_tokens=False).input_ids) < 12
    assert c.tokens_out == 12


# ---- a real OpenAI-compatible server: vLLM on CPU ------------------------------------------------------
