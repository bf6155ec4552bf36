"""The train stage: LoRA GRPO with advantage-masked KL on a round's curated groups (DESIGN.md §6).

Data: every member of every kept group is one sequence (prompt_token_ids + token_ids, the loss on
the completion only) with its group advantage; a workflow kept in several groups appears several
times. A two-level round's loss is the proposal's: an agent term and a workflow term, each averaged
over its own sequences of the optimiser step, weighted by training.two_level (`step_weights`), each
level's KL masked or not by its switch (`kl_masks`). π_old = the adapter as loaded (previous round's
checkpoint; at round 0 generator.adapter, which sampled it, or a fresh LoRA = the base model), recomputed
here once before the first step in eval mode (fp32, or under the bf16 autocast of training when
training.bf16); the reference is that same model by default. LoRA dropout defaults to 0, and replaces a
loaded adapter's: π_θ in train mode then equals π_old before the first update (ρ = 1, logged `ratio_dev`).

Crash safety: the checkpoint is saved to a temp folder and renamed into place; `train_metrics` and
the `checkpoints` row are written once, at the end, after the adapter is saved. A re-run without
the stage manifest deletes those parts and any checkpoint folder of the unfinished attempt and
starts the round's training over.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# polars / the store / the run config are imported where used: the step functions below (collate,
# completion_logprobs) import with torch alone, as `pipeline bench train` needs on a bare GPU machine.
from pipeline.core.grpo import grpo_mkl_loss, grpo_mkl_terms, level_weights
from pipeline.stages.modes import get_mode

__all__ = ["grpo_mkl_loss", "grpo_mkl_terms", "run_train", "TrainSequence", "Batch", "collate", "completion_logprobs"]

log = logging.getLogger(__name__)



@dataclass
class TrainSequence:
    gen_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float  # the row's coefficient: a group's advantage, another kind's loss weight
    gen_logprobs: list[float] | None  # as sampled (diagnostics only)
    level: str = "flat"  # its group's level: flat | agent | workflow
    score: float | None = None  # its score in the row (score_dpo's s_w / s_l)
    group_id: str | None = None


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] right-padded
    attention_mask: torch.Tensor  # [B, T]
    src: torch.Tensor  # [N] flat positions (b*T + p-1) of the hidden states that predict completion tokens
    tgt: torch.Tensor  # [N] the completion token ids
    dst: torch.Tensor  # [N] flat positions (b*Tc + j) in the [B, Tc] completion grid
    completion_mask: torch.Tensor  # [B, Tc]
    advantages: torch.Tensor  # [B]


def collate(seqs: list[TrainSequence], pad_id: int, device: torch.device | str = "cpu") -> Batch:
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in seqs]
    t, tc = max(lengths), max(len(s.completion_ids) for s in seqs)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    att = torch.zeros((len(seqs), t), dtype=torch.long)
    cmask = torch.zeros((len(seqs), tc))
    src, tgt, dst = [], [], []
    for b, s in enumerate(seqs):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        ids[b, : p + c] = torch.tensor(s.prompt_ids + s.completion_ids)
        att[b, : p + c] = 1
        cmask[b, :c] = 1
        src.append(torch.arange(b * t + p - 1, b * t + p + c - 1))
        dst.append(torch.arange(b * tc, b * tc + c))
        tgt.append(torch.tensor(s.completion_ids))
    adv = torch.tensor([s.advantage for s in seqs], dtype=torch.float32)
    return Batch(ids.to(device), att.to(device), torch.cat(src).to(device), torch.cat(tgt).to(device),
                 torch.cat(dst).to(device), cmask.to(device), adv.to(device))


def _split_causal_lm(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(decoder, lm_head) of an HF causal LM, unwrapping PEFT (LoRA layers are injected in place)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, base.base_model_prefix), base.get_output_embeddings()


def _head_logprobs(head: torch.nn.Module, h: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    logits = head(h).float()
    return logits.gather(1, tgt[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


def completion_logprobs(model: torch.nn.Module, batch: Batch, head_chunk: int = 2048) -> torch.Tensor:
    """[B, Tc] log-probs of the completion tokens (0 on padding). The head runs only on the flattened
    hidden states of the N predicting positions: [N, H] @ [H, V], never [B, T, V]; above `head_chunk`
    positions it runs in checkpointed chunks, so at most [head_chunk, V] logits live at once (large vocabularies)."""
    from torch.utils.checkpoint import checkpoint

    decoder, head = _split_causal_lm(model)
    hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.src)
    if h.shape[0] <= head_chunk:
        logp = _head_logprobs(head, h, batch.tgt)
    else:
        run = (lambda *a: checkpoint(_head_logprobs, *a, use_reentrant=False)) if torch.is_grad_enabled() else \
            _head_logprobs
        logp = torch.cat([run(head, h[i: i + head_chunk], batch.tgt[i: i + head_chunk])
                          for i in range(0, h.shape[0], head_chunk)])
    b, tc = batch.completion_mask.shape
    return logp.new_zeros(b * tc).scatter(0, batch.dst, logp).view(b, tc)


# ---- data -----------------------------------------------------------------------------------------


def load_sequences(ctx, kind: str = "group") -> tuple[list[TrainSequence], dict]:
    """Kept `groups` rows of `kind` (pipeline.core.objectives.KINDS; the round of training.data_run when set), each member
    joined to its generation: a sequence with the row's coefficient (group: its advantage; other kinds: its weight)
    and score. The completion tail is cut to max_seq_len. A pair with a member that cannot be trained on is dropped
    whole, so `pair` sequences stay (chosen, rejected) at positions (2p, 2p + 1)."""
    import polars as pl

    max_len = ctx.cfg.training.max_seq_len
    data_run = ctx.cfg.training.data_run or ctx.run_id
    groups = (ctx.store.read("groups", data_run, ctx.round).filter(pl.col("kept"))
              .filter(pl.col("kind").fill_null("group") == kind))
    info = {"sequences_truncated": 0, "sequences_dropped": 0, "distinct_workflows": 0, "distinct_queries": 0}
    if groups.height == 0:
        return [], info
    coef = "advantages" if kind == "group" else "weights"
    members = (groups.select("group_id", "level", "members", pl.col(coef).alias("coef"), "member_scores")
               .explode("members", "coef", "member_scores").rename({"members": "gen_id", "member_scores": "score"}))
    gens = (ctx.store.scan("generations", data_run, ctx.round)
            .select("gen_id", "query_id", "prompt_token_ids", "token_ids", "token_logprobs")
            .unique("gen_id", keep="first").collect())
    rows = members.join(gens, on="gen_id", how="left", maintain_order="left")
    seqs, bad_groups = [], set()
    for r in rows.iter_rows(named=True):
        prompt, comp = r["prompt_token_ids"], r["token_ids"]
        if not prompt or not comp or len(prompt) >= max_len:
            info["sequences_dropped"] += 1  # no generation row, no tokens, or a prompt longer than the cap
            bad_groups.add(r["group_id"])
            continue
        glp = r["token_logprobs"]
        if len(prompt) + len(comp) > max_len:
            info["sequences_truncated"] += 1
            comp = comp[: max_len - len(prompt)]
            glp = glp[: len(comp)] if glp else glp
        seqs.append(TrainSequence(r["gen_id"], list(prompt), list(comp), float(r["coef"]),
                                  list(glp) if glp and len(glp) == len(comp) else None, r["level"],
                                  None if r["score"] is None else float(r["score"]), r["group_id"]))
    if kind == "pair" and bad_groups:
        seqs = [s for s in seqs if s.group_id not in bad_groups]
    if info["sequences_dropped"]:
        log.warning("%d group members skipped (missing generation, empty completion or prompt >= max_seq_len)",
                    info["sequences_dropped"])
    trained = rows.filter(pl.col("gen_id").is_in(list({s.gen_id for s in seqs})))
    info["distinct_workflows"] = trained["gen_id"].n_unique()
    info["distinct_queries"] = trained["query_id"].n_unique()
    log.info("training on %d sequences (%s rows): %d distinct workflows from %d queries", len(seqs), kind,
             info["distinct_workflows"], info["distinct_queries"])
    return seqs, info


# ---- model ----------------------------------------------------------------------------------------


def start_adapter(ctx) -> Path | None:
    """The adapter the round's policy starts from, which sampled the round (π_old): generator.adapter at round 0
    when set, else round k-1's checkpoint; None: a fresh LoRA on the base model (round 0)."""
    if ctx.round > 0:  # the policy that sampled the data: of training.data_run when training on its round
        ckpt = ctx.store.checkpoint_dir(ctx.cfg.training.data_run or ctx.run_id, ctx.round - 1)
    elif ctx.cfg.generator.adapter:
        ckpt = ctx.cfg.generator.adapter
    else:
        return None
    # a local folder for peft (an s3:// checkpoint is materialised in the cache); an incomplete one as named,
    # for load_policy's error
    return ctx.store.local_adapter(ckpt) or ckpt


def load_policy(ctx, device: str):
    """Base model (fp32) + the starting adapter (`start_adapter`), trainable; a fresh LoRA without one."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from pipeline.engines.models import load_causal_lm
    from pipeline.store import adapter_complete

    tc = ctx.cfg.training
    base = load_causal_lm(ctx.cfg.generator.model, dtype="float32", device=device)
    start = start_adapter(ctx)
    if start is None:
        lora = LoraConfig(task_type="CAUSAL_LM", r=tc.lora_r, lora_alpha=tc.lora_alpha, lora_dropout=tc.lora_dropout,
                          target_modules=list(tc.target_modules))
        return get_peft_model(base, lora)
    if not adapter_complete(start):
        hint = (f"run `pipeline train --run-id {ctx.run_id} --round {ctx.round - 1}` first" if ctx.round > 0
                else "generator.adapter must name a saved peft adapter")
        raise RuntimeError(f"round {ctx.round} trains from the adapter {start}, which is missing or incomplete: {hint}")
    # the adapter's own rank and alpha, this run's dropout: a checkpoint saved with dropout > 0 would otherwise
    # make π_θ (train mode) differ from π_old (eval mode) before the first update
    lora = LoraConfig.from_pretrained(str(start))
    lora.lora_dropout = tc.lora_dropout
    return PeftModel.from_pretrained(base, str(start), is_trainable=True, config=lora)


def logprob_batches(seqs: list[TrainSequence], first_step: list[list[int]], mbs: int) -> list[list[int]]:
    """Batches (sequence indices) of a π_old / reference pass: the first optimiser step's micro-batches exactly as
    training runs them, then one sequence per remaining generation, `mbs` at a time. Kernels round differently at
    another padded length (up to 2e-5 in fp32 here, far more in bf16), so laid out this way the first step
    computes π_θ exactly as π_old was computed: ρ = 1 and k3 = 0 before any update."""
    batches = [list(mb) for mb in first_step]
    seen = {seqs[i].gen_id for mb in batches for i in mb}
    rest = []
    for i, s in enumerate(seqs):
        if s.gen_id not in seen:
            seen.add(s.gen_id)
            rest.append(i)
    return batches + [rest[j: j + mbs] for j in range(0, len(rest), mbs)]


@torch.no_grad()
def reference_logprobs(model, seqs: list[TrainSequence], batches: list[list[int]], pad_id: int, device,
                       disable_adapter: bool = False, desc: str = "old logprobs", bf16: bool = False,
                       shard: tuple[int, int] = (0, 1)) -> dict[int, torch.Tensor]:
    """Per sequence index, completion log-probs (fp32 values) of `model` in eval mode (no dropout) computed on
    `batches` (`logprob_batches`), under the same bf16 autocast as the training forward when `bf16`: π_old and
    π_θ are then the same computation at the first step (ratio 1, k3 0 before any update), and the pass costs
    half the fp32 time on CPU. A sequence outside `batches` takes its generation's first computed value.
    `shard=(rank, n)`: this rank computes batches[rank::n] (its share of the first step is exactly the
    micro-batches it trains on, `pipeline.stages.parallel.rank_share`) and the ranks' results are gathered."""
    from tqdm import tqdm

    from pipeline.stages.parallel import gather_logprobs

    rank, n = shard
    was_training = model.training
    model.eval()
    computed: dict[int, torch.Tensor] = {}
    try:
        for mb in tqdm(batches[rank::n], desc=desc, unit="batch", leave=False, disable=rank > 0):
            chunk = [seqs[i] for i in mb]
            batch = collate(chunk, pad_id, device)
            with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=bf16), \
                    model.disable_adapter() if disable_adapter else contextlib.nullcontext():
                lp = completion_logprobs(model, batch).float()
            for b, (i, s) in enumerate(zip(mb, chunk, strict=True)):
                computed[i] = lp[b, : len(s.completion_ids)].cpu()
    finally:
        model.train(was_training)
    computed = gather_logprobs(computed, n)
    by_gen: dict[str, torch.Tensor] = {}
    for i in (i for mb in batches for i in mb):  # "first computed" in the batches' order, whoever computed it
        by_gen.setdefault(seqs[i].gen_id, computed[i])
    return {i: computed[i] if i in computed else by_gen[s.gen_id] for i, s in enumerate(seqs)}


def _pad_rows(rows: list[torch.Tensor], tc: int, device) -> torch.Tensor:
    out = torch.zeros(len(rows), tc)
    for b, r in enumerate(rows):
        out[b, : len(r)] = r
    return out.to(device)


def _plan_steps(n: int, tc, rng: np.random.Generator, unit: int = 1) -> list[list[list[int]]]:
    """Epochs of shuffled micro-batches grouped into optimiser steps: steps[i] = [micro-batch sequence indices].
    Sequences come in units of `unit` consecutive ones (2: score_dpo's pairs) that are shuffled and batched whole,
    `micro_batch_size` units a micro-batch."""
    steps = []
    for _ in range(tc.epochs):
        order = rng.permutation(n // unit)
        micro = [[u * unit + k for u in order[i: i + tc.micro_batch_size].tolist() for k in range(unit)]
                 for i in range(0, n // unit, tc.micro_batch_size)]
        steps += [micro[i: i + tc.grad_accum] for i in range(0, len(micro), tc.grad_accum)]
    return steps


def step_weights(seqs: list[TrainSequence], micro: list[list[int]], tc) -> dict[int, float] | None:
    """Two-level: each sequence's factor c_b in its optimiser step's loss (`pipeline.core.grpo.level_weights`: agent
    and workflow terms, each averaged over its own sequences of the step, weighted by training.two_level);
    flat: None (a step's loss is the mean of its micro-batches' losses, as SPOGW)."""
    idx = [i for mb in micro for i in mb]
    if all(seqs[i].level == "flat" for i in idx):
        return None
    w = {"agent": tc.two_level.agent_weight, "workflow": tc.two_level.workflow_weight}
    c = level_weights([seqs[i].level for i in idx], [len(seqs[i].completion_ids) for i in idx], w, tc.loss_norm)
    return dict(zip(idx, c.tolist(), strict=True))


def kl_masks(chunk: list[TrainSequence], tc) -> bool | torch.Tensor:
    """The advantage mask of the KL term per sequence: training.kl_mask for flat sequences, the level's switch
    (training.two_level.*_kl_mask) for agent and workflow sequences."""
    if all(s.level == "flat" for s in chunk):
        return tc.kl_mask
    switch = {"flat": tc.kl_mask, "agent": tc.two_level.agent_kl_mask, "workflow": tc.two_level.workflow_kl_mask}
    return torch.tensor([switch[s.level] for s in chunk])


# ---- the stage -----------------------------------------------------------------------------------------


def _lr_scheduler(optimizer, tc, total_steps: int):
    from transformers import get_scheduler

    name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[tc.lr_schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=tc.warmup_steps, num_training_steps=max(total_steps, 1))


def _seq_tensor(seqs: list[TrainSequence], mb: list[int], field: str, device) -> torch.Tensor | None:
    vals = [getattr(seqs[i], field) for i in mb]
    return None if any(v is None for v in vals) else torch.tensor(vals, dtype=torch.float32, device=device)


def run_train(ctx) -> dict:
    """Train the round's adapter with `training.objective` on its curated rows and write the round's checkpoint.
    Under `accelerate launch --num_processes N` it trains data-parallel (`pipeline.stages.parallel`): the same global
    batches, each optimiser step's micro-batches dealt to the ranks, gradients all-reduced; rank 0 writes."""
    from tqdm import tqdm

    from pipeline.core.objectives import LossInput, get_objective
    from pipeline.engines.models import load_tokenizer
    from pipeline.run import derived_seed
    from pipeline.stages.parallel import LogprobModule, make_accelerator, rank_share, reduce_step

    ckpt = ctx.store.checkpoint_dir(ctx.run_id, ctx.round)
    tc = ctx.cfg.training
    obj = get_objective(tc.objective)
    mode = get_mode(ctx.cfg.rollout.mode)
    if mode.objective_kinds is not None and obj.kind not in mode.objective_kinds:
        raise ValueError(f"training.objective={obj.name} trains on {obj.kind} rows, which curation does not write "
                         f"for rollout.mode {mode.name} (it writes {', '.join(mode.objective_kinds)} rows)")
    if obj.needs_ref and tc.reference == "none":
        raise ValueError(f"training.objective={obj.name} needs a reference model; training.reference is 'none'")
    accel = make_accelerator()
    rank, n_ranks, device = accel.process_index, accel.num_processes, accel.device
    main = accel.is_main_process
    torch.manual_seed(derived_seed(tc.seed, "train", ctx.round))  # the same fresh LoRA on every rank
    seqs, info = load_sequences(ctx, obj.kind)
    if not seqs:
        log.warning("round %d has no kept %s rows: the checkpoint is the unchanged adapter", ctx.round, obj.kind)
    pad_id = load_tokenizer(ctx.cfg.generator.model).pad_token_id or 0
    model = load_policy(ctx, device)
    if tc.gradient_checkpointing:
        model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rng = np.random.default_rng(derived_seed(tc.seed, "steps", ctx.round))
    steps = _plan_steps(len(seqs), tc, rng, 2 if obj.paired else 1) if seqs else []
    batches = logprob_batches(seqs, steps[0] if steps else [], tc.micro_batch_size)
    # DDP broadcasts rank 0's weights here: π_old / reference below then come from the weights every rank trains
    policy = accel.prepare(LogprobModule(model))  # DDP wraps the call the loss goes through
    lp_args = {"pad_id": pad_id, "device": device, "bf16": tc.bf16, "shard": (rank, n_ranks)}
    old = reference_logprobs(model, seqs, batches, **lp_args) if obj.needs_old else None
    ref = None
    if obj.uses_ref and tc.reference != "none":
        if tc.reference == "base" and start_adapter(ctx) is not None:
            ref = reference_logprobs(model, seqs, batches, disable_adapter=True, desc="ref logprobs", **lp_args)
        else:  # the starting adapter = π_old (a fresh LoRA is a no-op: both are the base model)
            ref = old if old is not None else reference_logprobs(model, seqs, batches, desc="ref logprobs", **lp_args)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=tc.lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(steps) / tc.epochs) if steps else 0
    sched = _lr_scheduler(optimizer, tc, len(steps))
    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=tc.bf16)
    policy.train()
    metrics = []
    for step, micro in enumerate(tqdm(steps, desc=f"train round {ctx.round} ({obj.name})", unit="step",
                                      disable=not main)):
        t0 = time.perf_counter()
        lr = sched.get_last_lr()[0]
        acc: dict[str, float | None] = {"loss": 0.0, "pg_loss": 0.0, "kl": None, "clip_frac": None, "ratio_dev": None,
                                        "tokens": 0.0, "mism": 0.0, "mism_n": 0.0}
        weights = step_weights(seqs, micro, tc)
        share_mbs = rank_share(micro, rank, n_ranks)
        for j, (mb, real) in enumerate(share_mbs):
            chunk = [seqs[i] for i in mb]
            batch = collate(chunk, pad_id, device)
            tcol = batch.completion_mask.shape[1]
            # DDP all-reduces at each rank's last backward of the step only
            sync = contextlib.nullcontext() if j == len(share_mbs) - 1 else accel.no_sync(policy)
            with sync:
                with autocast:
                    logp = policy(batch)
                cw = None if weights is None else torch.tensor([weights[i] for i in mb], device=device)
                terms = obj.fn(LossInput(
                    logp=logp.float(), mask=batch.completion_mask, coef=batch.advantages,
                    old_logp=None if old is None else _pad_rows([old[i] for i in mb], tcol, device),
                    ref_logp=None if ref is None else _pad_rows([ref[i] for i in mb], tcol, device),
                    scores=_seq_tensor(seqs, mb, "score", device), kl_mask=kl_masks(chunk, tc), seq_weights=cw), tc)
                share = 1.0 if cw is not None else 1 / len(micro)  # level weights already normalise over the step
                # x ranks: DDP averages the ranks' gradients, the step's gradient is their sum; a filler weighs 0
                accel.backward(terms.loss * (share * n_ranks if real else 0.0))
            if not real:
                continue
            for k in ("loss", "pg_loss", "kl", "clip_frac"):
                v, w = getattr(terms, k), share if k in ("loss", "pg_loss") else 1 / len(micro)
                if v is not None:
                    acc[k] = (acc[k] or 0.0) + float(v.detach()) * w
            acc["tokens"] += int(batch.completion_mask.sum())
            if terms.ratio_dev is not None:
                acc["ratio_dev"] = max(acc["ratio_dev"] or 0.0, float(terms.ratio_dev))
            for i, s in zip(mb, chunk, strict=True):
                if s.gen_logprobs is not None and old is not None:
                    acc["mism"] += float((torch.tensor(s.gen_logprobs) - old[i]).abs().sum())
                    acc["mism_n"] += len(s.gen_logprobs)
        grad_norm = accel.clip_grad_norm_(params, tc.max_grad_norm)
        optimizer.step()
        sched.step()
        optimizer.zero_grad(set_to_none=True)
        acc = reduce_step(acc, n_ranks, maxed=("ratio_dev",))
        mism, mism_n = acc.pop("mism"), acc.pop("mism_n")
        metrics.append({"step": step, "epoch": step // steps_per_epoch, **acc, "tokens": int(acc["tokens"]), "lr": lr,
                        "grad_norm": float(grad_norm), "logp_mismatch": mism / mism_n if mism_n else None,
                        "wall_s": time.perf_counter() - t0})
    policy.eval()
    if main:
        peft_model = accel.unwrap_model(policy).model
        # whole or absent, on a local path or object storage
        ctx.store.publish_checkpoint(lambda d: peft_model.save_pretrained(str(d)), ctx.run_id, ctx.round)
        ctx.store.write("train_metrics", metrics, ctx.run_id, ctx.round)
        ctx.store.write("checkpoints", [{"path": str(ckpt), "base_model": ctx.cfg.generator.model,
                                         "parent_round": ctx.round - 1 if ctx.round > 0 else None,
                                         "rows_used": len(seqs)}], ctx.run_id, ctx.round)
    mismatch = [m["logp_mismatch"] for m in metrics if m["logp_mismatch"] is not None]
    counts = {"objective": obj.name, "sequences": len(seqs), "generations": len({s.gen_id for s in seqs}),
              "steps": len(steps), "tokens": sum(m["tokens"] for m in metrics), **info, "processes": n_ranks,
              "final_loss": metrics[-1]["loss"] if metrics else None,
              "logp_mismatch": float(np.mean(mismatch)) if mismatch else None, "checkpoint": str(ckpt)}
    if main:
        ctx.finish("train", **counts)
    accel.wait_for_everyone()  # every rank returns after the manifest exists (the runner checks it)
    return counts
