"""GRPO maths, pure functions (docs/design.md §6): group advantages and the advantage-masked-KL loss.

No I/O and no model here: arrays/tensors in, arrays/tensors out, so every formula is unit-tested
against hand-computed values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch


def group_advantages(scores: Sequence[float], eps: float = 1e-6) -> np.ndarray:
    """(s - mean) / (std + eps) within one group; population std (ddof=0), the same spread the
    variance screening ranks by. An all-equal group gets all-zero advantages (no signal, no NaN)."""
    s = np.asarray(scores, dtype=float)
    if s.size == 0:
        return s
    return (s - s.mean()) / (s.std() + eps)


def normalise(values: Sequence[float], mean: float, std: float, eps: float = 1e-6) -> np.ndarray:
    """(v - mean) / (std + eps) with externally computed statistics (batch-level two-level advantages)."""
    return (np.asarray(values, dtype=float) - mean) / (std + eps)


def level_weights(levels: Sequence[str], lengths: Sequence[int], weights: Mapping[str, float],
                  norm: Literal["sequence", "token"] = "sequence") -> np.ndarray:
    """Per-sequence factors c_b of a loss that sums one term per level (the two-level proposal, §4.3 eq. of
    L_GRPO: an agent term averaged over the N_A plans plus a workflow term averaged over the N_A·N_W workflows),
    each term weighted by `weights[level]`. The loss is -Σ_b c_b Σ_t (objective of token t of sequence b) with
    - norm="sequence": c_b = w_l / (n_l · T_b): per level, the mean over its sequences of the token mean;
    - norm="token":    c_b = w_l / N_l: per level, the mean over all its completion tokens;
    n_l / N_l the sequences / completion tokens of level l among the given ones (one optimiser step), T_b the
    length of sequence b. Pooling the levels as equal sequences would give the agent term n_A/(n_A + n_W) of
    the weight instead (0.2 with 4 plans x 4 workflows)."""
    if norm not in ("sequence", "token"):
        raise ValueError(f"norm must be 'sequence' or 'token', got {norm!r}")
    n_seq: dict[str, int] = {}
    n_tok: dict[str, int] = {}
    for lv, t in zip(levels, lengths, strict=True):
        n_seq[lv], n_tok[lv] = n_seq.get(lv, 0) + 1, n_tok.get(lv, 0) + t
    if norm == "sequence":
        return np.array([weights[lv] / (n_seq[lv] * max(t, 1)) for lv, t in zip(levels, lengths, strict=True)])
    return np.array([weights[lv] / max(n_tok[lv], 1) for lv in levels])


@dataclass
class LossTerms:
    """The scalar loss of any objective and its pieces for logging (detached except `loss`); None: not defined
    for the objective (no reference: no `kl`; no ratio: no `clip_frac` / `ratio_dev`)."""

    loss: torch.Tensor
    pg_loss: torch.Tensor  # the loss without its KL term, same normalisation as the loss
    # mean k3(π_θ, π_ref) over completion tokens, unmasked: the loss's KL term on every token. The tokens are π_old's
    # samples, not π_θ's, so once π_θ all but rules out a sampled token it reads e^gap (docs/learning-log.md: one token
    # pushed from log p -1.4 to -31 made steps of 4e4); `kl_old` (pipeline.stages.train.metrics) is what the samples
    # estimate
    kl: torch.Tensor | None = None
    clip_frac: torch.Tensor | None = None  # share of completion tokens whose clipped branch is active (zero gradient)
    ratio_dev: torch.Tensor | None = None  # max |ρ - 1| over completion tokens: 0 before any update (π_θ = π_old)


def reduce_tokens(per_tok: torch.Tensor, mask: torch.Tensor, norm: str,
                  seq_weights: torch.Tensor | None = None) -> torch.Tensor:
    if seq_weights is not None:  # Σ_b c_b Σ_t: the weights carry the normalisation (see `level_weights`)
        return ((per_tok * mask).sum(-1) * seq_weights).sum()
    if norm == "sequence":
        return ((per_tok * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if norm == "token":
        return (per_tok * mask).sum() / mask.sum().clamp(min=1.0)
    raise ValueError(f"norm must be 'sequence' or 'token', got {norm!r}")


def k3(sample_logp: torch.Tensor, other_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 per token, r - 1 - log r with r = p/q: an unbiased, non-negative estimate of KL(q‖p) on tokens
    sampled from q (log q = `sample_logp`, log p = `other_logp`). Its size depends on the roles: it grows as e^gap
    when p puts much more mass than q on a token, and only linearly in the gap the other way round."""
    d = other_logp - sample_logp
    return torch.exp(d) - d - 1


def _kl_weights(adv: torch.Tensor, kl_mask: bool | torch.Tensor) -> torch.Tensor:
    """[B, 1] KL multipliers m: 1[A > 0] where the mask applies, else 1."""
    masked = torch.as_tensor(kl_mask, device=adv.device).reshape(-1, 1)
    return torch.where(masked, (adv > 0).to(adv.dtype), torch.ones_like(adv))


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, clip_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token min(ρA, clip(ρ, 1-ε, 1+ε)A) and where its clipped branch wins (zero gradient: above 1+ε for
    A > 0, below 1-ε for A < 0)."""
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    active = ((ratio > 1 + clip_eps) & (adv > 0)) | ((ratio < 1 - clip_eps) & (adv < 0))
    return torch.minimum(ratio * adv, clipped * adv), active


def grpo_mkl_terms(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    beta: float,
    clip_eps: float,
    kl_mask: bool | torch.Tensor = True,
    *,
    norm: Literal["sequence", "token"] = "sequence",
    seq_weights: torch.Tensor | None = None,
    behaviour_logp: torch.Tensor | None = None,
    off_policy: torch.Tensor | None = None,
    off_rule: str = "is_clip",
    off_gamma: float = 0.1,
) -> LossTerms:
    """ioGRPO-mKL (SPOGW eq. 3.6). Per token: min(ρA, clip(ρ, 1-ε, 1+ε)A) - β·m·k3 with
    ρ = exp(logp - old_logp), k3 = exp(ref - logp) - (ref - logp) - 1, m = 1[A > 0] (or 1).
    `norm="sequence"`: mean over each sequence's completion tokens, then over sequences (the paper);
    `"token"`: mean over all completion tokens of the batch. Loss = minus that objective.
    `ref_logp=None` means no reference (no KL term). `kl_mask` may be a [B] bool tensor: the mask per sequence
    (two-level: one switch per level). `seq_weights` [B]: the loss is -Σ_b c_b Σ_t instead of `norm`'s mean
    (c_b from `level_weights`; the logged `kl` stays the plain mean).
    `off_policy` [B] bool marks logged rows: their tokens take `off_policy_surrogate(off_rule, ...)` against
    `behaviour_logp` [B, T] instead of the ratio to π_old; the KL term is the same for every row."""
    if logp.shape != old_logp.shape or logp.shape != completion_mask.shape:
        raise ValueError(f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and completion_mask "
                         f"{tuple(completion_mask.shape)} must have the same [B, T] shape")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [B]={logp.shape[0]}, got {tuple(advantages.shape)}")
    mask = completion_mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(1)
    ratio = torch.exp(logp - old_logp)
    pg_tok, active = clipped_surrogate(ratio, adv, clip_eps)
    if off_policy is not None and bool(off_policy.any()):
        if behaviour_logp is None or behaviour_logp.shape != logp.shape:
            raise ValueError("logged rows need behaviour_logp of the [B, T] shape of logp")
        off_tok, off_active = off_policy_surrogate(off_rule, logp, behaviour_logp.to(logp.dtype), adv, clip_eps,
                                                   off_gamma)
        rows = off_policy.reshape(-1, 1).to(torch.bool)
        pg_tok = torch.where(rows, off_tok, pg_tok)
        active = torch.where(rows, off_active, active)
    # the loss's KL(π_θ‖π_ref) as GRPO writes it, as if the tokens were π_θ's samples
    kl_tok = torch.zeros_like(logp) if ref_logp is None else k3(logp, ref_logp)
    m = _kl_weights(adv, kl_mask).to(logp.dtype)
    w = None if seq_weights is None else seq_weights.to(logp.dtype)
    loss = -reduce_tokens(pg_tok - beta * m * kl_tok, mask, norm, w)
    with torch.no_grad():
        clip_frac = (active.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1.0)
        pg_loss = -reduce_tokens(pg_tok, mask, norm, w)
        kl = reduce_tokens(kl_tok, mask, norm)
        ratio_dev = ((ratio - 1).abs() * mask).max() if mask.numel() else torch.zeros((), dtype=logp.dtype)
    return LossTerms(loss=loss, pg_loss=pg_loss, kl=kl, clip_frac=clip_frac, ratio_dev=ratio_dev)


def grpo_mkl_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    beta: float,
    clip_eps: float,
    kl_mask: bool | torch.Tensor = True,
    *,
    norm: Literal["sequence", "token"] = "sequence",
    seq_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The scalar ioGRPO-mKL loss; see `grpo_mkl_terms` for the formula and the logged pieces.

    Public API: the loss alone, for callers outside the trainer (notebooks, tests)."""
    return grpo_mkl_terms(logp, old_logp, ref_logp, advantages, completion_mask, beta, clip_eps, kl_mask,
                          norm=norm, seq_weights=seq_weights).loss


# ---- logged (off-policy) rows ---------------------------------------------------------------------------------------
# A logged row was sampled by a behaviour policy μ that is not π_old (a fixed program's run, another seed, an earlier
# round, rollouts logged elsewhere): its per-token surrogate replaces the on-policy ρ = π_θ/π_old by a rule chosen by
# name (`training.off_policy`). Each takes log π_θ, log μ (the behaviour log-probs the row was logged with) and the
# advantage, [B, T] / [B, 1], and returns the per-token objective (maximised), with its clipped-branch mask.


def _is_ratio(logp: torch.Tensor, behaviour_logp: torch.Tensor) -> torch.Tensor:
    return torch.exp(logp - behaviour_logp)


def off_is_clip(logp, behaviour_logp, adv, clip_eps: float, gamma: float):
    """PPO's clipped surrogate with the behaviour policy in the ratio: min(ρA, clip(ρ, 1-ε, 1+ε)A), ρ = π_θ/μ
    (importance sampling against the logging policy, truncated as PPO truncates ρ = π_θ/π_old)."""
    return clipped_surrogate(_is_ratio(logp, behaviour_logp), adv, clip_eps)


def off_luffy(logp, behaviour_logp, adv, clip_eps: float, gamma: float):
    """LUFFY's regularised importance weight (arXiv 2504.14945, eq. 6, with μ taken as 1 on the off-policy tokens):
    f(π_θ)·A, f(p) = p/(p + γ), no clipping. Its gradient γ/(p + γ)²·∇p keeps a low-probability token's gradient
    large where ρ = p would vanish it; the behaviour log-probs are not used."""
    p = torch.exp(logp)
    return p / (p + gamma) * adv, torch.zeros_like(p, dtype=torch.bool)


def off_expected(logp, behaviour_logp, adv, clip_eps: float, gamma: float):
    """The exact expected gradient over every logged option: ρA with ρ = π_θ/μ and no clipping. Where μ is the
    uniform sweep's 1/K (each of K designs run once on the query, the route-or-write import), the mean over a query's
    K label rows of ρ_d A_d is Σ_d π_θ(d) A_d, whose gradient Σ_d π_θ(d) A_d ∇log π_θ(d) is the policy gradient of
    the label's expected advantage computed exactly, not sampled (HGPO's and Thinkless's all-modes credit)."""
    return _is_ratio(logp, behaviour_logp) * adv, torch.zeros_like(logp, dtype=torch.bool)


OFF_POLICY_RULES = {"is_clip": off_is_clip, "luffy": off_luffy, "expected": off_expected}


def off_policy_surrogate(rule: str, logp: torch.Tensor, behaviour_logp: torch.Tensor, adv: torch.Tensor,
                         clip_eps: float, gamma: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token objective, clipped-branch mask) of logged tokens under the rule named `rule` (OFF_POLICY_RULES)."""
    try:
        fn = OFF_POLICY_RULES[rule]
    except KeyError:
        raise ValueError(f"unknown off-policy rule {rule!r}; registered: {', '.join(OFF_POLICY_RULES)}") from None
    return fn(logp, behaviour_logp, adv, clip_eps, gamma)


def choice_credit(scores: Sequence[float], designs: Sequence[str], eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """The choice's credit apart from the code's, for one query's group of rows that each chose a design (HGPO's
    between- and within-mode advantages, arXiv 2505.14631): (label advantages, code advantages).
    - label: (R_d(i) - mean(s)) / (std(s) + eps), R_d the mean score of the rows that chose design d, mean and
      population std over all the group's rows: every row of a design gets its design's credit, whatever its luck;
    - code: (s_i - R_d(i)) / (std_d + eps) within the rows of the same design (0 for a design chosen once): the code
      is compared only with code written under the same choice."""
    values = np.asarray(scores, dtype=float)
    if len(designs) != values.size:
        raise ValueError(f"choice_credit: {values.size} scores but {len(designs)} designs")
    label, code = np.zeros_like(values), np.zeros_like(values)
    if values.size == 0:
        return label, code
    mean, std = values.mean(), values.std()
    for d in dict.fromkeys(designs):
        idx = np.array([i for i, x in enumerate(designs) if x == d])
        label[idx] = (values[idx].mean() - mean) / (std + eps)
        code[idx] = (values[idx] - values[idx].mean()) / (values[idx].std() + eps)
    return label, code
