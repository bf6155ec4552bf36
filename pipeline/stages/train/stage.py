"""The train stage (`run_train`): load → reference passes → optimise → write.

1. `load_stage` (`setup.py`): the round's rows, the policy (base + the adapter that sampled the round), the plan.
2. `reference_passes` (`reference.py`): π_old and reference log-probs, once, before any update.
3. `optimise`: the optimiser loop. Each step runs its passes (`train_pass`: one forward/backward over a pass's
   distinct sequences) and logs one `StepMetrics`; every `training.save_steps` steps rank 0 saves its progress.
4. `write_outputs`: the checkpoint, `train_metrics`, the `checkpoints` row, the manifest.

Crash safety: the checkpoint is saved to a temp folder and renamed into place; `train_metrics` and the `checkpoints`
row are written once, at the end, after the adapter is saved. A re-run without the stage manifest deletes those parts
and any checkpoint folder of the unfinished attempt (the runner), and the loop resumes at the last step saved by
`training.save_steps` (`pipeline.stages.progress`), or at step 0 with π_old and the reference kept once their
passes are done.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pipeline.core.packing import Pass
from pipeline.engines.models import save_adapter
from pipeline.engines.neighbours import computing
from pipeline.stages.progress import clear_progress, load_progress, progress_path, save_progress
from pipeline.stages.train.batch import pass_batch
from pipeline.stages.train.loss import pass_loss_input, pass_shares, step_weights
from pipeline.stages.train.metrics import StepMetrics, StepSums
from pipeline.stages.train.reference import RefLogprobs, reference_passes
from pipeline.stages.train.setup import TrainSetup, check_objective, load_stage
from pipeline.store import weights_sha256

if TYPE_CHECKING:
    from pipeline.config import TrainingConfig
    from pipeline.run import RunContext

log = logging.getLogger(__name__)


def run_train(ctx: RunContext) -> dict[str, Any]:
    """Train the round's adapter with `training.objective` on its curated rows and write the round's checkpoint.
    Under `accelerate launch --num_processes N` it trains data-parallel (`pipeline.stages.parallel`): the same global
    steps, each step's passes dealt to the ranks, gradients all-reduced; rank 0 writes."""
    from pipeline.stages.parallel import make_accelerator

    objective = check_objective(ctx)
    accel = make_accelerator()
    with computing("the train stage") if accel.device.type == "cpu" else contextlib.nullcontext():
        setup = load_stage(ctx, objective, accel)
        # the hash of the config this invocation trains with (--set included): progress of another is not resumed
        saved = load_progress(progress_path(ctx.store, ctx.run_id, ctx.round), ctx.cfg.config_hash(),
                              len(setup.steps))
        # progress files keep the pair under "passes" as a tuple (old, ref)
        ref = RefLogprobs(*saved["passes"]) if saved is not None else reference_passes(setup)
        return write_outputs(setup, optimise(setup, ref, saved))


def optimise(setup: TrainSetup, ref: RefLogprobs, saved: dict[str, Any] | None = None) -> list[StepMetrics]:
    """Step 3: the optimiser loop; each rank runs its share of every step's passes
    (`pipeline.stages.parallel.rank_share`). From `saved` progress it goes on at the step after the saved one; every
    `training.save_steps` steps rank 0 saves its own (`pipeline.stages.progress`) and shows how far it is
    (`pipeline.engines.meter`)."""
    from pipeline.engines.meter import ProgressMeter, relay_path
    from pipeline.stages.parallel import rank_share

    train_cfg, accel, ctx, steps = setup.train_cfg, setup.accel, setup.ctx, setup.steps
    params = [p for p in setup.policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=train_cfg.lr, weight_decay=0.0)
    sched = _lr_scheduler(optimizer, train_cfg, len(steps))
    trainable = {n: p for n, p in setup.model.named_parameters() if p.requires_grad}
    metrics: list[StepMetrics] = []
    start = 0
    if saved is not None:
        with torch.no_grad():
            for n, p in trainable.items():
                p.copy_(saved["trainable"][n])
        optimizer.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        torch.set_rng_state(saved["rng"])
        metrics, start = [StepMetrics(**m) for m in saved["metrics"]], saved["next_step"]
        log.info("round %d: training resumes at step %d of %d (saved progress)", ctx.round, start, len(steps))
    path = progress_path(ctx.store, ctx.run_id, ctx.round) if train_cfg.save_steps and accel.is_main_process else None

    def save(next_step: int) -> None:
        save_progress(path, {"config_hash": ctx.cfg.config_hash(), "n_steps": len(steps), "next_step": next_step,
                             "trainable": {n: p.detach().clone() for n, p in trainable.items()},
                             "optimizer": optimizer.state_dict(), "scheduler": sched.state_dict(),
                             "rng": torch.get_rng_state(), "metrics": [asdict(m) for m in metrics],
                             "passes": (ref.old, ref.ref)})

    if path is not None and saved is None and steps:
        save(0)  # the reference passes can take 40 min on a CPU: a kill before save_steps keeps them
    setup.policy.train()
    meter = ProgressMeter(len(steps), f"train round {ctx.round} ({setup.objective.name})", "step", done=start,
                          relay=relay_path(ctx.run_id, ctx.round, "train")) if accel.is_main_process else None
    with meter or contextlib.nullcontext():
        for step in range(start, len(steps)):
            planned, rows = steps[step], steps[step].rows
            started, learning_rate, sums = time.perf_counter(), sched.get_last_lr()[0], StepSums()
            mine = rank_share(planned.passes, *setup.shard)
            for j, (pass_, real) in enumerate(mine):
                # DDP all-reduces at each rank's last backward of the step only
                with contextlib.nullcontext() if j == len(mine) - 1 else accel.no_sync(setup.policy):
                    train_pass(setup, pass_, rows, real, ref, sums)
            grad_norm = accel.clip_grad_norm_(params, train_cfg.max_grad_norm)
            optimizer.step()
            sched.step()
            optimizer.zero_grad(set_to_none=True)
            metrics.append(_step_metrics(step, planned.epoch, learning_rate, float(grad_norm), sums,
                                         accel.num_processes, started))
            if meter is not None:
                meter.update()
            if path is not None and (step + 1) % train_cfg.save_steps == 0 and step + 1 < len(steps):
                save(step + 1)
    setup.policy.eval()
    return metrics


def train_pass(setup: TrainSetup, pass_: Pass, step_rows: list[int], real: bool, ref: RefLogprobs,
               sums: StepSums) -> None:
    """One forward/backward over a pass's distinct sequences, its rows' loss terms summed (a filler, real=False,
    weighs 0: DDP needs every rank at each all-reduce)."""
    train_cfg, device, seqs = setup.train_cfg, setup.accel.device, setup.seqs
    batch = pass_batch([seqs[i] for i in pass_.uniq], setup.pad_id, device, train_cfg.prompt_layout,
                       train_cfg.shared_prefix_min)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=setup.bf16):
        logp = setup.policy(batch)
    weights = step_weights(seqs, step_rows, train_cfg)
    inp = pass_loss_input(seqs, pass_, logp, batch, train_cfg, ref.old, ref.ref, weights, device)
    terms = setup.objective.fn(inp, train_cfg)
    share, tok_share = pass_shares(seqs, pass_, step_rows, train_cfg.loss_norm)
    loss_share = share if weights is None else 1.0  # level weights already normalise over the step
    # x ranks: DDP averages the ranks' gradients, the step's gradient is their sum
    setup.accel.backward(terms.loss * (loss_share * setup.accel.num_processes if real else 0.0))
    if real:
        sums.add_terms(terms, share, tok_share, loss_share)
        sums.add_kl_old(inp, share, train_cfg.loss_norm)
        sums.tokens += sum(len(seqs[r].completion_ids) for r in pass_.rows)
        sums.slots, sums.real = sums.slots + batch.slots, sums.real + batch.tokens
        sums.add_mismatch([seqs[i] for i in pass_.uniq], ref.old)


def _lr_scheduler(optimizer: torch.optim.Optimizer, train_cfg: TrainingConfig,
                  total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    from transformers import get_scheduler

    name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[train_cfg.lr_schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=train_cfg.warmup_steps,
                         num_training_steps=max(total_steps, 1))


def _step_metrics(step: int, epoch: int, learning_rate: float, grad_norm: float, sums: StepSums, n_ranks: int,
                  started: float) -> StepMetrics:
    from pipeline.stages.parallel import reduce_step

    t = reduce_step(sums, n_ranks, maxed=("ratio_dev",))
    return StepMetrics(step=step, epoch=epoch, loss=t.loss, pg_loss=t.pg_loss, kl=t.kl, kl_old=t.kl_old,
                       clip_frac=t.clip_frac, ratio_dev=t.ratio_dev, lr=learning_rate, grad_norm=grad_norm,
                       tokens=int(t.tokens), padding_share=t.padding_share, logp_mismatch=t.logp_mismatch,
                       wall_s=time.perf_counter() - started)


def write_outputs(setup: TrainSetup, metrics: list[StepMetrics]) -> dict[str, Any]:
    """Step 4: rank 0 saves the adapter (whole or absent), then `train_metrics`, the `checkpoints` row and the
    manifest; every rank returns the counts once the manifest exists (the runner checks it)."""
    ctx, accel, seqs = setup.ctx, setup.accel, setup.seqs
    ckpt = ctx.store.checkpoint_dir(ctx.run_id, ctx.round)
    if accel.is_main_process:
        peft_model = accel.unwrap_model(setup.policy).model
        ctx.store.publish_checkpoint(lambda d: save_adapter(peft_model, d, ctx.cfg.generator.model), ctx.run_id,
                                     ctx.round)
        ctx.store.write("train_metrics", [asdict(m) for m in metrics], ctx.run_id, ctx.round)
        ctx.store.write("checkpoints", [{"path": str(ckpt), "base_model": ctx.cfg.generator.model,
                                         "parent_round": ctx.round - 1 if ctx.round > 0 else None,
                                         "rows_used": len(seqs)}], ctx.run_id, ctx.round)
    mismatch = [m.logp_mismatch for m in metrics if m.logp_mismatch is not None]
    counts = {"objective": setup.objective.name, "sequences": len(seqs), "generations": len({q.gen_id for q in seqs}),
              "steps": len(setup.steps), "tokens": sum(m.tokens for m in metrics), **setup.data_counts,
              "processes": accel.num_processes, "final_loss": metrics[-1].loss if metrics else None,
              "logp_mismatch": float(np.mean(mismatch)) if mismatch else None, "checkpoint": str(ckpt)}
    if accel.is_main_process:
        # which weights finished: a kept copy of them restores the checkpoint on a fresh clone (restore_checkpoint)
        counts["weights_sha256"] = None if ctx.store.remote else weights_sha256(ckpt)
        ctx.finish("train", **counts)
        clear_progress(progress_path(ctx.store, ctx.run_id, ctx.round))
    accel.wait_for_everyone()
    return counts
