"""Data-parallel training on Accelerate: the pieces `pipeline.stages.train.run_train` needs to run as N processes with
the same global-batch semantics as one.

Launched as `PIPELINE_LAUNCHER_TRAIN="accelerate launch --multi_gpu --num_processes N"` (on CPU too: Accelerate
then runs MULTI_CPU over gloo), every rank builds the same data and the same step plan (same seeds), and an
optimiser step's passes are dealt round-robin to the ranks (`rank_share`). Each rank back-propagates its
share's loss with the single-process weights, times N because DDP averages the all-reduced gradients: the summed
gradient is the one-process gradient up to float summation order. π_old / reference log-probs are computed on each
rank's share of the batches, after DDP has broadcast rank 0's weights, and gathered (`gather_logprobs`). Rank 0
alone writes the checkpoint, `train_metrics` and the manifest.

FSDP is refused for now (`make_accelerator`): Accelerate runs CPU processes as DDP whatever the launch flags say, so
no FSDP run could be tested here, and with `--use_fsdp` transformers loads the weights on rank 0 only (the others
start from random ones): measured, π_old then differs from π_θ at step 1 (|ρ - 1| = 0.19) and the adapter is wrong.
"""

from __future__ import annotations

from typing import TypeVar

import torch

T = TypeVar("T")


def make_accelerator():
    """The Accelerator of a training stage. Mixed precision stays the trainer's own bf16 autocast
    (training.bf16), so one process and N compute the same thing; the device is Accelerate's (cuda:<local rank>)."""
    import os

    from accelerate import Accelerator

    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true") or \
            os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):
        raise RuntimeError("training runs data-parallel (DDP) only: FSDP/DeepSpeed launches are not supported yet "
                           "(untested; see docs/scale-out.md); launch with `accelerate launch --multi_gpu "
                           "--num_processes N` instead")
    return Accelerator(cpu=not torch.cuda.is_available())


class LogprobModule(torch.nn.Module):
    """The trainer's log-prob function (`logprobs(model, batch)`, pipeline.stages.train.logprobs.completion_logprobs)
    as the module's forward, so DDP sees the call: its gradient all-reduce is prepared in the wrapped module's
    forward, which the trainer's decoder + head split (never [B, T, V] logits) would otherwise bypass."""

    def __init__(self, model: torch.nn.Module, logprobs):
        super().__init__()
        self.model = model
        self.logprobs = logprobs  # given, not imported: the trainer imports this module

    def forward(self, batch) -> torch.Tensor:
        return self.logprobs(self.model, batch)


def rank_share(passes: list[T], rank: int, n: int) -> list[tuple[T, bool]]:
    """This rank's passes of one optimiser step, dealt round-robin, as (pass, real). Every rank gets the
    same count (DDP all-reduces at each rank's last backward, so all ranks must get there): a rank short of one
    repeats the step's first pass with real=False, which the trainer weights 0 (no gradient, no metrics)."""
    mine = [(p, True) for p in passes[rank::n]]
    per_rank = -(-len(passes) // n)
    return mine + [(passes[0], False)] * (per_rank - len(mine))


def gather_logprobs(local: dict[int, torch.Tensor], n: int) -> dict[int, torch.Tensor]:
    """Every rank's {sequence index: log-probs}, merged on every rank (no-op alone)."""
    if n == 1:
        return local
    from accelerate.utils import gather_object

    merged: dict[int, torch.Tensor] = {}
    for part in gather_object([local]):
        merged.update(part)
    return merged


def reduce_step(values: T, n: int, maxed: tuple[str, ...] = ()) -> T:
    """One optimiser step's per-rank sums (a dataclass of floats) summed over ranks (`maxed` fields: the max). None
    means no rank had a value (an objective without a KL term) and stays None."""
    if n == 1:
        return values
    import dataclasses

    import torch.distributed as dist

    keys = [f.name for f in dataclasses.fields(values)]
    got = [getattr(values, k) for k in keys]
    vals = torch.tensor([0.0 if v is None else float(v) for v in got], dtype=torch.float64)
    has = torch.tensor([v is not None for v in got], dtype=torch.float64)
    summed, highest = vals.clone(), vals.clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    dist.all_reduce(has, op=dist.ReduceOp.SUM)
    return type(values)(**{k: None if has[i] == 0 else float(highest[i] if k in maxed else summed[i])
                           for i, k in enumerate(keys)})
