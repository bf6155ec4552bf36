"""`openai` backend: one or more OpenAI-compatible completions servers (`generator.base_url` or
`generator.endpoints`).

Against vLLM servers (detected by their `/version` route) the prompt goes as token ids, the round's adapter is
loaded at run time on every server (`POST /v1/load_lora_adapter`; each needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`
and `--enable-lora`), and token ids come back (`return_token_ids`, `return_tokens_as_token_ids`) with the
sampled tokens' logprobs; start them with `--logprobs-mode processed_logprobs` to get base.py's convention.
Against other servers the prompt goes as text, the completion is re-tokenized with the generator's
tokenizer (`retokenized=True`) and logprobs are kept only when the server's token count matches.

Several endpoints: each prompt goes to the least-loaded live server, at most `concurrency` requests in flight on
each. A prompt's seed depends on its place in the call only, so which server serves it changes nothing but
floating-point noise. A server that still fails after the client's own retries (connection, timeout, 429, 5xx)
is dropped for the rest of this generator, with a warning naming it, and its prompt goes to another one; when none
is left, generation fails (a re-run of the rollout samples only the missing slots). `tensor_parallel_size` is a
setting of each vLLM server (`--tensor-parallel-size`), not of this client.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from pipeline.engines.executors import retryable
from pipeline.engines.generation.base import Completion, GenerationError, Generator, Sampling, adapter_id
from pipeline.engines.models import load_tokenizer

log = logging.getLogger(__name__)


def server_root(base_url: str) -> str:
    """`http://h:p/v1` -> `http://h:p` (vLLM's /version and LoRA routes live at the root)."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


@dataclass(eq=False)
class Endpoint:
    """One server: its client, the adapters loaded on it, its load now and what it served."""

    url: str
    client: Any  # openai.OpenAI
    loaded: set[str] = field(default_factory=set)
    in_flight: int = 0
    served: int = 0  # prompts answered
    failed: str | None = None  # why it was dropped


class OpenAIGenerator(Generator):
    backend = "openai"
    reports_progress = True
    per_prompt_seeds = True  # each request is its own, seeded by its index or Sampling.seeds

    def __init__(self, model_ref: str, urls: str | list[str] | None, served_model: str | None = None,
                 api_key_env: str = "OPENAI_API_KEY", concurrency: int = 8, timeout_s: float = 600.0,
                 max_retries: int = 2):
        import openai

        urls = [urls] if isinstance(urls, str) else list(urls or [])
        if not urls:
            raise GenerationError("backend 'openai' needs generator.base_url or generator.endpoints "
                                  "(e.g. http://127.0.0.1:8000/v1)")
        self.tokenizer = load_tokenizer(model_ref)
        self.concurrency = concurrency  # per endpoint
        key = os.environ.get(api_key_env) or "EMPTY"  # local servers accept any key
        self.endpoints = [Endpoint(u.rstrip("/"), openai.OpenAI(base_url=u.rstrip("/"), api_key=key,
                                                                timeout=timeout_s, max_retries=max_retries))
                          for u in urls]
        self._http = httpx.Client(timeout=timeout_s)
        self._cond = threading.Condition()
        self.model = self._check_models(served_model)
        self.is_vllm = self._check_kinds()
        log.info("openai backend: %s model=%s vllm=%s", ", ".join(self.urls), self.model, self.is_vllm)

    @property
    def urls(self) -> list[str]:
        return [ep.url for ep in self.endpoints]

    # ---- start: every server up, serving the same model, all of one kind -------------------------------------

    def _models(self, endpoint: Endpoint) -> list[str]:
        import openai

        try:
            return [m.id for m in endpoint.client.models.list().data]
        except openai.APIConnectionError as e:
            raise GenerationError(f"generator server {endpoint.url} is not reachable ({e}); start it or fix "
                                  "generator.base_url / generator.endpoints") from None
        except openai.APIError as e:
            raise GenerationError(f"generator server {endpoint.url} refused /models: {e}") from None

    def _check_models(self, served_model: str | None) -> str:
        served = {ep.url: self._models(ep) for ep in self.endpoints}
        first = self.endpoints[0].url
        model = served_model or (served[first][0] if served[first] else None)
        if model is None:
            raise GenerationError(f"{first} serves no model; set generator.served_model")
        if served_model is None:  # requests name one model: every server must know it
            for url, models in served.items():
                if model not in models:
                    raise GenerationError(f"{url} serves {models}, not {model!r} (served by {first}); serve the "
                                          "same model everywhere or set generator.served_model")
        return model

    def _check_kinds(self) -> bool:
        kinds = {ep.url: self._probe_vllm(ep.url) for ep in self.endpoints}
        if len(set(kinds.values())) > 1:  # token ids vs re-tokenized text: one round's rows must not mix them
            raise GenerationError(f"generator endpoints mix vLLM and other servers ({kinds}); use one kind")
        return next(iter(kinds.values()))

    def _probe_vllm(self, url: str) -> bool:
        try:
            r = self._http.get(server_root(url) + "/version")
            return r.status_code == 200 and "version" in r.json()
        except (httpx.HTTPError, ValueError):
            return False

    # ---- spreading: least-loaded live endpoint, `concurrency` each; a failing one is dropped ------------------

    def _acquire(self) -> Endpoint:
        with self._cond:
            while True:
                live = [ep for ep in self.endpoints if ep.failed is None]
                if not live:
                    raise GenerationError("every generator endpoint failed: " + "; ".join(
                        f"{ep.url} ({ep.failed})" for ep in self.endpoints) + ". Restart them and re-run the "
                        "stage: it samples only the missing slots")
                free = [ep for ep in live if ep.in_flight < self.concurrency]
                if free:  # ties go to the one that served least, so light load still reaches every server
                    ep = min(free, key=lambda e: (e.in_flight, e.served))
                    ep.in_flight += 1
                    return ep
                self._cond.wait()

    def _release(self, ep: Endpoint, served: bool) -> None:
        with self._cond:
            ep.in_flight -= 1
            ep.served += served
            self._cond.notify_all()

    def _drop(self, endpoint: Endpoint, err: BaseException) -> None:
        with self._cond:
            if endpoint.failed is None:
                endpoint.failed = f"{type(err).__name__}: {str(err)[:200]}"
                left = sum(e.failed is None for e in self.endpoints)
                log.warning("generator endpoint %s failed (%s); dropped, its prompts go to the %d other live "
                            "endpoint(s)", endpoint.url, endpoint.failed, left)
            self._cond.notify_all()  # waiters re-check: none may be left

    # ---- adapters -----------------------------------------------------------------------------------------

    def _adapter_model(self, adapter: str | None) -> str:
        if adapter is None:
            return self.model
        if not self.is_vllm:
            raise GenerationError(f"{self.urls[0]} is not a vLLM server: it cannot load adapter {adapter} at run "
                                  "time; serve the adapter there and set generator.served_model instead")
        name, _, path = adapter_id(adapter)
        for ep in self.endpoints:  # every live server, so any of them can take any prompt
            if ep.failed is None and name not in ep.loaded:
                self._load_adapter(ep, name, path, adapter)
        return name

    def _load_adapter(self, endpoint: Endpoint, name: str, path: str, adapter: str) -> None:
        try:
            response = self._http.post(server_root(endpoint.url) + "/v1/load_lora_adapter", json={"lora_name": name,
                                                                                    "lora_path": path})
        except httpx.TransportError as e:  # the server went away: like a failed request
            self._drop(endpoint, e)
            return
        if response.status_code != 200 and "already" not in response.text:
            raise GenerationError(
                f"{endpoint.url} refused to load adapter {adapter} (HTTP {response.status_code}: "
                f"{response.text[:300]}); the server needs --enable-lora and env VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
        endpoint.loaded.add(name)

    # ---- requests -----------------------------------------------------------------------------------------

    def _generate(self, prompts: list[str], sampling: Sampling, adapter: str | None,
                  progress: Callable[[int], None] | None = None) -> list[list[Completion]]:
        model = self._adapter_model(adapter)
        workers = self._workers(len(prompts))

        def one(index: int, prompt: str) -> list[Completion]:
            completions = self._one(model, prompt, sampling, index)
            if progress is not None:
                progress(len(completions))
            return completions

        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(lambda ip: one(*ip), enumerate(prompts)))

    def _workers(self, prompts: int) -> int:
        """Threads for a call of `prompts` requests: `concurrency` per server, and no more than there are requests."""
        return max(1, min(self.concurrency * len(self.endpoints), prompts))

    def request(self, model: str, prompt: str, sampling: Sampling, index: int) -> tuple[list[int], dict[str, Any]]:
        """Prompt ids and the completions request for prompt `index` of a call (seeded like the vllm backend:
        by the index, whichever server takes it)."""
        prompt_ids = self.tokenizer(prompt, add_special_tokens=False).input_ids
        kwargs: dict[str, Any] = dict(model=model, n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                                      max_tokens=sampling.max_new_tokens, seed=sampling.prompt_seed(index),
                                      logprobs=0)
        if self.is_vllm:
            kwargs.update(prompt=prompt_ids,
                          extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True,
                                      "skip_special_tokens": True, "include_stop_str_in_output": True})
            if sampling.stop:
                kwargs.update(stop=list(sampling.stop))
            # Another server drops the stop string from the text and reports finish "stop" as for an EOS, so its
            # tokens could not be rebuilt: it gets no stop, and its samples run on to EOS or the cap.
        else:
            kwargs.update(prompt=prompt)
        return prompt_ids, kwargs

    def _one(self, model: str, prompt: str, sampling: Sampling, index: int) -> list[Completion]:
        prompt_ids, kw = self.request(model, prompt, sampling, index)
        choices = sorted(self._create(kw).choices, key=lambda c: c.index)
        return [self._completion(prompt_ids, c) for c in choices]

    def next_token_logprobs(self, prompts: list[str], token_ids: list[int],
                            adapter: str | None = None) -> list[list[float]]:
        if not self.is_vllm:
            return super().next_token_logprobs(prompts, token_ids, adapter)
        model = self._adapter_model(adapter)

        def one(prompt: str) -> list[float]:
            kw = dict(model=model, prompt=self.tokenizer(prompt, add_special_tokens=False).input_ids, max_tokens=1,
                      temperature=1.0, seed=0, logprobs=1, extra_body={"logprob_token_ids": list(token_ids),
                                                                       "return_tokens_as_token_ids": True})
            logprobs = self._create(kw).choices[0].logprobs
            step = (logprobs.top_logprobs or [{}])[0] if logprobs else {}
            try:
                return [float(step[f"token_id:{t}"]) for t in token_ids]
            except KeyError:
                raise GenerationError(f"{self.urls[0]} returned no log-probability for some of tokens "
                                      f"{list(token_ids)} (a vLLM server with logprob_token_ids is needed)") from None

        with ThreadPoolExecutor(self._workers(len(prompts))) as pool:
            return list(pool.map(one, prompts))

    def _create(self, kwargs: dict[str, Any]) -> Any:
        """One completions request, retried on the next live server while servers fail."""
        import openai

        while True:  # until a server answers; _acquire raises when none is left
            endpoint = self._acquire()
            try:
                resp = endpoint.client.completions.create(**kwargs)
            except openai.APIError as e:
                self._release(endpoint, served=False)
                if not retryable(e):  # the request itself is wrong: another server would refuse it too
                    raise GenerationError(f"generator server {endpoint.url} failed a request: {e}") from None
                self._drop(endpoint, e)
                continue
            self._release(endpoint, served=True)
            return resp

    def _completion(self, prompt_ids: list[int], choice: Any) -> Completion:
        finish = "stop" if choice.finish_reason == "stop" else "length"
        lps = list(choice.logprobs.token_logprobs) if choice.logprobs and choice.logprobs.token_logprobs else None
        ids = getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids")
        if self.is_vllm and ids is not None:
            return Completion(text=choice.text, prompt_token_ids=prompt_ids, token_ids=list(ids),
                              token_logprobs=lps if lps is not None and len(lps) == len(ids) else None,
                              finish_reason=finish)
        toks = self.tokenizer(choice.text, add_special_tokens=False).input_ids
        if finish == "stop" and self.tokenizer.eos_token_id is not None:
            toks.append(self.tokenizer.eos_token_id)  # the server stopped on EOS; keep the token like the others
        return Completion(text=choice.text, prompt_token_ids=prompt_ids, token_ids=toks,
                          token_logprobs=lps if lps is not None and len(lps) == len(toks) else None,
                          finish_reason=finish, retokenized=True)

    def close(self) -> None:
        if len(self.endpoints) > 1:
            log.info("openai backend: prompts served per endpoint: %s",
                     {ep.url: ep.served for ep in self.endpoints})
        self._http.close()
        for ep in self.endpoints:
            ep.client.close()
