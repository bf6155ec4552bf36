"""The train stage: LoRA GRPO with advantage-masked KL on a round's curated groups (docs/design.md §6).

Data: every member of every kept group is one row (prompt_token_ids + token_ids, the loss on the completion
only) with its group advantage; a workflow kept in several groups is several rows. Each token is computed once
(issue 23, docs/performance.md): a step holds whole groups (`pipeline.core.packing.plan_steps`), a forward pass encodes
each distinct prompt once and its completions attend to it (`collate`, `completion_logprobs`), a sequence in several
rows of a step is computed once and carries the sum of their loss terms (`chunk_loss_input`), and passes are
packed by padded tokens (`pipeline.core.packing.pack`).

The stage in four steps (`run_train`): `load_stage` (rows, policy, step plan), `reference_passes` (π_old and the
reference), `optimise` (the optimiser loop, one `StepMetrics` a step), `write_outputs`.

A two-level round's loss is the proposal's: an agent term and a workflow term, each averaged over its own rows of
the optimiser step, weighted by training.two_level (`step_weights`), each
level's KL masked or not by its switch (`kl_masks`). π_old = the adapter as loaded (previous round's
checkpoint; at round 0 generator.adapter, which sampled it, or a fresh LoRA = the base model), recomputed
here once before the first step in eval mode (fp32, or under the bf16 autocast of training when
training.bf16), or taken from the rollout's own log-probs (training.old_logprobs: rollout, no pass); the
reference is that same model by default. LoRA dropout defaults to 0, and replaces a loaded adapter's: π_θ in train
mode then equals a recomputed π_old before the first update (ρ = 1, logged `ratio_dev`).

Crash safety: the checkpoint is saved to a temp folder and renamed into place; `train_metrics` and
the `checkpoints` row are written once, at the end, after the adapter is saved. A re-run without
the stage manifest deletes those parts and any checkpoint folder of the unfinished attempt, and the
loop resumes at the last step saved by `training.save_steps` (`pipeline.stages.progress`; step 0 when none).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# polars / the store / the run config are imported where used: the step functions below (collate,
# completion_logprobs) import with torch alone, as `pipeline bench train` needs on a bare GPU machine.
from pipeline.core.grpo import grpo_mkl_loss, grpo_mkl_terms, k3, level_weights, reduce_tokens
from pipeline.core.packing import Chunk, RowShape, logprob_chunks, pack, plan_steps, step_units
from pipeline.stages.modes import get_mode
from pipeline.stages.progress import clear_progress, load_progress, progress_path, save_progress

__all__ = ["grpo_mkl_loss", "grpo_mkl_terms", "run_train", "TrainSequence", "Batch", "collate", "completion_logprobs",
           "StepMetrics", "chunk_loss_input", "row_shapes", "plan_passes"]

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
    """One forward pass in two parts: the distinct prompts (each without its last token) once, then every sequence's
    last prompt token and completion, attending to its prompt's keys and values. Position j of the second part's
    grid predicts completion token j, so the grids of `input_ids`, `tgt` and `completion_mask` coincide."""

    prompt_ids: torch.Tensor  # [P, Lp] distinct prompts minus their last token, right-padded (Lp may be 0)
    prompt_mask: torch.Tensor  # [P, Lp]
    prompt_of: torch.Tensor  # [B] the row of each sequence's prompt
    input_ids: torch.Tensor  # [B, Tc] last prompt token + completion[:-1], right-padded
    position_ids: torch.Tensor  # [B, Tc] positions in the full sequence (len(prompt) - 1 + j)
    src: torch.Tensor  # [N] flat positions (b*Tc + j) of the completion tokens in the [B, Tc] grid
    tgt: torch.Tensor  # [N] the completion token ids
    completion_mask: torch.Tensor  # [B, Tc]
    advantages: torch.Tensor  # [B]

    @property
    def slots(self) -> int:
        """Token positions the pass computes, padding included (prompt grid + completion grid)."""
        return self.prompt_ids.numel() + self.input_ids.numel()

    @property
    def tokens(self) -> int:
        """Token positions that hold a real token."""
        return int(self.prompt_mask.sum()) + int(self.completion_mask.sum())


def collate(seqs: list[TrainSequence], pad_id: int, device: torch.device | str = "cpu",
            share_prompts: bool = True) -> Batch:
    """`share_prompts=False` gives every sequence its own prompt row (the per-sequence cost, for benches)."""
    prompts: dict[tuple[int, ...], int] = {}
    prompt_of = [prompts.setdefault(tuple(s.prompt_ids[:-1]) if share_prompts else (b, *s.prompt_ids[:-1]),
                                    len(prompts)) for b, s in enumerate(seqs)]
    body = [p if share_prompts else p[1:] for p in prompts]
    lp, tc = max(map(len, body), default=0), max(len(s.completion_ids) for s in seqs)
    pids, pmask = torch.full((len(body), lp), pad_id, dtype=torch.long), torch.zeros((len(body), lp), dtype=torch.long)
    for i, p in enumerate(body):
        pids[i, : len(p)], pmask[i, : len(p)] = torch.tensor(p, dtype=torch.long), 1
    ids, tgt = torch.full((len(seqs), tc), pad_id, dtype=torch.long), torch.zeros((len(seqs), tc), dtype=torch.long)
    cmask, pos = torch.zeros((len(seqs), tc)), torch.zeros((len(seqs), tc), dtype=torch.long)
    for b, s in enumerate(seqs):
        c = len(s.completion_ids)
        ids[b, :c] = torch.tensor([s.prompt_ids[-1], *s.completion_ids[:-1]])
        tgt[b, :c], cmask[b, :c] = torch.tensor(s.completion_ids), 1
        pos[b] = torch.arange(len(s.prompt_ids) - 1, len(s.prompt_ids) - 1 + tc)
    src = cmask.flatten().nonzero().squeeze(1)
    adv = torch.tensor([s.advantage for s in seqs], dtype=torch.float32)
    return Batch(*(t.to(device) for t in (pids, pmask, torch.tensor(prompt_of), ids, pos, src, tgt.flatten()[src],
                                          cmask, adv)))


@dataclass
class PackedBatch:
    """One forward pass as rows that each hold a distinct prompt followed by its sequences' completions (all tokens
    but the last), under a 4D mask: a completion sees its prompt and its own earlier tokens, not its siblings
    (Prefix Grouper's layout, arXiv 2506.05433). One decoder call and no padding between completions; the same
    outputs as `Batch` (`completion_logprobs` returns the same [B, Tc] grid)."""

    input_ids: torch.Tensor  # [R, T] prompt, then each completion[:-1], right-padded
    position_ids: torch.Tensor  # [R, T] prompt 0..Lp-1; each completion from Lp again
    attention_mask: torch.Tensor  # [R, 1, T, T] bool, True = attends
    src: torch.Tensor  # [N] flat positions (r*T + i) of the hidden states predicting the completion tokens
    dst: torch.Tensor  # [N] their places (b*Tc + j) in the [B, Tc] output grid
    tgt: torch.Tensor  # [N] the completion token ids
    completion_mask: torch.Tensor  # [B, Tc]
    advantages: torch.Tensor  # [B]
    real: int  # token positions that hold a real token

    @property
    def slots(self) -> int:
        return self.input_ids.numel()

    @property
    def tokens(self) -> int:
        return self.real


def collate_packed(seqs: list[TrainSequence], pad_id: int, device: torch.device | str = "cpu") -> PackedBatch:
    """`PackedBatch` of `seqs` (prompts of at least one token: a completion's first token is predicted from its
    prompt's last position)."""
    rows: dict[tuple[int, ...], list[int]] = {}
    for b, s in enumerate(seqs):
        rows.setdefault(tuple(s.prompt_ids), []).append(b)
    tc = max(len(s.completion_ids) for s in seqs)
    built, src, dst, tgt = [], [], [], []  # per row (ids, positions, owners); src as (row, index)
    for r, (prompt, members) in enumerate(rows.items()):
        lp = len(prompt)
        ids, pos, own = list(prompt), list(range(lp)), [-1] * lp
        for b in members:
            c = seqs[b].completion_ids
            src += [(r, lp - 1)] + [(r, len(ids) + j) for j in range(len(c) - 1)]
            dst += [b * tc + j for j in range(len(c))]
            tgt += c
            ids, pos, own = ids + c[:-1], pos + list(range(lp, lp + len(c) - 1)), own + [b] * (len(c) - 1)
        built.append((ids, pos, own))
    t = max(len(ids) for ids, _, _ in built)
    ids_t = torch.full((len(built), t), pad_id, dtype=torch.long)
    pos_t = torch.zeros((len(built), t), dtype=torch.long)
    own_t = -2 - torch.arange(t).repeat(len(built), 1)  # padding: an owner of its own (it sees itself: no empty row)
    for r, (ids, pos, own) in enumerate(built):
        ids_t[r, : len(ids)], pos_t[r, : len(ids)], own_t[r, : len(ids)] = (torch.tensor(x) for x in (ids, pos, own))
    idx = torch.arange(t)
    mask = (idx[None, :] <= idx[:, None]) & ((own_t[:, None, :] == -1) | (own_t[:, None, :] == own_t[:, :, None]))
    cmask = torch.zeros((len(seqs), tc))
    for b, s in enumerate(seqs):
        cmask[b, : len(s.completion_ids)] = 1
    src_t = torch.tensor([r * t + i for r, i in src], dtype=torch.long)
    dst_t = torch.tensor(dst, dtype=torch.long)
    adv = torch.tensor([s.advantage for s in seqs], dtype=torch.float32)
    real = sum(len(ids) for ids, _, _ in built)
    tgt_t = torch.tensor(tgt, dtype=torch.long)
    return PackedBatch(*(x.to(device) for x in (ids_t, pos_t, mask[:, None], src_t, dst_t, tgt_t, cmask, adv)), real)


def pass_batch(seqs: list[TrainSequence], pad_id: int, device, layout: str = "split") -> Batch | PackedBatch:
    """A pass's tensors in `training.prompt_layout`."""
    return collate_packed(seqs, pad_id, device) if layout == "packed" else collate(seqs, pad_id, device)


def _split_causal_lm(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(decoder, lm_head) of an HF causal LM, unwrapping PEFT (LoRA layers are injected in place)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, base.base_model_prefix), base.get_output_embeddings()


def _head_logprobs(head: torch.nn.Module, h: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    logits = head(h)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 up to fp32; fp64 stays fp64
    return logits.gather(1, tgt[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


# ---- the prompt's keys and values, shared by its completions ----------------------------------------------------
# HF's cache API carries them from the prompt pass to the completion pass. Neither cache below appends: a layer under
# gradient checkpointing runs its forward again in the backward pass, and a second append would double the prompt.


def _cache_types():
    from transformers.cache_utils import Cache, DynamicLayer

    class RecordingLayer(DynamicLayer):
        """Keeps the last keys/values it was given (replacing: a checkpointed replay stores the same again)."""

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
            return key_states, value_states

    class PrefixLayer(DynamicLayer):
        """Read-only prompt keys/values: returns them followed by the new ones, stores nothing."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor):
            super().__init__()
            self.lazy_initialization(keys, values)
            self.keys, self.values = keys, values

        def update(self, key_states, value_states, *args, **kwargs):
            return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)

    return Cache, RecordingLayer, PrefixLayer


def _recording_cache():
    cache_cls, recording, _ = _cache_types()
    return cache_cls(layer_class_to_replicate=recording)


def _prefix_cache(rec, rows: torch.Tensor):
    """`rec`'s keys/values with batch rows `rows` (each sequence's prompt): index_select copies them, and its
    backward sums the completions' gradients into their prompt's."""
    cache_cls, _, prefix = _cache_types()
    return cache_cls(layers=[prefix(layer.keys.index_select(0, rows), layer.values.index_select(0, rows))
                             for layer in rec.layers])


@contextlib.contextmanager
def _cache_under_checkpointing(decoder: torch.nn.Module):
    """HF drops `past_key_values` in a layer under gradient checkpointing unless the layer says its cache is safe to
    replay; ours are (see above), so the flag is set for the forward (the replay reuses the forward's arguments)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in decoder.modules() if isinstance(m, GradientCheckpointingLayer)]
    for m in layers:
        m._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for m in layers:
            del m._can_checkpoint_with_cache


def _prompt_states(decoder: torch.nn.Module, batch: Batch):
    """The prompts' per-layer keys and values (with their autograd history: gradients flow back into the prompt
    pass), expanded to one row per sequence as a read-only cache; None when no prompt has more than one token."""
    if batch.prompt_ids.shape[1] == 0:
        return None
    rec = _recording_cache()
    with _cache_under_checkpointing(decoder):
        decoder(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask, past_key_values=rec, use_cache=False)
    return _prefix_cache(rec, batch.prompt_of)


def _gathered_logprobs(head: torch.nn.Module, h: torch.Tensor, tgt: torch.Tensor, head_chunk: int) -> torch.Tensor:
    """Log-probs of `tgt` from the hidden states `h` [N, H]: above `head_chunk` positions in checkpointed chunks, so
    at most [head_chunk, V] logits live at once."""
    from torch.utils.checkpoint import checkpoint

    if h.shape[0] <= head_chunk:
        return _head_logprobs(head, h, tgt)
    run = (lambda *a: checkpoint(_head_logprobs, *a, use_reentrant=False)) if torch.is_grad_enabled() else \
        _head_logprobs
    return torch.cat([run(head, h[i: i + head_chunk], tgt[i: i + head_chunk])
                      for i in range(0, h.shape[0], head_chunk)])


def completion_logprobs(model: torch.nn.Module, batch: Batch | PackedBatch, head_chunk: int = 2048) -> torch.Tensor:
    """[B, Tc] log-probs of the completion tokens (0 on padding), each distinct prompt encoded once (`Batch`, or
    `PackedBatch`: one row per prompt). The head runs only on the hidden states of the N completion positions
    (`_gathered_logprobs`): [N, H] @ [H, V], never [B, T, V]."""
    decoder, head = _split_causal_lm(model)
    if isinstance(batch, PackedBatch):
        hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                         position_ids=batch.position_ids, use_cache=False).last_hidden_state
        dst = batch.dst
    else:
        cache = _prompt_states(decoder, batch)
        mask = batch.completion_mask.long()
        if cache is not None:
            mask = torch.cat([batch.prompt_mask.index_select(0, batch.prompt_of), mask], dim=1)
        with _cache_under_checkpointing(decoder):
            hidden = decoder(input_ids=batch.input_ids, attention_mask=mask, position_ids=batch.position_ids,
                             past_key_values=cache, use_cache=False).last_hidden_state
        dst = batch.src  # the completion grid is the output grid
    logp = _gathered_logprobs(head, hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.src), batch.tgt,
                              head_chunk)
    b, tc = batch.completion_mask.shape
    return logp.new_zeros(b * tc).scatter(0, dst, logp).view(b, tc)


# ---- data -----------------------------------------------------------------------------------------


def load_sequences(ctx, kind: str = "group") -> tuple[list[TrainSequence], dict]:
    """Kept `groups` rows of `kind` (pipeline.core.objectives.KINDS; the round of training.data_run when set), each
    member joined to its generation: a sequence with the row's coefficient (group: its advantage; other kinds: its
    weight) and score. The completion tail is cut to max_seq_len. A pair with a member that cannot be trained on is
    dropped whole, so `pair` sequences stay (chosen, rejected) at positions (2p, 2p + 1)."""
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


def frozen_linears_bf16(model: torch.nn.Module) -> int:
    """Store the frozen linear weights (and biases) in bf16 for a bf16-autocast policy; returns how many modules.
    Autocast caches its bf16 copy only of leaf tensors that require grad, so it casts every frozen fp32 weight again
    at every call (a step calls each layer twice: prompt, then completions), and the product it computes is that
    of the bf16-rounded weight anyway: the log-probs and gradients do not change (tests/test_shared_prompt.py), the
    casts go and the frozen weights take half the memory. Tied input embeddings stay fp32 (they start the residual
    stream, which autocast keeps in fp32)."""
    emb = model.get_input_embeddings().weight
    n = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad and m.weight is not emb:
            for t in (m.weight, m.bias):
                if t is not None and not t.requires_grad:
                    t.data = t.data.to(torch.bfloat16)
            n += 1
    return n


def row_shapes(seqs: list[TrainSequence]) -> list[RowShape]:
    """What `pipeline.core.packing` plans with: identity, group, the prompt a pass encodes once, completion length."""
    return [RowShape(s.gen_id, s.group_id, tuple(s.prompt_ids[:-1]), len(s.completion_ids)) for s in seqs]


def pass_budget(tc) -> int:
    """Padded token positions a pass may hold: training.micro_batch_tokens, or by default the worst case of the
    former fixed micro-batches (micro_batch_size sequences of max_seq_len): a pass then holds no more token positions
    than a micro-batch could (it also holds its prompts' keys and values once per sequence)."""
    return tc.micro_batch_tokens or tc.micro_batch_size * tc.max_seq_len


@dataclass
class PlannedStep:
    epoch: int
    passes: list[Chunk]  # its forward/backward passes

    @property
    def rows(self) -> list[int]:
        return [r for c in self.passes for r in c.rows]


def plan_passes(seqs: list[TrainSequence], tc, rng: np.random.Generator, paired: bool = False) -> list[PlannedStep]:
    """Every optimiser step's passes: its rows (`pipeline.core.packing.plan_steps`, training.step_order,
    micro_batch_size x grad_accum rows a step), one unit per distinct sequence (or pair), packed by tokens."""
    shapes = row_shapes(seqs)
    unit = 2 if paired else 1
    epochs = plan_steps(shapes, tc.epochs, tc.micro_batch_size * tc.grad_accum * unit, rng, tc.step_order, unit)
    return [PlannedStep(e, pack(step_units(rows, shapes, paired), shapes, pass_budget(tc)))
            for e, steps in enumerate(epochs) for rows in steps]


def _pass_logprobs(model, seqs: list[TrainSequence], chunk: Chunk, pad_id: int, device, bf16: bool,
                   disable_adapter: bool, layout: str) -> dict[str, torch.Tensor]:
    uniq = [seqs[i] for i in chunk.uniq]
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=bf16), \
            model.disable_adapter() if disable_adapter else contextlib.nullcontext():
        lp = completion_logprobs(model, pass_batch(uniq, pad_id, device, layout)).float()
    return {s.gen_id: lp[b, : len(s.completion_ids)].cpu() for b, s in enumerate(uniq)}


@torch.no_grad()
def reference_logprobs(model, seqs: list[TrainSequence], chunks: list[Chunk], pad_id: int, device,
                       disable_adapter: bool = False, desc: str = "old logprobs", bf16: bool = False,
                       shard: tuple[int, int] = (0, 1), layout: str = "split") -> dict[str, torch.Tensor]:
    """Per gen_id, completion log-probs (fp32 values) of `model` in eval mode (no dropout) computed on `chunks`
    (`pipeline.core.packing.logprob_chunks`), under the same bf16 autocast as the training forward when `bf16`: π_old
    and π_θ are then the same computation at the first step (ratio 1, k3 0 before any update), and the pass costs
    half the fp32 time on CPU. A sequence in several chunks takes the first chunk's value.
    `shard=(rank, n)`: this rank computes chunks[rank::n] (its share of the first step is exactly the passes it
    trains, `pipeline.stages.parallel.rank_share`) and the ranks' results are gathered."""
    from tqdm import tqdm

    from pipeline.stages.parallel import gather_logprobs

    rank, n = shard
    was_training = model.training
    model.eval()
    computed: dict[int, dict[str, torch.Tensor]] = {}
    try:
        for k in tqdm(range(rank, len(chunks), n), desc=desc, unit="pass", leave=False, disable=rank > 0):
            computed[k] = _pass_logprobs(model, seqs, chunks[k], pad_id, device, bf16, disable_adapter, layout)
    finally:
        model.train(was_training)
    computed = gather_logprobs(computed, n)
    by_gen: dict[str, torch.Tensor] = {}
    for k in sorted(computed):
        for gen, lp in computed[k].items():
            by_gen.setdefault(gen, lp)
    return by_gen


def _pad_rows(rows: list[torch.Tensor], tc: int, device) -> torch.Tensor:
    out = torch.zeros(len(rows), tc)
    for b, r in enumerate(rows):
        out[b, : len(r)] = r
    return out.to(device)


def step_weights(seqs: list[TrainSequence], rows: list[int], tc) -> dict[int, float] | None:
    """Two-level: each row's factor c_b in its optimiser step's loss (`pipeline.core.grpo.level_weights`: agent and
    workflow terms, each averaged over its own rows of the step, weighted by training.two_level); flat: None (a
    step's loss is the mean over its rows, or its completion tokens under loss_norm=token, as SPOGW)."""
    if all(seqs[i].level == "flat" for i in rows):
        return None
    w = {"agent": tc.two_level.agent_weight, "workflow": tc.two_level.workflow_weight}
    c = level_weights([seqs[i].level for i in rows], [len(seqs[i].completion_ids) for i in rows], w, tc.loss_norm)
    return dict(zip(rows, c.tolist(), strict=True))


def kl_masks(chunk: list[TrainSequence], tc) -> bool | torch.Tensor:
    """The advantage mask of the KL term per sequence: training.kl_mask for flat sequences, the level's switch
    (training.two_level.*_kl_mask) for agent and workflow sequences."""
    if all(s.level == "flat" for s in chunk):
        return tc.kl_mask
    switch = {"flat": tc.kl_mask, "agent": tc.two_level.agent_kl_mask, "workflow": tc.two_level.workflow_kl_mask}
    return torch.tensor([switch[s.level] for s in chunk])


def pass_shares(seqs: list[TrainSequence], chunk: Chunk, step_rows: list[int], norm: str) -> tuple[float, float]:
    """(share, token share) of a pass in its step: its rows' share of the step's rows (norm="sequence") or of its
    completion tokens (norm="token"), and its rows' share of the completion tokens. An objective returns the mean
    over the rows it is given; times `share`, the passes' losses sum to the step's mean."""
    tokens = lambda rows: sum(len(seqs[r].completion_ids) for r in rows)  # noqa: E731
    tok_share = tokens(chunk.rows) / max(tokens(step_rows), 1)
    return (len(chunk.rows) / len(step_rows) if norm == "sequence" else tok_share), tok_share


def _seq_tensor(seqs: list[TrainSequence], rows: list[int], field: str, device) -> torch.Tensor | None:
    vals = [getattr(seqs[i], field) for i in rows]
    return None if any(v is None for v in vals) else torch.tensor(vals, dtype=torch.float32, device=device)


def chunk_loss_input(seqs: list[TrainSequence], chunk: Chunk, logp: torch.Tensor, batch: Batch, tc,
                     old: dict | None, ref: dict | None, weights: dict[int, float] | None, device):
    """The objective's input for a pass's rows: each row takes its sequence's log-probs (computed once, `take`),
    with its own coefficient; the rows of one sequence then add their loss terms, and its gradient is their sum."""
    from pipeline.core.objectives import LossInput

    rows = [seqs[r] for r in chunk.rows]
    take = torch.tensor(chunk.take, device=logp.device)
    tcol = logp.shape[1]
    gens = lambda lps: _pad_rows([lps[s.gen_id] for s in rows], tcol, device)  # noqa: E731
    return LossInput(
        logp=logp.float().index_select(0, take), mask=batch.completion_mask.index_select(0, take),
        coef=torch.tensor([s.advantage for s in rows], dtype=torch.float32, device=device),
        old_logp=None if old is None else gens(old), ref_logp=None if ref is None else gens(ref),
        scores=_seq_tensor(seqs, chunk.rows, "score", device), kl_mask=kl_masks(rows, tc),
        seq_weights=None if weights is None else torch.tensor([weights[r] for r in chunk.rows], device=device))


# ---- the stage -----------------------------------------------------------------------------------------


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
    mism: float = 0.0
    mism_n: float = 0.0

    def add_terms(self, terms, share: float, tok_share: float, loss_share: float) -> None:
        self.loss += float(terms.loss.detach()) * loss_share
        self.pg_loss += float(terms.pg_loss) * loss_share
        if terms.kl is not None:
            self.kl = (self.kl or 0.0) + float(terms.kl) * share
        if terms.clip_frac is not None:
            self.clip_frac = (self.clip_frac or 0.0) + float(terms.clip_frac) * tok_share
        if terms.ratio_dev is not None:
            self.ratio_dev = max(self.ratio_dev or 0.0, float(terms.ratio_dev))

    def add_mismatch(self, uniq: list[TrainSequence], old: dict | None) -> None:
        for s in uniq:
            if s.gen_logprobs is not None and old is not None:
                self.mism += float((torch.tensor(s.gen_logprobs) - old[s.gen_id]).abs().sum())
                self.mism_n += len(s.gen_logprobs)


@dataclass
class TrainSetup:
    """What the passes and the optimiser loop share."""

    ctx: object
    obj: object  # pipeline.core.objectives.Objective
    accel: object
    seqs: list[TrainSequence]
    info: dict
    model: torch.nn.Module  # the PEFT model
    policy: torch.nn.Module  # the same, as DDP sees it (`LogprobModule`)
    pad_id: int
    steps: list[PlannedStep]
    bf16: bool  # training.bf16 resolved for this device (auto: native bf16 only)

    @property
    def shard(self) -> tuple[int, int]:
        return self.accel.process_index, self.accel.num_processes


def _check_objective(ctx):
    from pipeline.core.objectives import get_objective

    tc = ctx.cfg.training
    obj = get_objective(tc.objective)
    mode = get_mode(ctx.cfg.rollout.mode)
    if mode.objective_kinds is not None and obj.kind not in mode.objective_kinds:
        raise ValueError(f"training.objective={obj.name} trains on {obj.kind} rows, which curation does not write "
                         f"for rollout.mode {mode.name} (it writes {', '.join(mode.objective_kinds)} rows)")
    if obj.needs_ref and tc.reference == "none":
        raise ValueError(f"training.objective={obj.name} needs a reference model; training.reference is 'none'")
    return obj


def load_stage(ctx, obj, accel) -> TrainSetup:
    """Step 1: the round's rows, the policy (the same fresh LoRA on every rank), the step plan; DDP wraps the
    policy (and broadcasts rank 0's weights, so π_old / reference come from the weights every rank trains)."""
    from pipeline.engines.hardware import resolve_bf16
    from pipeline.engines.models import load_tokenizer
    from pipeline.run import derived_seed
    from pipeline.stages.parallel import LogprobModule

    tc = ctx.cfg.training
    torch.manual_seed(derived_seed(tc.seed, "train", ctx.round))
    seqs, info = load_sequences(ctx, obj.kind)
    if not seqs:
        log.warning("round %d has no kept %s rows: the checkpoint is the unchanged adapter", ctx.round, obj.kind)
    pad_id = load_tokenizer(ctx.cfg.generator.model).pad_token_id or 0
    model = load_policy(ctx, accel.device)
    bf16 = resolve_bf16(tc.bf16, accel.device.type)
    if bf16:
        frozen_linears_bf16(model)
    if tc.gradient_checkpointing:
        model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rng = np.random.default_rng(derived_seed(tc.seed, "steps", ctx.round))
    steps = plan_passes(seqs, tc, rng, obj.paired) if seqs else []
    policy = accel.prepare(LogprobModule(model, completion_logprobs))
    return TrainSetup(ctx, obj, accel, seqs, info, model, policy, pad_id, steps, bf16)


def old_logprobs(s: TrainSetup, chunks: list[Chunk], args: dict) -> dict[str, torch.Tensor]:
    """π_old per gen_id: recomputed on `chunks`, or (training.old_logprobs: rollout) the log-probs the rollout
    sampled with. Sequences stored without them (an endpoint that gave none) are recomputed in the chunks that
    hold them, laid out as for `recompute`, so π_θ at the first step still matches them exactly."""
    if s.ctx.cfg.training.old_logprobs == "recompute":
        return reference_logprobs(s.model, s.seqs, chunks, **args)
    rollout = {q.gen_id: torch.tensor(q.gen_logprobs, dtype=torch.float32)
               for q in s.seqs if q.gen_logprobs is not None}
    todo = [c for c in chunks if any(s.seqs[i].gen_id not in rollout for i in c.uniq)]
    if todo:
        log.info("%d sequences have no rollout log-probs: π_old is recomputed for %d passes",
                 len({q.gen_id for q in s.seqs} - rollout.keys()), len(todo))
    return (reference_logprobs(s.model, s.seqs, todo, **args) if todo else {}) | rollout


def reference_passes(s: TrainSetup) -> tuple[dict | None, dict | None]:
    """Step 2: π_old and reference log-probs per gen_id, before any update (`reference_logprobs`)."""
    tc = s.ctx.cfg.training
    chunks = logprob_chunks(s.steps[0].passes if s.steps else [], row_shapes(s.seqs), pass_budget(tc))
    args = {"pad_id": s.pad_id, "device": s.accel.device, "bf16": s.bf16, "shard": s.shard, "layout": tc.prompt_layout}
    old = old_logprobs(s, chunks, args) if s.obj.needs_old else None
    if not s.obj.uses_ref or tc.reference == "none":
        return old, None
    if tc.reference == "base" and start_adapter(s.ctx) is not None:
        return old, reference_logprobs(s.model, s.seqs, chunks, disable_adapter=True, desc="ref logprobs", **args)
    # the starting adapter = π_old (a fresh LoRA is a no-op: both are the base model)
    return old, old if old is not None else reference_logprobs(s.model, s.seqs, chunks, desc="ref logprobs", **args)


def _lr_scheduler(optimizer, tc, total_steps: int):
    from transformers import get_scheduler

    name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[tc.lr_schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=tc.warmup_steps, num_training_steps=max(total_steps, 1))


def train_pass(s: TrainSetup, chunk: Chunk, step_rows: list[int], real: bool, passes: tuple[dict | None, dict | None],
               sums: StepSums) -> None:
    """One forward/backward over a pass's distinct sequences, its rows' loss terms summed (a filler, real=False,
    weighs 0: DDP needs every rank at each all-reduce)."""
    tc, device, n_ranks = s.ctx.cfg.training, s.accel.device, s.accel.num_processes
    old, ref = passes
    batch = pass_batch([s.seqs[i] for i in chunk.uniq], s.pad_id, device, tc.prompt_layout)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=s.bf16):
        logp = s.policy(batch)
    weights = step_weights(s.seqs, step_rows, tc)
    inp = chunk_loss_input(s.seqs, chunk, logp, batch, tc, old, ref, weights, device)
    terms = s.obj.fn(inp, tc)
    share, tok_share = pass_shares(s.seqs, chunk, step_rows, tc.loss_norm)
    loss_share = share if weights is None else 1.0  # level weights already normalise over the step
    # x ranks: DDP averages the ranks' gradients, the step's gradient is their sum
    s.accel.backward(terms.loss * (loss_share * n_ranks if real else 0.0))
    if real:
        sums.add_terms(terms, share, tok_share, loss_share)
        if inp.old_logp is not None:
            sums.kl_old = (sums.kl_old or 0.0) + share * float(
                reduce_tokens(k3(inp.old_logp, inp.logp.detach()), inp.mask.float(), tc.loss_norm))
        sums.tokens += sum(len(s.seqs[r].completion_ids) for r in chunk.rows)
        sums.slots, sums.real = sums.slots + batch.slots, sums.real + batch.tokens
        sums.add_mismatch([s.seqs[i] for i in chunk.uniq], old)


def optimise(s: TrainSetup, passes: tuple[dict | None, dict | None], saved: dict | None = None) -> list[StepMetrics]:
    """Step 3: the optimiser loop; each rank runs its share of every step's passes
    (`pipeline.stages.parallel.rank_share`). From `saved` progress it goes on at the step after the saved one; every
    `training.save_steps` steps rank 0 saves its own (`pipeline.stages.progress`)."""
    from dataclasses import asdict

    from tqdm import tqdm

    from pipeline.stages.parallel import rank_share

    tc, accel, ctx = s.ctx.cfg.training, s.accel, s.ctx
    params = [p for p in s.policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=tc.lr, weight_decay=0.0)
    sched = _lr_scheduler(optimizer, tc, len(s.steps))
    trainable = {n: p for n, p in s.model.named_parameters() if p.requires_grad}
    metrics, start = [], 0
    if saved is not None:
        with torch.no_grad():
            for n, p in trainable.items():
                p.copy_(saved["trainable"][n])
        optimizer.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        torch.set_rng_state(saved["rng"])
        metrics, start = [StepMetrics(**m) for m in saved["metrics"]], saved["next_step"]
        log.info("round %d: training resumes at step %d of %d (saved progress)", ctx.round, start, len(s.steps))
    path = progress_path(ctx.store, ctx.run_id, ctx.round) if tc.save_steps and accel.is_main_process else None
    s.policy.train()
    for step in tqdm(range(start, len(s.steps)), desc=f"train round {ctx.round} ({s.obj.name})", unit="step",
                     initial=start, total=len(s.steps), disable=not accel.is_main_process):
        planned = s.steps[step]
        t0, lr, sums = time.perf_counter(), sched.get_last_lr()[0], StepSums()
        step_rows = planned.rows
        mine = rank_share(planned.passes, *s.shard)
        for j, (chunk, real) in enumerate(mine):
            # DDP all-reduces at each rank's last backward of the step only
            with contextlib.nullcontext() if j == len(mine) - 1 else accel.no_sync(s.policy):
                train_pass(s, chunk, step_rows, real, passes, sums)
        grad_norm = accel.clip_grad_norm_(params, tc.max_grad_norm)
        optimizer.step()
        sched.step()
        optimizer.zero_grad(set_to_none=True)
        metrics.append(_step_metrics(step, planned.epoch, lr, float(grad_norm), sums, s.accel.num_processes, t0))
        if path is not None and (step + 1) % tc.save_steps == 0 and step + 1 < len(s.steps):
            save_progress(path, {"config_hash": ctx.cfg.config_hash(), "n_steps": len(s.steps), "next_step": step + 1,
                                 "trainable": {n: p.detach().clone() for n, p in trainable.items()},
                                 "optimizer": optimizer.state_dict(), "scheduler": sched.state_dict(),
                                 "rng": torch.get_rng_state(), "metrics": [asdict(m) for m in metrics],
                                 "passes": passes})
    s.policy.eval()
    return metrics


def _step_metrics(step: int, epoch: int, lr: float, grad_norm: float, sums: StepSums, n_ranks: int,
                  t0: float) -> StepMetrics:
    from pipeline.stages.parallel import reduce_step

    t = reduce_step(sums, n_ranks, maxed=("ratio_dev",))
    return StepMetrics(step=step, epoch=epoch, loss=t.loss, pg_loss=t.pg_loss, kl=t.kl, kl_old=t.kl_old,
                       clip_frac=t.clip_frac, ratio_dev=t.ratio_dev, lr=lr, grad_norm=grad_norm, tokens=int(t.tokens),
                       padding_share=1 - t.real / t.slots if t.slots else 0.0,
                       logp_mismatch=t.mism / t.mism_n if t.mism_n else None, wall_s=time.perf_counter() - t0)


def write_outputs(s: TrainSetup, metrics: list[StepMetrics]) -> dict:
    """Step 4: rank 0 saves the adapter (whole or absent), then `train_metrics`, the `checkpoints` row and the
    manifest; every rank returns the counts once the manifest exists (the runner checks it)."""
    from dataclasses import asdict

    ctx, accel = s.ctx, s.accel
    ckpt = ctx.store.checkpoint_dir(ctx.run_id, ctx.round)
    if accel.is_main_process:
        peft_model = accel.unwrap_model(s.policy).model
        ctx.store.publish_checkpoint(lambda d: peft_model.save_pretrained(str(d)), ctx.run_id, ctx.round)
        ctx.store.write("train_metrics", [asdict(m) for m in metrics], ctx.run_id, ctx.round)
        ctx.store.write("checkpoints", [{"path": str(ckpt), "base_model": ctx.cfg.generator.model,
                                         "parent_round": ctx.round - 1 if ctx.round > 0 else None,
                                         "rows_used": len(s.seqs)}], ctx.run_id, ctx.round)
    mismatch = [m.logp_mismatch for m in metrics if m.logp_mismatch is not None]
    counts = {"objective": s.obj.name, "sequences": len(s.seqs), "generations": len({q.gen_id for q in s.seqs}),
              "steps": len(s.steps), "tokens": sum(m.tokens for m in metrics), **s.info,
              "processes": accel.num_processes, "final_loss": metrics[-1].loss if metrics else None,
              "logp_mismatch": float(np.mean(mismatch)) if mismatch else None, "checkpoint": str(ckpt)}
    if accel.is_main_process:
        ctx.finish("train", **counts)
        clear_progress(progress_path(ctx.store, ctx.run_id, ctx.round))
    accel.wait_for_everyone()
    return counts


def run_train(ctx) -> dict:
    """Train the round's adapter with `training.objective` on its curated rows and write the round's checkpoint.
    Under `accelerate launch --num_processes N` it trains data-parallel (`pipeline.stages.parallel`): the same global
    steps, each step's passes dealt to the ranks, gradients all-reduced; rank 0 writes."""
    from pipeline.stages.parallel import make_accelerator

    obj = _check_objective(ctx)
    setup = load_stage(ctx, obj, make_accelerator())
    # the hash of the config this invocation trains with (--set included): progress of another one is not resumed
    saved = load_progress(progress_path(ctx.store, ctx.run_id, ctx.round), ctx.cfg.config_hash(), len(setup.steps))
    passes = saved["passes"] if saved is not None else reference_passes(setup)
    return write_outputs(setup, optimise(setup, passes, saved))
