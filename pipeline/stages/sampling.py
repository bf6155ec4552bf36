"""Sampling helpers shared by the rollout stage, self-repair and the refine mode: a generation request, the
deterministic generation ids, per-prompt seeded randomness and the batching of requests into engine calls."""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.engines.generation.base import BLOCK_END
from pipeline.engines.prompting import Design, design_prefix

if TYPE_CHECKING:
    from pipeline.config import GeneratorConfig, RolloutConfig, RunConfig
    from pipeline.engines.benchmarks.base import Item


@dataclass
class Request:
    """One prompt and the slots it fills (n = len(slots))."""

    kind: str  # agent | workflow
    query_id: str
    parent_id: str | None
    gen_ids: list[str]
    slots: list[int]
    prompt_text: str
    exemplar_ids: list[str]
    max_new_tokens: int
    prefix: str = ""  # opens the assistant turn; `text` = prefix + completion
    example: str | None = None  # the example menu's design the prompt shows (None: no menu)


def gen_id(round: int, query_id: str, kind: str, slot: int, parent_id: str | None = None) -> str:
    """Unique within a run: the round, the query and the slot path (agent a<i>, workflow w<j>)."""
    if parent_id is not None:
        return f"{parent_id}-w{slot}"
    return f"r{round}-{query_id}-{'a' if kind == 'agent' else 'w'}{slot}"


def seeded_rng(seed: int, key: str) -> random.Random:
    return random.Random(zlib.crc32(f"{seed}:{key}".encode()))


def draw_design(seed: int, query_id: str, slot: int, k: int) -> int:
    """Which of k menu designs the prompt of (query, slot) shows: a seeded hash, so the base model and every trained
    round (and every experiment seed: `rollout.menu_seed` is not the generator's seed) see the same draws."""
    if k <= 0:
        raise ValueError(f"draw_design: a menu of {k} designs")
    return zlib.crc32(f"{seed}:{query_id}:{slot}".encode()) % k


def drawn_design(rollout: RolloutConfig, menu: list[Design], key: str, slot: int) -> Design | None:
    """The menu design the prompt of (`key`: a query or a refine task, `slot`) shows (`draw_design`); None without a
    menu or where the policy chooses (menu_choice policy). SMC's particles and a W4S task take slot 0's, as a flat
    rollout's first sample."""
    if not menu or rollout.menu_choice == "policy":
        return None
    return menu[draw_design(rollout.menu_seed, key, slot, len(menu))]


def opening(rollout: RolloutConfig, design: Design | None) -> str:
    """How a workflow prompt's assistant turn opens: the drawn design's first lines (`rollout.menu_prefix_lines`),
    else `rollout.workflow_prefix`."""
    if design is not None and rollout.menu_prefix_lines is not None:
        return design_prefix(design, rollout.menu_prefix_lines)
    return rollout.workflow_prefix


def batches(requests: list[Request], size: int) -> Iterator[list[Request]]:
    """Consecutive requests of the same kind, n and token cap, at most `size` prompts per generation call."""
    batch: list[Request] = []
    for r in requests:
        if batch and (len(batch) == size or (r.kind, len(r.slots), r.max_new_tokens) !=
                      (batch[0].kind, len(batch[0].slots), batch[0].max_new_tokens)):
            yield batch
            batch = []
        batch.append(r)
    if batch:
        yield batch


def stops(g: GeneratorConfig, kind: str) -> tuple[str, ...]:
    """A sample's stop strings: a workflow ends where its code block closes (generator.stop_at_block_end)."""
    return (BLOCK_END,) if kind == "workflow" and g.stop_at_block_end else ()


@dataclass(frozen=True)
class PromptSharing:
    """How much of a config's workflow prompts a training pass can compute once (`pipeline.core.packing
    .shared_prefix`): the token prefix every rendered prompt opens with, against their mean length."""

    prompts: int
    common: int  # tokens every prompt opens with
    mean: float  # the prompts' mean length in tokens

    @property
    def share(self) -> float:
        return self.common / self.mean if self.mean else 0.0

    def query_first(self, min_prefix: int) -> bool:
        """Whether the template leaves most of its fixed text unshared: a per-query part (the query) comes before it,
        so under half the prompt, or fewer than `min_prefix` tokens (training.shared_prefix_min), is common."""
        return self.prompts > 1 and (self.share < 0.5 or self.common < min_prefix)


def workflow_prompt_ids(cfg: RunConfig, items: Sequence[Item], family: str, tokenizer) -> list[list[int]]:
    """The token ids of the workflow prompts of `items` as round 0's flat rollout renders them (no exemplars; with an
    example menu, the design a hash draws for slot 0 unless the policy chooses), assistant turn opened."""
    from pipeline.engines.prompting import load_design, render, workflow_prompt

    rollout = cfg.rollout
    menu = [load_design(p) for p in rollout.example_menu]
    ids = []
    for item in items:
        design = None if not menu or rollout.menu_choice == "policy" else \
            menu[draw_design(rollout.menu_seed, item.id, 0, len(menu))]
        user = workflow_prompt(item.prompt, family, (), None, None, rollout.prompt_dir, design, menu)
        text = render(tokenizer, user, None, rollout.prompt_dir) + opening(rollout, design)
        ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids


def prompt_sharing(cfg: RunConfig, items: Sequence[Item], family: str, tokenizer, queries: int = 4) -> PromptSharing:
    """The workflow prompts of the first `queries` of `items` (`workflow_prompt_ids`): their common token prefix and
    mean length. A template that puts the query before its fixed text shares little."""
    from pipeline.core.packing import common_prefix

    ids = workflow_prompt_ids(cfg, items[:queries], family, tokenizer)
    return PromptSharing(len(ids), common_prefix(ids), sum(map(len, ids)) / len(ids) if ids else 0.0)
