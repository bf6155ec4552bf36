"""Step 2 of the train stage (`reference_passes`): the π_old and reference log-probs of every sequence, computed once
before any update. π_old is the adapter as loaded (the previous round's checkpoint; at round 0 generator.adapter,
which sampled it, or a fresh LoRA = the base model), recomputed in eval mode on the first step's passes as training
lays them out (fp32, or under training's bf16 autocast), or taken from the rollout's own log-probs
(training.old_logprobs: rollout, no pass); the reference is that same model by default, the base model under
training.reference: base. LoRA dropout defaults to 0 and replaces a loaded adapter's (`load_policy`): π_θ in train
mode then equals a recomputed π_old before the first update (ρ = 1, logged `ratio_dev`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline.core.packing import Pass, logprob_passes
from pipeline.engines.hardware import resolve_dtype
from pipeline.engines.meter import relay_path
from pipeline.stages.train.logprobs import reference_logprobs
from pipeline.stages.train.plan import pass_budget, row_shapes
from pipeline.stages.train.policy import start_adapter
from pipeline.stages.train.setup import TrainSetup

log = logging.getLogger(__name__)

LogprobsByGen = dict[str, torch.Tensor]  # a sequence's completion log-probs, per gen_id


@dataclass
class RefLogprobs:
    """The log-probs the loss holds fixed; None where the objective (or training.reference: none) has none."""

    old: LogprobsByGen | None  # π_old: the ratio's denominator
    ref: LogprobsByGen | None  # the reference: the KL term's or the preference margin's


def old_source(setup: TrainSetup) -> str:
    """training.old_logprobs resolved. auto takes the rollout's log-probs only where they are the trainer's own up to
    fp32 rounding: a generator on this machine (vllm, transformers, or a server the run starts) that sampled in fp32
    at temperature 1 and top_p 1, and a training forward without bf16 autocast (on a CPU both fp32 sides differed by
    1.7e-5 nats a token, docs/performance.md; bf16 on either side differs by about 1e-2)."""
    mode = setup.train_cfg.old_logprobs
    if mode != "auto":
        return mode
    g = setup.ctx.cfg.generator
    local = g.backend != "openai" or g.serve is not None
    dtype = g.serve.dtype if g.serve is not None else g.dtype  # a served generator loads serve.dtype
    fp32 = local and not setup.bf16 and resolve_dtype(dtype, what="generator") == "float32"
    mode = "rollout" if fp32 and g.temperature == 1.0 and g.top_p == 1.0 else "recompute"
    log.info("training.old_logprobs auto -> %s (%s)", mode, "the rollout's fp32 log-probs at temperature 1" if
             mode == "rollout" else "a bf16, remote or tempered sampler: recomputed")
    return mode


def old_logprobs(setup: TrainSetup, passes: list[Pass], compute: Callable[..., LogprobsByGen]) -> LogprobsByGen:
    """π_old per gen_id: recomputed on `passes` (`compute`: `reference_logprobs` with the setup's model), or
    (training.old_logprobs: rollout) the log-probs the rollout sampled with. Sequences stored without them (an
    endpoint that gave none) are recomputed in the passes that hold them, laid out as for `recompute`, so π_θ at the
    first step still matches them exactly."""
    if old_source(setup) == "recompute":
        return compute(passes)
    # a logged row's are μ's, a drawn label's without the policy's own the draw's (TrainSequence): recomputed
    rollout = {q.gen_id: torch.tensor(q.gen_logprobs, dtype=torch.float32)
               for q in setup.seqs if q.gen_logprobs is not None and not q.off_policy and not q.drawn_label}
    todo = [p for p in passes if any(setup.seqs[i].gen_id not in rollout for i in p.uniq)]
    if todo:
        log.info("%d sequences have no rollout log-probs: π_old is recomputed for %d passes",
                 len({q.gen_id for q in setup.seqs} - rollout.keys()), len(todo))
    return (compute(todo) if todo else {}) | rollout


def reference_passes(setup: TrainSetup) -> RefLogprobs:
    """Step 2: π_old and reference log-probs per gen_id, before any update (`reference_logprobs`)."""
    train_cfg, objective = setup.train_cfg, setup.objective
    passes = logprob_passes(setup.steps[0].passes if setup.steps else [], row_shapes(setup.seqs),
                            pass_budget(train_cfg), train_cfg.shared_prefix_min)
    compute = functools.partial(reference_logprobs, setup.model, setup.seqs, pad_id=setup.pad_id,
                                device=setup.accel.device, bf16=setup.bf16, shard=setup.shard,
                                layout=train_cfg.prompt_layout, min_prefix=train_cfg.shared_prefix_min,
                                relay=relay_path(setup.ctx.run_id, setup.ctx.round, "train"))
    old = old_logprobs(setup, passes, compute) if objective.needs_old else None
    if not objective.uses_ref or train_cfg.reference == "none":
        return RefLogprobs(old, None)
    if train_cfg.reference == "base" and start_adapter(setup.ctx) is not None:
        return RefLogprobs(old, compute(passes, disable_adapter=True, desc="ref logprobs"))
    # the starting adapter = π_old (a fresh LoRA is a no-op: both are the base model)
    return RefLogprobs(old, old if old is not None else compute(passes, desc="ref logprobs"))
