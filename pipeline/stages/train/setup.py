"""Step 1 of the train stage (`load_stage`): the objective, the round's rows, the policy and the step plan, as one
`TrainSetup` that the passes and the optimiser loop share."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeline.stages.modes import get_mode
from pipeline.stages.train.data import TrainSequence, load_sequences
from pipeline.stages.train.logprobs import completion_logprobs
from pipeline.stages.train.plan import PlannedStep, step_plan
from pipeline.stages.train.policy import frozen_linears_bf16, load_policy

if TYPE_CHECKING:
    from accelerate import Accelerator
    from peft import PeftModel

    from pipeline.config import TrainingConfig
    from pipeline.core.objectives import Objective
    from pipeline.run import RunContext

log = logging.getLogger(__name__)


@dataclass
class TrainSetup:
    """What the passes and the optimiser loop share."""

    ctx: RunContext
    objective: Objective
    accel: Accelerator
    seqs: list[TrainSequence]  # the rows; `PlannedStep`s and passes hold indices into it
    data_counts: dict[str, int]  # what `load_sequences` dropped, cut and trained on, for the manifest
    model: PeftModel
    policy: torch.nn.Module  # the same model, as DDP sees it (`pipeline.stages.parallel.LogprobModule`)
    pad_id: int
    steps: list[PlannedStep]
    bf16: bool  # training.bf16 resolved for this device (auto: native bf16 only)

    @property
    def train_cfg(self) -> TrainingConfig:
        return self.ctx.cfg.training

    @property
    def shard(self) -> tuple[int, int]:
        """(rank, ranks)."""
        return self.accel.process_index, self.accel.num_processes


def check_objective(ctx: RunContext) -> Objective:
    """training.objective, refused when curation writes no rows of its kind for the rollout mode or it needs a
    reference that training.reference turns off."""
    from pipeline.core.objectives import get_objective

    train_cfg = ctx.cfg.training
    objective = get_objective(train_cfg.objective)
    mode = get_mode(ctx.cfg.rollout.mode)
    if mode.objective_kinds is not None and objective.kind not in mode.objective_kinds:
        raise ValueError(f"training.objective={objective.name} trains on {objective.kind} rows, which curation does "
                         f"not write for rollout.mode {mode.name} (it writes {', '.join(mode.objective_kinds)} rows)")
    if objective.needs_ref and train_cfg.reference == "none":
        raise ValueError(f"training.objective={objective.name} needs a reference model; training.reference is 'none'")
    return objective


def load_stage(ctx: RunContext, objective: Objective, accel: Accelerator) -> TrainSetup:
    """Step 1: the round's rows, the policy (the same fresh LoRA on every rank), the step plan; DDP wraps the
    policy (and broadcasts rank 0's weights, so π_old / reference come from the weights every rank trains)."""
    from pipeline.engines.hardware import resolve_bf16
    from pipeline.engines.models import load_tokenizer
    from pipeline.run import derived_seed
    from pipeline.stages.parallel import LogprobModule

    train_cfg = ctx.cfg.training
    torch.manual_seed(derived_seed(train_cfg.seed, "train", ctx.round))
    seqs, data_counts = load_sequences(ctx, objective.kind)
    if not seqs:
        log.warning("round %d has no kept %s rows: the checkpoint is the unchanged adapter", ctx.round, objective.kind)
    pad_id = load_tokenizer(ctx.cfg.generator.model).pad_token_id or 0
    model = load_policy(ctx, accel.device)
    bf16 = resolve_bf16(train_cfg.bf16, accel.device.type)
    if bf16:
        frozen_linears_bf16(model)
    if train_cfg.gradient_checkpointing:
        model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rng = np.random.default_rng(derived_seed(train_cfg.seed, "steps", ctx.round))
    steps = step_plan(seqs, train_cfg, rng, objective.paired) if seqs else []
    policy = accel.prepare(LogprobModule(model, completion_logprobs))
    return TrainSetup(ctx, objective, accel, seqs, data_counts, model, policy, pad_id, steps, bf16)
