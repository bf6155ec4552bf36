"""The generation interface every backend implements (docs/design.md §4).

Logprob convention (all backends): `token_logprobs[t]` is the log-probability of the sampled token under
the distribution it was actually drawn from: log_softmax(logits / temperature), renormalised over the
top-p nucleus, in fp32. At temperature 1 and top_p 1 that is the model's own distribution; at temperature
0 (greedy) it is the raw model distribution. (vLLM: `logprobs_mode="processed_logprobs"`.)
"""

from __future__ import annotations

import json
import threading
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path


class GenerationError(RuntimeError):
    """Generation cannot start or failed (bad backend, adapter, tokenizer, server); says how to fix it."""


def adapter_id(adapter: str) -> tuple[str, int, str]:
    """(name, positive int id, absolute path) of a LoRA adapter folder. Stable per path, so re-using an adapter
    hits vLLM's LoRA cache; a folder that is not a peft adapter is an error."""
    path = Path(adapter).resolve()
    if not (path / "adapter_config.json").is_file():
        raise GenerationError(f"{adapter}: not a LoRA adapter folder (no adapter_config.json)")
    crc = zlib.crc32(str(path).encode())
    return f"adapter-{crc:08x}", crc % (2**31 - 1) + 1, str(path)


# A fenced code block's closing line: a workflow is complete there, and what a model writes after it (an explanation,
# a usage example) is never run. In 5,660 stored generations, cutting at the first one never changed the extracted
# workflow (docs/performance.md), and it cut 17% of the demo's generated characters.
BLOCK_END = "\n```\n"


@dataclass(frozen=True)
class Sampling:
    n: int = 1  # samples per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0
    stop: tuple[str, ...] = ()  # a sample ends with the first of these strings it writes (kept in text and tokens)
    # per prompt, the seed its samples start at (a backend with `per_prompt_seeds`): several calls' prompts sampled in
    # one engine call each keep the seed their own call gives them; None: prompt i of a call starts at seed + i * n
    seeds: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1:
            raise GenerationError(f"n and max_new_tokens must be >= 1, got {self}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise GenerationError(f"need temperature >= 0 and 0 < top_p <= 1, got {self}")

    def prompt_seed(self, index: int) -> int:
        """The seed of prompt `index`'s first sample (sample j of it: + j)."""
        return self.seeds[index] if self.seeds is not None else self.seed + index * self.n

    def to_json(self, **extra: object) -> str:
        """The stored provenance of a sample's parameters (`stop` only where set: rows without one read as before)."""
        d = {k: v for k, v in asdict(self).items() if (k != "stop" or v) and k != "seeds"}
        return json.dumps({**d, "logprobs": "processed", **extra}, sort_keys=True)


def stop_length(token_ids: list[int], decode: Callable[[list[int]], str], stops: tuple[str, ...]) -> int | None:
    """How many leading tokens a sample keeps when it ends at its first stop string: the shortest prefix whose text
    holds one (what vLLM keeps with include_stop_str_in_output), None when the text holds none."""
    if not stops or not any(s in decode(token_ids) for s in stops):
        return None
    low, high = 1, len(token_ids)  # a prefix's text only grows, so the first prefix holding a stop is a bisection
    while low < high:
        mid = (low + high) // 2
        if any(s in decode(token_ids[:mid]) for s in stops):
            high = mid
        else:
            low = mid + 1
    return low


def stop_text(text: str, stops: tuple[str, ...]) -> str:
    """`text` up to the end of the first stop string it completes: vLLM's text with include_stop_str_in_output, which
    ends there even where the token that completed the stop runs on (its tokens keep that token whole)."""
    ends = [text.index(s) + len(s) for s in stops if s in text]
    return text[: min(ends)] if ends else text


@dataclass
class Completion:
    text: str  # decoded completion, special tokens skipped
    prompt_token_ids: list[int]
    token_ids: list[int]  # the sampled tokens, the final EOS included when it stopped there
    token_logprobs: list[float] | None  # per token (see module doc); None when the server gave none
    finish_reason: str  # stop | length
    retokenized: bool = False  # token ids re-derived from the text with the generator's tokenizer
    extra: dict = field(default_factory=dict)


class Generator(ABC):
    """A loaded generator: `generate(prompts, sampling, adapter)` -> per prompt, `sampling.n` completions.

    Prompts are fully rendered texts (chat template applied); backends tokenize them without adding
    special tokens so every backend sees the same prompt ids.
    """

    backend: str
    # whether `_generate` takes `progress` and calls it as its requests finish (else a call reports at its end)
    reports_progress: bool = False
    # whether each prompt's samples follow its own seed whatever else the call holds (`Sampling.seeds`): then several
    # calls' prompts can be sampled in one call and each draws what its own call would have
    per_prompt_seeds: bool = False

    def generate(self, prompts: list[str], sampling: Sampling, adapter: str | None = None,
                 progress: Callable[[int], None] | None = None) -> list[list[Completion]]:
        """`progress(n)`: n more completions finished (a backend that reports per request tells it as they end, e.g.
        a rollout's meter; the others, and whatever a backend left untold, at the end of the call)."""
        if not prompts:
            return []
        if sampling.seeds is not None and (not self.per_prompt_seeds or len(sampling.seeds) != len(prompts)):
            raise GenerationError(f"Sampling.seeds: {len(sampling.seeds)} seeds for {len(prompts)} prompts on the "
                                  f"{self.backend} backend (per_prompt_seeds {self.per_prompt_seeds})")
        told, lock = 0, threading.Lock()

        def tell(n: int) -> None:  # requests may end on several threads (openai)
            nonlocal told
            with lock:
                told += n
                progress(n)

        reporting = {"progress": tell} if progress is not None and self.reports_progress else {}
        if sampling.temperature == 0 and sampling.n > 1:  # engines allow greedy only with n=1: repeat the prompt
            seeds = None if sampling.seeds is None else tuple(s + j for s in sampling.seeds for j in range(sampling.n))
            flat = self._generate([p for p in prompts for _ in range(sampling.n)], replace(sampling, n=1, seeds=seeds),
                                  adapter, **reporting)
            out = [[c for row in flat[i : i + sampling.n] for c in row] for i in range(0, len(flat), sampling.n)]
        else:
            out = self._generate(prompts, sampling, adapter, **reporting)
        if progress is not None and (untold := sum(map(len, out)) - told) > 0:
            progress(untold)
        return out

    @abstractmethod
    def _generate(self, prompts: list[str], sampling: Sampling, adapter: str | None) -> list[list[Completion]]:
        """Non-empty prompts; greedy calls come with n=1. A backend with `reports_progress` also takes
        `progress: Callable[[int], None]` and calls it with each request's completions as the request ends."""

    def next_token_logprobs(self, prompts: list[str], token_ids: list[int],
                            adapter: str | None = None) -> list[list[float]]:
        """Per prompt, the log-probability of each of `token_ids` as the next token under the model's own
        distribution (temperature 1, the whole vocabulary): what a rollout's design step reweights and draws from."""
        raise GenerationError(f"the {self.backend} backend cannot read next-token log-probabilities "
                              "(rollout.choice_step); use vllm, hf, or a vLLM server")

    def cache_counts(self):  # noqa: ANN201 - a prefix_cache.CacheCounts where the engine keeps one
        """The engine's prefix-cache counts since it started (vLLM's); None where it keeps none."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free the engine (GPU memory, server sessions)."""

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
