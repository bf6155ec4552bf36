"""Executor LLMs behind one async interface: `await executor.complete(messages, temperature, n, max_tokens)`.

- `openai`: any OpenAI-compatible server (AsyncOpenAI), spread over one or more base URLs, with a
  concurrency limit, a per-call timeout and retries by tenacity (exponential backoff with full jitter,
  Retry-After as a floor) on 429 / 5xx / timeouts / connection errors / malformed responses.
- `local`: the embedded model in-process (transformers); concurrent requests are batched into one
  `generate` call; greedy at temperature 0 (the paper's setting); sampled rows each draw from their own
  torch.Generator, so a seeded request gets the same sample whatever else is in its batch.

Common random numbers: a sampled call may carry a `seed`. `CallSeeds` derives it on the trusted side of
the sandbox from where the workflow run sits (`SampleSlot`: executor.seed, query, sample slot, rep) and the call
itself (messages, parameters, and how many identical calls the run made before), so two arms that make the same call
on the same query in the same slot get the same sample, while repeated calls and reps get fresh ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import hashlib
import itertools
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pipeline.config import ExecutorConfig, PriceConfig, server_urls

MAX_RETRY_AFTER_S = 120.0
log = logging.getLogger(__name__)


class ExecutorError(RuntimeError):
    """An executor call failed for good (retries exhausted or a non-retryable error)."""

    refused = False  # RequestRefused: the call's own doing (read by the sandbox's parent without this module)


class RequestRefused(ExecutorError):
    """The executor refused the call for what it asks (a prompt past the model's context: the local executor's own
    check, a server's 400): the workflow's doing, not an outage. The workflow's llm() raises, and the run is scored
    as the workflow's error instead of waiting for a re-score that would be refused again."""

    refused = True


@dataclass
class ExecutorReply:
    texts: list[str]
    tokens_in: int
    tokens_out: int
    cost_usd: float = 0.0
    truncated: int = 0  # texts that stopped at the token cap (finish_reason "length")
    cached: bool = False  # answered from the reply cache (pipeline.engines.cache): nothing was computed for it


# ---- common random numbers ----------------------------------------------------------------------------------------

SEED_RANGE = 2**31  # vLLM adds the sample index to a request's seed (n > 1); OpenAI's API takes a 32-bit int


def call_signature(messages: list[dict], temperature: float, n: int, max_tokens: int | None) -> str:
    """What makes two calls of one workflow run identical: the messages and the sampling parameters."""
    body = json.dumps([messages, float(temperature), int(n), max_tokens], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(body.encode()).hexdigest()


@dataclass(frozen=True)
class SampleSlot:
    """Where one workflow run sits, which is what common random numbers pair across arms: the experiment's executor
    seed, the query, the workflow's sample slot within its query (`generations.slot`) and the rep."""

    seed: int
    query_id: str
    slot: int
    rep: int


class CallSeeds:
    """The seed of each executor call of one workflow run; lives in the trusted parent (the sandbox's helper
    server), so untrusted code neither chooses nor sees a seed: it only chooses its messages, as any call does.
    None for a greedy call (temperature 0 needs none) or a run without a slot (common random numbers off)."""

    def __init__(self, where: SampleSlot | None, default_temperature: float = 0.0):
        """`default_temperature`: what a call without a temperature samples at (executor.temperature)."""
        self.where, self.default_temperature = where, default_temperature
        self._made: dict[str, int] = {}  # call signature -> identical calls made so far

    def run_seed(self) -> int | None:
        """The seed of the workflow's own `random` module (the sandbox seeds it before the workflow runs): a
        workflow that draws, e.g. `random.choice(replies)`, draws the same in every arm at this slot. None without
        a slot: the run's `random` stays seeded from the OS."""
        if self.where is None:
            return None
        return self._derive("random")

    def seed(self, messages: list[dict], temperature: float | None, n: int, max_tokens: int | None) -> int | None:
        temperature = self.default_temperature if temperature is None else temperature
        if self.where is None or temperature == 0:
            return None
        sig = call_signature(messages, temperature, n, max_tokens)
        k = self._made.get(sig, 0)  # a vote of three identical calls: k = 0, 1, 2, three samples
        self._made[sig] = k + 1
        return self._derive(sig, k)

    def _derive(self, *what) -> int:
        """A seed in [0, SEED_RANGE) from the slot and `what`: a hash, so any change of an input changes it."""
        w = self.where
        body = json.dumps([w.seed, w.query_id, w.slot, w.rep, *what])
        return int.from_bytes(hashlib.sha256(body.encode()).digest()[:8], "big") % SEED_RANGE


def cost_usd(prices: PriceConfig, tokens_in: int, tokens_out: int) -> float:
    return (tokens_in * prices.input_per_mtok + tokens_out * prices.output_per_mtok) / 1e6


class RetryAfterWait:
    """tenacity wait: full-jitter exponential backoff (0.5 s doubling, capped at 30 s) with the server's
    Retry-After as a floor (itself capped at MAX_RETRY_AFTER_S)."""

    def __init__(self):
        import tenacity

        self.jitter = tenacity.wait_random_exponential(multiplier=0.5, max=30)

    def __call__(self, state) -> float:
        delay = self.jitter(state)
        exc = state.outcome.exception() if state.outcome else None
        retry_after = parse_retry_after(getattr(getattr(exc, "response", None), "headers", None))
        return max(delay, min(retry_after, MAX_RETRY_AFTER_S)) if retry_after is not None else delay


def parse_retry_after(headers: Any) -> float | None:
    """Seconds from `retry-after-ms` / `retry-after` (seconds or an HTTP date)."""
    if headers is None:
        return None
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return float(ms) / 1000
        except ValueError:
            pass
    retry_after = headers.get("retry-after")
    if not retry_after:
        return None
    try:
        return max(0.0, float(retry_after))
    except ValueError:
        try:
            return max(0.0, email.utils.parsedate_to_datetime(retry_after).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


def retryable(error: BaseException) -> bool:
    """An openai-client error worth another try, here or on another endpoint: 429 / 408 / 409 / 5xx, connection
    errors, timeouts and malformed bodies; not other client errors (the request itself is wrong)."""
    import openai

    if isinstance(error, openai.APIStatusError):
        return error.status_code in (408, 409, 429) or error.status_code >= 500
    return isinstance(error, openai.APIConnectionError | openai.APIResponseValidationError | TimeoutError | ValueError)


def _is_timeout(e: BaseException) -> bool:
    import openai

    return isinstance(e, TimeoutError | openai.APITimeoutError)


class SequenceWindow:
    """How many sequences may be in flight on the executor servers: at most `cap` (executor.concurrency), halved
    when a call times out, widened by one per window of calls that finish (additive increase, multiplicative
    decrease, as TCP's congestion window). A fixed window livelocked a 2-core server: 32 sampled sequences shared
    ~40 tokens/s, so a 384-token reply outlasted the 240 s call timeout, was aborted, retried, and outlasted it
    again (docs/learning.md). Only a call that started in the current epoch halves the window: the calls that
    all started together and time out together count as one signal, not 32. Callers take their slots in arrival
    order; a call larger than the window runs once nothing else is in flight."""

    def __init__(self, cap: int):
        self.cap = self.limit = cap
        self.used = self.epoch = self._done = 0
        self._cond: asyncio.Condition | None = None
        self._queue: asyncio.Lock | None = None

    async def acquire(self, slots: int) -> int:
        """Wait for `slots` slots; returns the epoch the call starts in."""
        if self._cond is None:  # bound to the running loop at first use
            self._cond, self._queue = asyncio.Condition(), asyncio.Lock()
        async with self._queue, self._cond:
            await self._cond.wait_for(lambda: self.used == 0 or self.used + slots <= self.limit)
            self.used += slots
            return self.epoch

    async def release(self, slots: int, epoch: int, timed_out: bool) -> None:
        self.used -= slots
        if timed_out and epoch == self.epoch:
            self.limit, self.epoch, self._done = max(1, self.limit // 2), self.epoch + 1, 0
            log.warning("an executor call timed out: at most %d sequences in flight from now (executor.concurrency "
                        "%d; widened again as calls finish)", self.limit, self.cap)
        elif not timed_out and self.limit < self.cap:
            self._done += slots
            if self._done >= self.limit:
                self.limit, self._done = self.limit + 1, 0
        async with self._cond:  # the counts above are already right if this wait is cancelled
            self._cond.notify_all()


class Executor:
    async def complete(self, messages: list[dict], temperature: float | None = None, n: int = 1,
                       max_tokens: int | None = None, seed: int | None = None) -> ExecutorReply:
        """`seed`: the sample's seed (a sampled call; ignored at temperature 0); None: a fresh draw."""
        raise NotImplementedError

    async def start(self) -> None:
        """Get ready before the first call (the local model loads here, outside any workflow's timeout)."""

    async def aclose(self) -> None:
        """Release clients / the model."""


class OpenAIExecutor(Executor):
    def __init__(self, cfg: ExecutorConfig, *, sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep):
        import openai

        urls = server_urls(cfg.base_url, cfg.endpoints)
        if not urls:
            raise ValueError("executor.kind=openai needs executor.base_url or executor.endpoints")
        key = os.environ.get(cfg.api_key_env) or "EMPTY"  # local servers accept any key
        self.cfg, self._sleep = cfg, sleep
        # The client's own retries are off: tenacity's (complete) count every attempt and move to the next endpoint.
        self.clients = [openai.AsyncOpenAI(base_url=u, api_key=key, max_retries=0, timeout=cfg.timeout_s)
                        for u in urls]
        self._next = itertools.cycle(range(len(urls)))
        self._window: SequenceWindow | None = None

    async def _once(self, messages: list[dict], temperature: float, n: int, asked: int,
                    max_tokens: int | None, seed: int | None, timeout_s: float) -> ExecutorReply:
        cfg = self.cfg
        client = self.clients[next(self._next)]  # each attempt goes to the next endpoint
        # vLLM's server seeds the request's sampler with it (sample j of n with seed + j); a remote API's seed is
        # best effort, which the reply cache makes exact
        extra = {} if seed is None else {"seed": seed}
        try:
            async with self._slots(asked):
                resp = await asyncio.wait_for(client.chat.completions.create(
                    model=cfg.model, messages=messages, temperature=temperature, n=asked,
                    max_tokens=max_tokens or cfg.max_tokens, timeout=timeout_s, **extra), timeout_s)
            if not getattr(resp, "choices", None):
                raise ValueError(f"malformed response: no choices ({str(resp)[:200]})")
        except Exception as e:
            if not retryable(e):
                import openai

                # 400: what was asked is wrong (vLLM's server: a prompt past max_model_len), not the server; told
                # to the workflow, so without the server's address
                if isinstance(e, openai.APIStatusError) and e.status_code == 400:
                    raise RequestRefused(f"{type(e).__name__}: {e}") from e
                raise ExecutorError(f"{client.base_url}: {type(e).__name__}: {e}") from e
            raise
        texts = [(c.message.content or "") for c in resp.choices] * (n // asked)
        truncated = sum(getattr(c, "finish_reason", None) == "length" for c in resp.choices) * (n // asked)
        usage = getattr(resp, "usage", None)
        tin = int(getattr(usage, "prompt_tokens", 0) or 0)
        tout = int(getattr(usage, "completion_tokens", 0) or 0)
        return ExecutorReply(texts, tin, tout, cost_usd(cfg.prices, tin, tout), truncated)

    @contextlib.asynccontextmanager
    async def _slots(self, sequences: int):
        """Hold one slot of the sequence window per sequence the server will decode: a request for n samples is
        n sequences on the server, and counting it as one let 32 CoT-SC calls (n = 5) put 160 sequences in flight,
        each so slow that it met the call timeout, was retried, and met it again. A call that times out narrows
        the window (`SequenceWindow`)."""
        if self._window is None:
            self._window = SequenceWindow(self.cfg.concurrency)
        slots = min(sequences, self.cfg.concurrency)
        epoch = await self._window.acquire(slots)
        timed_out = False
        try:
            yield
        except Exception as e:
            timed_out = _is_timeout(e)
            raise
        finally:
            await self._window.release(slots, epoch, timed_out)

    async def complete(self, messages: list[dict], temperature: float | None = None, n: int = 1,
                       max_tokens: int | None = None, seed: int | None = None) -> ExecutorReply:
        import tenacity

        cfg = self.cfg
        temperature = cfg.temperature if temperature is None else temperature
        # Greedy answers are identical: ask once (vLLM refuses n > 1 at temperature 0) and repeat.
        asked = 1 if temperature == 0 else n
        seed = None if temperature == 0 else seed
        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(cfg.max_retries + 1), wait=RetryAfterWait(), sleep=self._sleep,
            retry=tenacity.retry_if_exception(lambda e: not isinstance(e, ExecutorError)))
        # A reply that outlasted the call timeout is asked for again with twice the time: on a slow or shared CPU a
        # whole reply can take longer than executor.timeout_s even alone on the server (measured: 0.9 tokens/s a
        # sequence, a 256-token reply 280 s against 240), and asking again with the same time never ends. The
        # window (`SequenceWindow`) also narrows; the timeout still bounds a hung server, at 2^k times its value.
        timeouts = 0

        async def attempt() -> ExecutorReply:
            nonlocal timeouts
            try:
                return await self._once(messages, temperature, n, asked, max_tokens, seed,
                                        cfg.timeout_s * 2 ** timeouts)
            except Exception as e:
                timeouts += _is_timeout(e)
                raise

        try:
            return await retrying(attempt)
        except tenacity.RetryError as e:
            last = e.last_attempt.exception()
            raise ExecutorError(f"gave up after {cfg.max_retries + 1} attempts: {type(last).__name__}: {last}") \
                from last

    async def aclose(self) -> None:
        for c in self.clients:
            await c.close()


class LocalExecutor(Executor):
    """The embedded model in-process. Requests queue; one worker batches everything pending (same
    sampling settings) into one left-padded `generate` call, run in a thread so the loop keeps serving."""

    def __init__(self, cfg: ExecutorConfig, *, max_batch: int = 8):
        self.cfg, self.max_batch = cfg, max_batch
        self._tok = self._model = None
        self._pending: list[_Request] = []
        self._worker: asyncio.Task | None = None
        self.generate_calls = 0  # batches run (observable batching)

    def _load(self) -> None:
        if self._model is None:
            from pipeline.engines.models import load_causal_lm, load_tokenizer

            tok = load_tokenizer(self.cfg.model)
            tok.padding_side = "left"
            self._tok, self._model = tok, load_causal_lm(self.cfg.model, "float32")

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    async def complete(self, messages: list[dict], temperature: float | None = None, n: int = 1,
                       max_tokens: int | None = None, seed: int | None = None) -> ExecutorReply:
        temperature = self.cfg.temperature if temperature is None else temperature
        fut = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(messages, float(temperature), n, max_tokens or self.cfg.max_tokens, fut,
                                      None if temperature == 0 else seed))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._work())
        return await fut

    async def _work(self) -> None:
        while self._pending:
            key = self._pending[0].key
            batch = [r for r in self._pending if r.key == key][: self.max_batch]
            for request in batch:
                self._pending.remove(request)
            try:
                outs = await asyncio.to_thread(self._generate, batch)
            except Exception as e:
                for request in batch:
                    if not request.fut.done():
                        request.fut.set_exception(ExecutorError(f"local generate failed: {type(e).__name__}: {e}"))
                continue
            for request, out in zip(batch, outs, strict=True):
                if request.fut.done():
                    continue
                if isinstance(out, ExecutorError):
                    request.fut.set_exception(out)
                else:
                    request.fut.set_result(out)

    def context(self) -> int:
        """The model's context in tokens (prompt and completion): a call past it is refused, as a server refuses
        one past its max_model_len; its positions were never trained, and one such prompt in a left-padded batch
        costs every request beside it its length (a workflow that sent the question 367 times, 9,205 tokens, held
        another's call for 75 s)."""
        self._load()
        return int(getattr(self._model.config, "max_position_embeddings", None) or self._tok.model_max_length)

    def _generate(self, batch: list[_Request]) -> list[ExecutorReply | ExecutorError]:
        self._load()
        tok, limit = self._tok, self.context()
        prompts = [tok.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=False) for r in batch]
        lengths = [len(tok(p, add_special_tokens=False).input_ids) for p in prompts]
        fits = [k for k, (r, n) in enumerate(zip(batch, lengths, strict=True)) if n + r.max_tokens <= limit]
        replies = self._generate_fitting([batch[k] for k in fits], [prompts[k] for k in fits]) if fits else []
        out: list[ExecutorReply | ExecutorError] = [
            # told to the workflow: the numbers, not the model's folder
            RequestRefused(f"the prompt's {n} tokens and {r.max_tokens} to generate exceed the local executor's "
                          f"context of {limit} tokens") for r, n in zip(batch, lengths, strict=True)]
        for k, reply in zip(fits, replies, strict=True):
            out[k] = reply
        return out

    def _generate_fitting(self, batch: list[_Request], prompts: list[str]) -> list[ExecutorReply]:
        import torch

        tok, model = self._tok, self._model
        temperature, max_tokens = batch[0].key
        greedy = temperature == 0
        # Greedy: one row per request (its n answers are identical); sampling: n rows per request.
        reps = [1 if greedy else r.n for r in batch]
        rows = [p for p, k in zip(prompts, reps, strict=True) for _ in range(k)]
        enc = tok(rows, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        generate_kwargs: dict[str, Any] = {"do_sample": False, "max_new_tokens": max_tokens,
                                           "pad_token_id": tok.pad_token_id}
        if not greedy:  # sample j of a request seeded s draws with seed s + j, as vLLM's server does
            seeds = [None if r.seed is None else r.seed + j for r, k in zip(batch, reps, strict=True) for j in range(k)]
            generate_kwargs["logits_processor"] = [_RowSampler(seeds, temperature)]
        with torch.inference_mode():
            out = model.generate(**enc, **generate_kwargs)
        self.generate_calls += 1
        gen = out[:, enc["input_ids"].shape[1]:].tolist()
        stop = {tok.eos_token_id, tok.pad_token_id}
        results, offset = [], 0
        for request, count in zip(batch, reps, strict=True):
            texts, tout, truncated = [], 0, 0
            for ids in gen[offset: offset + count]:
                cut = next((j for j, t in enumerate(ids) if t in stop), len(ids))
                texts.append(tok.decode(ids[:cut], skip_special_tokens=True).strip())
                tout += cut  # tokens actually generated (greedy: once for all n answers)
                truncated += cut == len(ids)  # no stop token before the cap
            tin = int(enc["attention_mask"][offset].sum())
            offset += count
            results.append(ExecutorReply(texts * request.n if greedy else texts, tin, tout,
                                         truncated=truncated * request.n if greedy else truncated))
        return results


class _RowSampler:
    """A logits processor that samples each row from its own torch.Generator at `temperature` (the full
    distribution: no top-k or top-p) and leaves only the drawn token, which greedy decoding then picks. transformers
    samples a batch from the one global generator, so a row's sample would depend on what else is in its batch; here
    it depends on its seed alone (a fresh random one when None)."""

    def __init__(self, seeds: list[int | None], temperature: float):
        import torch

        self.temperature = temperature
        self.gens = []
        for s in seeds:
            g = torch.Generator()
            if s is None:
                g.seed()
            else:
                g.manual_seed(s)
            self.gens.append(g)

    def __call__(self, input_ids, scores):
        import torch

        probs = torch.softmax(scores.float() / self.temperature, dim=-1).cpu()
        drawn = torch.stack([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, self.gens, strict=True)])
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, drawn.to(scores.device), 0.0)


@dataclass
class _Request:
    messages: list[dict]
    temperature: float
    n: int
    max_tokens: int
    fut: asyncio.Future
    seed: int | None = None

    @property
    def key(self) -> tuple[float, int]:  # requests sharing it can go into one generate call
        return self.temperature, self.max_tokens


def make_executor(cfg: ExecutorConfig) -> Executor:
    if cfg.kind == "openai":
        return OpenAIExecutor(cfg)
    if cfg.kind == "local":
        return LocalExecutor(cfg)
    raise ValueError(f"unknown executor kind {cfg.kind!r}")
