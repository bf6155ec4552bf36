"""Which rows each optimiser step of the train stage trains, and which sequences each of its forward/backward passes
computes (pure: indices in, indices out; the train stage is `pipeline.stages.train`).

A row is one member of one curated group: a sequence (prompt + completion, a generation) with that group's
coefficient. Top-N screening keeps overlapping groups, so one generation can be several rows of a step; a pass
computes it once (`Pass.uniq`) and every row that uses it takes its log-probs (`Pass.take`). The passes of a step
are packed by padded token count (`pack`): a pass computes each distinct prompt once
(`pipeline.stages.train.batch.collate`), so its cost is prompts x longest prompt + sequences x longest completion.
Prompts that differ but open alike (a task's fixed instructions and examples, then the query) share more: with
`min_prefix` > 0, the prompts' longest common prefix, when it has at least `min_prefix` tokens and the pass holds more
than one prompt, is computed once and each prompt computes only the rest (`shared_prefix`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Pass", "RowShape", "plan_steps", "step_units", "pack", "logprob_passes", "pass_slots", "common_prefix",
           "shared_prefix"]


@dataclass(frozen=True)
class RowShape:
    """What packing needs to know of a row."""

    gen_id: str  # the sequence's identity: rows with the same gen_id hold the same tokens
    group_id: str | None
    prompt: tuple[int, ...]  # the prompt minus its last token: what a pass encodes once (train.batch.collate)
    completion_len: int


@dataclass
class Pass:
    """One forward/backward pass: the rows it trains and the distinct sequences it computes."""

    rows: list[int]  # row indices (pairs stay adjacent)
    uniq: list[int]  # one row per distinct gen_id among `rows`, in first-appearance order: the pass's sequences
    take: list[int]  # per row of `rows`, the position of its sequence in `uniq`


def _pass(rows: list[int], shapes: Sequence[RowShape]) -> Pass:
    pos: dict[str, int] = {}
    uniq = []
    for r in rows:
        if shapes[r].gen_id not in pos:
            pos[shapes[r].gen_id] = len(uniq)
            uniq.append(r)
    return Pass(rows, uniq, [pos[shapes[r].gen_id] for r in rows])


def common_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the longest token prefix all of `prompts` share (0 for none or no prompts)."""
    if not prompts:
        return 0
    first, n = prompts[0], min(map(len, prompts))
    for other in prompts[1:]:
        n = next((i for i in range(n) if other[i] != first[i]), n)
    return n


def shared_prefix(prompts: Sequence[Sequence[int]], min_prefix: int) -> int:
    """Tokens of the distinct `prompts` a pass computes once for all of them: their common prefix when there are at
    least two prompts, `min_prefix` > 0 and the prefix has at least `min_prefix` tokens, else 0 (each prompt whole:
    below a few dozen tokens the saving does not pay the extra decoder call)."""
    if min_prefix <= 0 or len(prompts) < 2:
        return 0
    n = common_prefix(prompts)
    return n if n >= min_prefix else 0


def pass_slots(rows: Sequence[int], shapes: Sequence[RowShape], min_prefix: int = 0) -> int:
    """Token positions a pass over `rows` computes, padding included: the prompts' shared prefix once
    (`shared_prefix`), each distinct prompt's rest once at the longest rest's length, each distinct sequence once at
    the longest completion's."""
    prompts = list({shapes[r].prompt: None for r in rows})
    gens = {shapes[r].gen_id for r in rows}
    prefix = shared_prefix(prompts, min_prefix)
    return prefix + len(prompts) * (max(map(len, prompts), default=0) - prefix) + \
        len(gens) * max((shapes[r].completion_len for r in rows), default=0)


def _row_order(n: int, rng: np.random.Generator, unit: int, step_rows: int) -> list[list[int]]:
    """Steps of one epoch in the row order: shuffled units of `unit` rows, `step_rows // unit` units a step."""
    order = rng.permutation(n // unit).tolist()
    per = max(step_rows // unit, 1)
    return [[u * unit + k for u in order[i: i + per] for k in range(unit)] for i in range(0, len(order), per)]


def _group_order(shapes: Sequence[RowShape], rng: np.random.Generator, step_rows: int) -> list[list[int]]:
    """Steps of one epoch in the group order: whole groups, the groups of one prompt next to each other (prompts
    and the groups of each in shuffled order), as many groups a step as fit in `step_rows` rows (at least one)."""
    groups: dict[str | None, list[int]] = {}
    for r, s in enumerate(shapes):
        groups.setdefault(s.group_id if s.group_id is not None else f"row{r}", []).append(r)
    by_prompt: dict[tuple[int, ...], list[list[int]]] = {}
    for rows in groups.values():
        by_prompt.setdefault(shapes[rows[0]].prompt, []).append(rows)
    prompts = list(by_prompt.values())
    steps: list[list[int]] = []
    for p in rng.permutation(len(prompts)).tolist():
        for g in rng.permutation(len(prompts[p])).tolist():
            rows = prompts[p][g]
            if not steps or len(steps[-1]) + len(rows) > step_rows:
                steps.append([])
            steps[-1].extend(rows)
    return steps


def plan_steps(shapes: Sequence[RowShape], epochs: int, step_rows: int, rng: np.random.Generator,
               order: str = "groups", unit: int = 1) -> list[list[list[int]]]:
    """Per epoch, the rows of each of its optimiser steps. order="rows": shuffled rows (units of `unit`: 2 keeps
    score_dpo's (chosen, rejected) pairs whole), `step_rows` a step; "groups": whole groups, a prompt's groups
    together (`_group_order`), so a step's rows share prompts and often sequences."""
    if order not in ("rows", "groups"):
        raise ValueError(f"order must be 'rows' or 'groups', got {order!r}")
    return [_row_order(len(shapes), rng, unit, step_rows) if order == "rows" else _group_order(shapes, rng, step_rows)
            for _ in range(epochs)]


def step_units(rows: Sequence[int], shapes: Sequence[RowShape], paired: bool = False) -> list[list[int]]:
    """A step's rows in the units a pass keeps whole: each (chosen, rejected) pair when `paired`, else all the rows
    of one sequence (so every distinct sequence of the step is computed by exactly one pass)."""
    if paired:
        return [list(rows[i: i + 2]) for i in range(0, len(rows), 2)]
    units: dict[str, list[int]] = {}
    for r in rows:
        units.setdefault(shapes[r].gen_id, []).append(r)
    return list(units.values())


def pack(units: list[list[int]], shapes: Sequence[RowShape], budget: int, min_prefix: int = 0) -> list[Pass]:
    """Units into passes of at most `budget` padded token positions (`pass_slots`, a shared prefix counted once under
    `min_prefix`; a unit larger than the budget gets a pass of its own). Units are taken by prompt (longest first,
    so similar lengths meet) and, within a prompt, by completion length (longest first): a pass then shares prompts
    and pads completions little."""
    first: dict[tuple[int, ...], int] = {}
    for i, unit in enumerate(units):
        first.setdefault(shapes[unit[0]].prompt, i)
    def key(u: list[int]) -> tuple[int, int, int]:
        prompt = shapes[u[0]].prompt
        return -len(prompt), first[prompt], -max(shapes[r].completion_len for r in u)

    passes: list[list[int]] = []
    for unit in sorted(units, key=key):
        if passes and pass_slots(passes[-1] + unit, shapes, min_prefix) <= budget:
            passes[-1].extend(unit)
        else:
            passes.append(list(unit))
    return [_pass(rows, shapes) for rows in passes]


def logprob_passes(first_step: list[Pass], shapes: Sequence[RowShape], budget: int,
                   min_prefix: int = 0) -> list[Pass]:
    """The passes of a π_old / reference pass over every distinct sequence: the first optimiser step's passes
    exactly as training runs them, then one row per remaining gen_id, packed. Kernels round differently at another
    padded shape (up to 2e-5 in fp32 here, far more in bf16), so laid out this way the first step computes π_θ
    exactly as π_old was computed: ρ = 1 and k3 = 0 before any update."""
    seen = {shapes[r].gen_id for p in first_step for r in p.rows}
    rest = []
    for r, s in enumerate(shapes):
        if s.gen_id not in seen:
            seen.add(s.gen_id)
            rest.append([r])
    return list(first_step) + pack(rest, shapes, budget, min_prefix)
