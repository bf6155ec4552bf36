"""`openai` backend: any OpenAI-compatible completions server.

Against a vLLM server (detected by its `/version` route) the prompt goes as token ids, the round's adapter is
loaded at run time (`POST /v1/load_lora_adapter`; the server needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`
and `--enable-lora`), and token ids come back (`return_token_ids`, `return_tokens_as_token_ids`) with the
sampled tokens' logprobs; start it with `--logprobs-mode processed_logprobs` to get base.py's convention.
Against other servers the prompt goes as text, the completion is re-tokenized with the generator's
tokenizer (`retokenized=True`) and logprobs are kept only when the server's token count matches.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from pipeline.generation.base import Completion, GenerationError, Generator, Sampling, adapter_id
from pipeline.models import load_tokenizer

log = logging.getLogger(__name__)


def server_root(base_url: str) -> str:
    """`http://h:p/v1` -> `http://h:p` (vLLM's /version and LoRA routes live at the root)."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


class OpenAIGenerator(Generator):
    backend = "openai"

    def __init__(self, model_ref: str, base_url: str | None, served_model: str | None = None,
                 api_key_env: str = "OPENAI_API_KEY", concurrency: int = 8, timeout_s: float = 600.0):
        import openai

        if not base_url:
            raise GenerationError("backend 'openai' needs generator.base_url (e.g. http://127.0.0.1:8000/v1)")
        self.base_url = base_url.rstrip("/")
        self.tokenizer = load_tokenizer(model_ref)
        self.concurrency = concurrency
        self.client = openai.OpenAI(base_url=self.base_url, api_key=os.environ.get(api_key_env) or "EMPTY",
                                    timeout=timeout_s, max_retries=2)
        self._http = httpx.Client(timeout=timeout_s)
        try:
            models = [m.id for m in self.client.models.list().data]
        except openai.APIConnectionError as e:
            raise GenerationError(f"generator server {self.base_url} is not reachable ({e}); start it or fix "
                                  "generator.base_url") from None
        except openai.APIError as e:
            raise GenerationError(f"generator server {self.base_url} refused /models: {e}") from None
        self.model = served_model or (models[0] if models else None)
        if self.model is None:
            raise GenerationError(f"{self.base_url} serves no model; set generator.served_model")
        self.is_vllm = self._probe_vllm()
        self._loaded: set[str] = set()
        log.info("openai backend: %s model=%s vllm=%s", self.base_url, self.model, self.is_vllm)

    def _probe_vllm(self) -> bool:
        try:
            r = self._http.get(server_root(self.base_url) + "/version")
            return r.status_code == 200 and "version" in r.json()
        except (httpx.HTTPError, ValueError):
            return False

    def _adapter_model(self, adapter: str | None) -> str:
        if adapter is None:
            return self.model
        if not self.is_vllm:
            raise GenerationError(f"{self.base_url} is not a vLLM server: it cannot load adapter {adapter} at run "
                                  "time; serve the adapter there and set generator.served_model instead")
        name, _, path = adapter_id(adapter)
        if name not in self._loaded:
            r = self._http.post(server_root(self.base_url) + "/v1/load_lora_adapter",
                                json={"lora_name": name, "lora_path": path})
            if r.status_code != 200 and "already" not in r.text:
                raise GenerationError(
                    f"{self.base_url} refused to load adapter {adapter} (HTTP {r.status_code}: {r.text[:300]}); the "
                    "server needs --enable-lora and env VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
            self._loaded.add(name)
        return name

    def _generate(self, prompts: list[str], sampling: Sampling, adapter: str | None) -> list[list[Completion]]:
        model = self._adapter_model(adapter)
        with ThreadPoolExecutor(max(1, min(self.concurrency, len(prompts)))) as pool:
            return list(pool.map(lambda ip: self._one(model, ip[1], sampling, ip[0]), enumerate(prompts)))

    def request(self, model: str, prompt: str, sampling: Sampling, index: int) -> tuple[list[int], dict[str, Any]]:
        """Prompt ids and the completions request for prompt `index` of a call (seeded like the vllm backend)."""
        prompt_ids = self.tokenizer(prompt, add_special_tokens=False).input_ids
        kw: dict[str, Any] = dict(model=model, n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                                  max_tokens=sampling.max_new_tokens, seed=sampling.seed + index * sampling.n,
                                  logprobs=0)
        if self.is_vllm:
            kw.update(prompt=prompt_ids, extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True,
                                                     "skip_special_tokens": True})
        else:
            kw.update(prompt=prompt)
        return prompt_ids, kw

    def _one(self, model: str, prompt: str, sampling: Sampling, index: int) -> list[Completion]:
        import openai

        prompt_ids, kw = self.request(model, prompt, sampling, index)
        try:
            resp = self.client.completions.create(**kw)
        except openai.APIConnectionError as e:
            raise GenerationError(f"generator server {self.base_url} went away: {e}") from None
        except openai.APIError as e:
            raise GenerationError(f"generator server {self.base_url} failed a request: {e}") from None
        choices = sorted(resp.choices, key=lambda c: c.index)
        return [self._completion(prompt_ids, c) for c in choices]

    def _completion(self, prompt_ids: list[int], c: Any) -> Completion:
        finish = "stop" if c.finish_reason == "stop" else "length"
        lps = list(c.logprobs.token_logprobs) if c.logprobs and c.logprobs.token_logprobs else None
        ids = getattr(c, "token_ids", None) or (c.model_extra or {}).get("token_ids")
        if self.is_vllm and ids is not None:
            return Completion(text=c.text, prompt_token_ids=prompt_ids, token_ids=list(ids),
                              token_logprobs=lps if lps is not None and len(lps) == len(ids) else None,
                              finish_reason=finish)
        toks = self.tokenizer(c.text, add_special_tokens=False).input_ids
        if finish == "stop" and self.tokenizer.eos_token_id is not None:
            toks.append(self.tokenizer.eos_token_id)  # the server stopped on EOS; keep the token like the others
        return Completion(text=c.text, prompt_token_ids=prompt_ids, token_ids=toks,
                          token_logprobs=lps if lps is not None and len(lps) == len(toks) else None,
                          finish_reason=finish, retokenized=True)

    def close(self) -> None:
        self._http.close()
        self.client.close()
