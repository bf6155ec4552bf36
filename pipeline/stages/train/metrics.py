"""What the train stage logs per optimiser step: one rank's running sums over the step's passes (`StepSums`), summed
over ranks into a `train_metrics` row (`StepMetrics`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.core.grpo import LossTerms, k3, reduce_tokens
from pipeline.core.objectives import LossInput
from pipeline.stages.train.data import TrainSequence


@dataclass
class StepMetrics:
    """One optimiser step: a row of `train_metrics`."""

    step: int
    epoch: int
    loss: float
    pg_loss: float
    kl: float | None  # mean k3(π_θ, π_ref): the loss's KL term (objectives with one; see LossTerms.kl)
    kl_old: float | None  # KL(π_old‖π_θ) estimated on π_old's samples (k3; objectives with a ratio)
    clip_frac: float | None  # share of completion tokens whose clipped branch is active (ratio objectives)
    ratio_dev: float | None  # max |π_θ/π_old - 1|
    lr: float
    grad_norm: float
    tokens: int  # completion tokens of the step's rows
    padding_share: float  # share of the step's computed token positions that were padding
    logp_mismatch: float | None  # mean |generation-time - trainer π_old| per token
    wall_s: float


@dataclass
class StepSums:
    """One rank's running sums over a step's passes (`pipeline.stages.parallel.reduce_step` adds the ranks')."""

    loss: float = 0.0
    pg_loss: float = 0.0
    kl: float | None = None
    kl_old: float | None = None
    clip_frac: float | None = None
    ratio_dev: float | None = None  # a max, not a sum
    tokens: float = 0.0
    slots: float = 0.0  # token positions computed (padding included)
    real: float = 0.0  # of which real tokens
    mismatch: float = 0.0  # Σ |generation-time - trainer π_old| over tokens
    mismatch_tokens: float = 0.0

    def add_terms(self, terms: LossTerms, share: float, tok_share: float, loss_share: float) -> None:
        self.loss += float(terms.loss.detach()) * loss_share
        self.pg_loss += float(terms.pg_loss) * loss_share
        if terms.kl is not None:
            self.kl = (self.kl or 0.0) + float(terms.kl) * share
        if terms.clip_frac is not None:
            self.clip_frac = (self.clip_frac or 0.0) + float(terms.clip_frac) * tok_share
        if terms.ratio_dev is not None:
            self.ratio_dev = max(self.ratio_dev or 0.0, float(terms.ratio_dev))

    def add_kl_old(self, inp: LossInput, share: float, norm: str) -> None:
        """k3 of π_θ against π_old on π_old's samples (what the samples estimate; the loss's KL is to π_ref)."""
        if inp.old_logp is not None:
            self.kl_old = (self.kl_old or 0.0) + share * float(
                reduce_tokens(k3(inp.old_logp, inp.logp.detach()), inp.mask.float(), norm))

    def add_mismatch(self, uniq: list[TrainSequence], old: dict[str, torch.Tensor] | None) -> None:
        for s in uniq:
            if s.gen_logprobs is not None and old is not None and not s.off_policy:  # μ is not the sampler's π
                skip = int(s.drawn_label)  # a drawn label's log-prob is the draw's (TrainSequence.drawn_label)
                self.mismatch += float((torch.tensor(s.gen_logprobs[skip:]) - old[s.gen_id][skip:]).abs().sum())
                self.mismatch_tokens += len(s.gen_logprobs) - skip

    @property
    def padding_share(self) -> float:
        return 1 - self.real / self.slots if self.slots else 0.0

    @property
    def logp_mismatch(self) -> float | None:
        return self.mismatch / self.mismatch_tokens if self.mismatch_tokens else None
