"""GRPO maths, pure functions (DESIGN.md §6): group advantages and the advantage-masked-KL loss.

No I/O and no model here: arrays/tensors in, arrays/tensors out, so every formula is unit-tested
against hand-computed values.
"""

from __future__ import annotations

from collections.abc import Sequence
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


@dataclass
class GrpoTerms:
    """The scalar loss plus its pieces, for logging (all detached except `loss`)."""

    loss: torch.Tensor
    pg_loss: torch.Tensor  # minus the clipped surrogate, same normalisation as the loss
    kl: torch.Tensor  # mean k3 over completion tokens (unmasked: the actual divergence from the reference)
    clip_frac: torch.Tensor  # share of completion tokens whose clipped branch is active (zero gradient)


def _reduce(per_tok: torch.Tensor, mask: torch.Tensor, norm: str) -> torch.Tensor:
    if norm == "sequence":
        return ((per_tok * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if norm == "token":
        return (per_tok * mask).sum() / mask.sum().clamp(min=1.0)
    raise ValueError(f"norm must be 'sequence' or 'token', got {norm!r}")


def grpo_mkl_terms(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    beta: float,
    clip_eps: float,
    kl_mask: bool = True,
    *,
    norm: Literal["sequence", "token"] = "sequence",
) -> GrpoTerms:
    """ioGRPO-mKL (SPOGW eq. 3.6). Per token: min(ρA, clip(ρ, 1-ε, 1+ε)A) - β·m·k3 with
    ρ = exp(logp - old_logp), k3 = exp(ref - logp) - (ref - logp) - 1, m = 1[A > 0] (or 1).
    `norm="sequence"`: mean over each sequence's completion tokens, then over sequences (the paper);
    `"token"`: mean over all completion tokens of the batch. Loss = minus that objective.
    `ref_logp=None` means no reference (no KL term)."""
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
    if ref_logp is None:
        k3 = torch.zeros_like(logp)
    else:
        d = ref_logp - logp
        k3 = torch.exp(d) - d - 1
    m = (adv > 0).to(logp.dtype) if kl_mask else torch.ones_like(adv)
    loss = -_reduce(pg_tok - beta * m * k3, mask, norm)
    with torch.no_grad():
        # the clipped branch wins (and the gradient vanishes) above 1+ε for A > 0 and below 1-ε for A < 0
        active = ((ratio > 1 + clip_eps) & (adv > 0)) | ((ratio < 1 - clip_eps) & (adv < 0))
        clip_frac = (active.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1.0)
        pg_loss = -_reduce(pg_tok, mask, norm)
        kl = _reduce(k3, mask, norm)
    return GrpoTerms(loss=loss, pg_loss=pg_loss, kl=kl, clip_frac=clip_frac)


def grpo_mkl_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    beta: float,
    clip_eps: float,
    kl_mask: bool = True,
    *,
    norm: Literal["sequence", "token"] = "sequence",
) -> torch.Tensor:
    """The scalar ioGRPO-mKL loss; see `grpo_mkl_terms` for the formula and the logged pieces.

    Public API: the loss alone, for callers outside the trainer (notebooks, tests)."""
    return grpo_mkl_terms(logp, old_logp, ref_logp, advantages, completion_mask, beta, clip_eps, kl_mask,
                          norm=norm).loss
