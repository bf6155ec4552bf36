"""Training objectives: pure tensor functions registered by name (the pattern of verl's `register_policy_loss`).

The train stage is one loop (pipeline/stages/train/stage.py); `training.objective` picks one entry of `OBJECTIVES`,
which says what curated data it trains on (a `kind` of the `groups` table, written by the curate stage) and which
log-prob passes it needs (π_old for a ratio, a reference for a KL or a preference margin). Each function takes one
pass's rows (`LossInput`) and the training config, and returns `LossTerms`; no model and no I/O here, so every
formula is checked against hand-computed values (tests/test_objectives.py).

| name        | data (`kind`) | loss over a pass's rows                                                           |
|-------------|---------------|-----------------------------------------------------------------------------------|
| iogrpo_mkl  | group         | SPOGW eq. 3.6: clipped ratio·A, β·k3 only where A > 0 (`training.kl_mask`)         |
| grpo        | group         | the same surrogate, β·k3 on every token (DeepSeekMath's GRPO)                      |
| rwr         | weighted      | reward-weighted regression: Σ_b w_b·NLL_b, w = exp(r/τ) (W4S's RLAO on refine runs) |
| score_dpo   | pair          | ScoreFlow's Score-DPO: -log σ(β[s_w·(π_w - ref_w) - (1 - s_l)·(π_l - ref_l)])       |
| sft_best    | best          | NLL of each query's best workflow (rejection sampling)                             |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.core.grpo import LossTerms, grpo_mkl_terms, k3, reduce_tokens

KINDS = ("group", "pair", "weighted", "best")  # the `kind` of a `groups` row; null (parts before kinds) = group


@dataclass
class LossInput:
    """One pass's rows, [B, T] over their completion tokens (0 on padding)."""

    logp: torch.Tensor  # π_θ log-probs, with grad
    mask: torch.Tensor  # completion mask
    coef: torch.Tensor  # [B] group: the advantage A; pair / weighted / best: the row's loss weight
    old_logp: torch.Tensor | None = None  # π_old (objectives with a ratio)
    ref_logp: torch.Tensor | None = None  # the reference (objectives with a KL or a margin)
    scores: torch.Tensor | None = None  # [B] member scores (score_dpo: chosen at even, rejected at odd positions)
    kl_mask: bool | torch.Tensor = True  # iogrpo_mkl: the advantage mask, one switch or one per sequence
    seq_weights: torch.Tensor | None = None  # [B] two-level level weights (pipeline.core.grpo.level_weights)
    behaviour_logp: torch.Tensor | None = None  # [B, T] the log-probs logged rows were sampled with (μ)
    off_policy: torch.Tensor | None = None  # [B] bool: a logged row (its ratio is training.off_policy's rule)


@dataclass(frozen=True)
class Objective:
    name: str
    kind: str  # the curated rows it trains on (KINDS)
    fn: Callable[[LossInput, object], LossTerms]
    needs_old: bool  # π_old log-probs (a ratio)
    needs_ref: bool  # reference log-probs; without one (`training.reference: none`) the objective refuses to run
    uses_ref: bool  # a reference enters the loss when there is one (a KL term)
    paired: bool = False  # sequences come in (chosen, rejected) pairs that a pass never splits


OBJECTIVES: dict[str, Objective] = {}


def register_objective(name: str, kind: str, *, needs_old: bool = False, needs_ref: bool = False,
                        uses_ref: bool = False, paired: bool = False) -> Callable:
    """Decorator: register `fn(inp: LossInput, training: TrainingConfig) -> LossTerms` under `name`."""
    if kind not in KINDS:
        raise ValueError(f"objective {name!r}: kind must be one of {KINDS}, got {kind!r}")

    def deco(fn: Callable) -> Callable:
        if name in OBJECTIVES:
            raise ValueError(f"objective {name!r} is already registered")
        OBJECTIVES[name] = Objective(name, kind, fn, needs_old, needs_ref, uses_ref or needs_ref, paired)
        return fn

    return deco


def get_objective(name: str) -> Objective:
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ValueError(f"unknown objective {name!r}; registered: {', '.join(OBJECTIVES)}") from None


def _clipped(inp: LossInput, training, kl_mask: bool | torch.Tensor) -> LossTerms:
    """The clipped-ratio surrogate with β·k3 where `kl_mask` allows it (pipeline.core.grpo.grpo_mkl_terms)."""
    return grpo_mkl_terms(inp.logp, inp.old_logp, inp.ref_logp, inp.coef, inp.mask,
                          training.beta if inp.ref_logp is not None else 0.0, training.clip_eps, kl_mask,
                          norm=training.loss_norm, seq_weights=inp.seq_weights, behaviour_logp=inp.behaviour_logp,
                          off_policy=inp.off_policy, off_rule=training.off_policy, off_gamma=training.luffy_gamma)


@register_objective("iogrpo_mkl", "group", needs_old=True, uses_ref=True)
def iogrpo_mkl(inp: LossInput, training) -> LossTerms:
    """SPOGW's ioGRPO with the advantage-masked KL (pipeline.core.grpo.grpo_mkl_terms)."""
    return _clipped(inp, training, inp.kl_mask)


@register_objective("grpo", "group", needs_old=True, uses_ref=True)
def grpo(inp: LossInput, training) -> LossTerms:
    """Plain GRPO: the same clipped surrogate, the KL on every completion token (no advantage mask)."""
    return _clipped(inp, training, False)


def weighted_nll(logp: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor, norm: str = "sequence",
                 seq_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_b w_b·(-log π(y_b)) reduced as the GRPO losses are: norm="sequence": mean over sequences of w_b times the
    token mean; "token": Σ_b w_b Σ_t(-logp) / all completion tokens."""
    w = weights.to(logp.dtype).unsqueeze(1)
    return reduce_tokens(-logp * w, mask.to(logp.dtype), norm, seq_weights)


def _nll_terms(inp: LossInput, training) -> LossTerms:
    loss = weighted_nll(inp.logp, inp.mask, inp.coef, training.loss_norm, inp.seq_weights)
    return LossTerms(loss, loss.detach(), None, None, None)


@register_objective("rwr", "weighted")
def rwr(inp: LossInput, training) -> LossTerms:
    """Reward-weighted regression (W4S's RLAO): weighted NLL with w = exp(r/τ) from curation, no KL."""
    return _nll_terms(inp, training)


@register_objective("sft_best", "best")
def sft_best(inp: LossInput, training) -> LossTerms:
    """SFT on each query's best workflow (rejection sampling): NLL, weight 1 per kept workflow."""
    return _nll_terms(inp, training)


def score_dpo_loss(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, scores: torch.Tensor,
                   weights: torch.Tensor, beta: float) -> torch.Tensor:
    """ScoreFlow's Score-DPO over P pairs laid out (chosen, rejected) at rows (2p, 2p+1): with sequence log-probs
    π = Σ_t logp and the reference's R, z_p = β·[s_w·(π_w - R_w) - (1 - s_l)·(π_l - R_l)] and
    loss = mean_p w_p·(-log σ(z_p)).
    s = 1, 0 gives DPO's margin; a chosen workflow that scored little pulls less, a rejected one that nearly
    passed pushes less."""
    if logp.shape[0] % 2:
        raise ValueError(f"score_dpo needs (chosen, rejected) pairs: got {logp.shape[0]} sequences")
    m = mask.to(logp.dtype)
    seq = (logp * m).sum(-1) - (ref_logp.to(logp.dtype) * m).sum(-1)
    s = scores.to(logp.dtype)
    z = beta * (s[0::2] * seq[0::2] - (1 - s[1::2]) * seq[1::2])
    return (weights.to(logp.dtype)[0::2] * -F.logsigmoid(z)).mean()


@register_objective("score_dpo", "pair", needs_ref=True, paired=True)
def score_dpo(inp: LossInput, training) -> LossTerms:
    """ScoreFlow's Score-DPO on score-gap-sampled pairs, reference = `training.reference` (ScoreFlow: base)."""
    if inp.ref_logp is None or inp.scores is None:
        raise ValueError("score_dpo needs reference log-probs and member scores")
    loss = score_dpo_loss(inp.logp, inp.ref_logp, inp.mask, inp.scores, inp.coef, training.dpo_beta)
    with torch.no_grad():
        kl = reduce_tokens(k3(inp.logp, inp.ref_logp), inp.mask.to(inp.logp.dtype), training.loss_norm)
    return LossTerms(loss, loss.detach(), kl, None, None)
