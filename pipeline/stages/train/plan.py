"""The step plan: every optimiser step's rows and the passes that compute them (`pipeline.core.packing` on the
round's sequences). A function of the seed and the rows alone, so a resumed stage runs the same remaining steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pipeline.core.packing import Pass, RowShape, pack, plan_steps, step_units
from pipeline.stages.train.data import TrainSequence

if TYPE_CHECKING:
    from pipeline.config import TrainingConfig


@dataclass
class PlannedStep:
    """One optimiser step: its epoch and its forward/backward passes."""

    epoch: int
    passes: list[Pass]

    @property
    def rows(self) -> list[int]:
        return [r for p in self.passes for r in p.rows]


def row_shapes(seqs: list[TrainSequence]) -> list[RowShape]:
    """What `pipeline.core.packing` plans with: identity, group, the prompt a pass encodes once, completion length."""
    return [RowShape(s.gen_id, s.group_id, tuple(s.prompt_ids[:-1]), len(s.completion_ids)) for s in seqs]


def pass_budget(train_cfg: TrainingConfig) -> int:
    """Padded token positions a pass may hold: training.micro_batch_tokens, or by default the worst case of the
    fixed micro-batches the config's names come from (micro_batch_size sequences of max_seq_len): a pass then holds
    no more token positions than such a micro-batch (it also holds its prompts' keys and values once per sequence)."""
    return train_cfg.micro_batch_tokens or train_cfg.micro_batch_size * train_cfg.max_seq_len


def step_plan(seqs: list[TrainSequence], train_cfg: TrainingConfig, rng: np.random.Generator,
              paired: bool = False) -> list[PlannedStep]:
    """Every optimiser step's passes: its rows (`pipeline.core.packing.plan_steps`, training.step_order,
    micro_batch_size x grad_accum rows a step), one unit per distinct sequence (or pair), packed by tokens (a shared
    prompt prefix counted once, training.shared_prefix_min)."""
    shapes = row_shapes(seqs)
    unit = 2 if paired else 1
    epochs = plan_steps(shapes, train_cfg.epochs, train_cfg.micro_batch_size * train_cfg.grad_accum * unit, rng,
                        train_cfg.step_order, unit)
    return [PlannedStep(e, pack(step_units(rows, shapes, paired), shapes, pass_budget(train_cfg),
                                train_cfg.shared_prefix_min))
            for e, steps in enumerate(epochs) for rows in steps]
