"""A pass's input to the objective (`pipeline.core.objectives.LossInput`): its rows' log-probs, coefficients, π_old /
reference log-probs, two-level weights and KL masks, and the pass's share of its optimiser step's loss.

A two-level round's loss is the proposal's: an agent term and a workflow term, each averaged over its own rows of the
optimiser step, weighted by training.two_level (`step_weights`), each level's KL masked or not by its switch
(`kl_masks`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pipeline.core.grpo import level_weights
from pipeline.core.objectives import LossInput
from pipeline.core.packing import Pass
from pipeline.stages.train.batch import Batch, PackedBatch
from pipeline.stages.train.data import TrainSequence

if TYPE_CHECKING:
    from pipeline.config import TrainingConfig


def step_weights(seqs: list[TrainSequence], rows: list[int], train_cfg: TrainingConfig) -> dict[int, float] | None:
    """Two-level: each row's factor c_b in its optimiser step's loss (`pipeline.core.grpo.level_weights`: agent and
    workflow terms, each averaged over its own rows of the step, weighted by training.two_level); flat: None (a
    step's loss is the mean over its rows, or its completion tokens under loss_norm=token, as SPOGW)."""
    if all(seqs[i].level == "flat" for i in rows):
        return None
    # curation.choice_credit's levels: the label's term and the code's, each averaged over its own rows
    w = {"agent": train_cfg.two_level.agent_weight, "workflow": train_cfg.two_level.workflow_weight,
         "choice": 1.0, "code": 1.0}
    c = level_weights([seqs[i].level for i in rows], [len(seqs[i].completion_ids) for i in rows], w,
                      train_cfg.loss_norm)
    return dict(zip(rows, c.tolist(), strict=True))


def kl_masks(seqs: list[TrainSequence], train_cfg: TrainingConfig) -> bool | torch.Tensor:
    """The advantage mask of the KL term per sequence: training.kl_mask for flat sequences, the level's switch
    (training.two_level.*_kl_mask) for agent and workflow sequences."""
    if all(s.level == "flat" for s in seqs):
        return train_cfg.kl_mask
    switch = {"flat": train_cfg.kl_mask, "agent": train_cfg.two_level.agent_kl_mask,
              "workflow": train_cfg.two_level.workflow_kl_mask, "choice": train_cfg.kl_mask, "code": train_cfg.kl_mask}
    return torch.tensor([switch[s.level] for s in seqs])


def pass_shares(seqs: list[TrainSequence], pass_: Pass, step_rows: list[int], norm: str) -> tuple[float, float]:
    """(share, token share) of a pass in its step: its rows' share of the step's rows (norm="sequence") or of its
    completion tokens (norm="token"), and its rows' share of the completion tokens. An objective returns the mean
    over the rows it is given; times `share`, the passes' losses sum to the step's mean."""
    tokens = lambda rows: sum(len(seqs[r].completion_ids) for r in rows)  # noqa: E731
    tok_share = tokens(pass_.rows) / max(tokens(step_rows), 1)
    return (len(pass_.rows) / len(step_rows) if norm == "sequence" else tok_share), tok_share


def _pad_rows(rows: list[torch.Tensor], width: int, device: torch.device | str) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for b, r in enumerate(rows):
        out[b, : len(r)] = r
    return out.to(device)


def _seq_tensor(seqs: list[TrainSequence], rows: list[int], field: str,
                device: torch.device | str) -> torch.Tensor | None:
    vals = [getattr(seqs[i], field) for i in rows]
    return None if any(v is None for v in vals) else torch.tensor(vals, dtype=torch.float32, device=device)


def pass_loss_input(seqs: list[TrainSequence], pass_: Pass, logp: torch.Tensor, batch: Batch | PackedBatch,
                    train_cfg: TrainingConfig, old: dict[str, torch.Tensor] | None, ref: dict[str, torch.Tensor] | None,
                    weights: dict[int, float] | None, device: torch.device | str) -> LossInput:
    """The objective's input for a pass's rows: each row takes its sequence's log-probs (computed once, `take`),
    with its own coefficient; the rows of one sequence then add their loss terms, and its gradient is their sum.
    `old` / `ref`: π_old / reference log-probs per gen_id (None: the objective has none)."""
    rows = [seqs[r] for r in pass_.rows]
    take = torch.tensor(pass_.take, device=logp.device)
    width = logp.shape[1]
    gens = lambda lps: _pad_rows([lps[s.gen_id] for s in rows], width, device)  # noqa: E731
    off = [s.off_policy for s in rows]
    behaviour = None if not any(off) else _pad_rows(
        [torch.tensor(s.gen_logprobs if s.off_policy else [0.0] * len(s.completion_ids)) for s in rows], width,
        device)
    return LossInput(
        logp=logp.float().index_select(0, take), mask=batch.completion_mask.index_select(0, take),
        coef=torch.tensor([s.advantage for s in rows], dtype=torch.float32, device=device),
        old_logp=None if old is None else gens(old), ref_logp=None if ref is None else gens(ref),
        scores=_seq_tensor(seqs, pass_.rows, "score", device), kl_mask=kl_masks(rows, train_cfg),
        seq_weights=None if weights is None else torch.tensor([weights[r] for r in pass_.rows], device=device),
        behaviour_logp=behaviour, off_policy=None if behaviour is None else torch.tensor(off, device=device))
