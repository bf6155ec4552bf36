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
) -> LossTerms:
    """ioGRPO-mKL (SPOGW eq. 3.6). Per token: min(ρA, clip(ρ, 1-ε, 1+ε)A) - β·m·k3 with
    ρ = exp(logp - old_logp), k3 = exp(ref - logp) - (ref - logp) - 1, m = 1[A > 0] (or 1).
    `norm="sequence"`: mean over each sequence's completion tokens, then over sequences (the paper);
    `"token"`: mean over all completion tokens of the batch. Loss = minus that objective.
    `ref_logp=None` means no reference (no KL term). `kl_mask` may be a [B] bool tensor: the mask per sequence
    (two-level: one switch per level). `seq_weights` [B]: the loss is -Σ_b c_b Σ_t instead of `norm`'s mean
    (c_b from `level_weights`; the logged `kl` stays the plain mean)."""
    if logp.shape != old_logp.shape or logp.shape != completion_mask.shape:
        raise ValueError(f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and completion_mask "
                         f"{tuple(completion_mask.shape)} must have the same [B, T] shape")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [B]={logp.shape[0]}, got {tuple(advantages.shape)}")
    mask = completion_mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(1)
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    pg_tok = torch.minimum(ratio * adv, clipped * adv)
    # the loss's KL(π_θ‖π_ref) as GRPO writes it, as if the tokens were π_θ's samples
    kl_tok = torch.zeros_like(logp) if ref_logp is None else k3(logp, ref_logp)
    m = _kl_weights(adv, kl_mask).to(logp.dtype)
    w = None if seq_weights is None else seq_weights.to(logp.dtype)
    loss = -reduce_tokens(pg_tok - beta * m * kl_tok, mask, norm, w)
    with torch.no_grad():
        # the clipped branch wins (and the gradient vanishes) above 1+ε for A > 0 and below 1-ε for A < 0
        active = ((ratio > 1 + clip_eps) & (adv > 0)) | ((ratio < 1 - clip_eps) & (adv < 0))
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
