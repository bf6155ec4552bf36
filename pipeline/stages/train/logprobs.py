"""Completion log-probs of a pass: with gradients for π_θ (`completion_logprobs`), without for π_old and the
reference (`reference_logprobs`). The LM head runs only at the completion positions, never on [B, T, V] logits.
Imports torch alone (`pipeline bench train` runs on a bare GPU machine)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from pipeline.core.packing import Pass
from pipeline.stages.train.batch import Batch, PackedBatch, pass_batch
from pipeline.stages.train.data import TrainSequence
from pipeline.stages.train.kvcache import cache_under_checkpointing, prompt_states


def _split_causal_lm(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(decoder, lm_head) of an HF causal LM, unwrapping PEFT (LoRA layers are injected in place)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, base.base_model_prefix), base.get_output_embeddings()


def _head_logprobs(head: torch.nn.Module, h: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    logits = head(h)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 up to fp32; fp64 stays fp64
    return logits.gather(1, tgt[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


def _gathered_logprobs(head: torch.nn.Module, hidden: torch.Tensor, tgt: torch.Tensor, head_chunk: int) -> torch.Tensor:
    """Log-probs of `tgt` from the hidden states `hidden` [N, H]: above `head_chunk` positions in checkpointed chunks of
    that many positions, so at most [head_chunk, V] logits live at once."""
    from torch.utils.checkpoint import checkpoint

    if hidden.shape[0] <= head_chunk:
        return _head_logprobs(head, hidden, tgt)
    run = (lambda *a: checkpoint(_head_logprobs, *a, use_reentrant=False)) if torch.is_grad_enabled() else \
        _head_logprobs
    return torch.cat([run(head, hidden[i: i + head_chunk], tgt[i: i + head_chunk])
                      for i in range(0, hidden.shape[0], head_chunk)])


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
        cache = prompt_states(decoder, batch)
        mask = batch.completion_mask.long()
        if cache is not None:
            mask = torch.cat([batch.context_mask(), mask], dim=1)
        with cache_under_checkpointing(decoder):
            hidden = decoder(input_ids=batch.input_ids, attention_mask=mask, position_ids=batch.position_ids,
                             past_key_values=cache, use_cache=False).last_hidden_state
        dst = batch.src  # the completion grid is the output grid
    logp = _gathered_logprobs(head, hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.src), batch.tgt,
                              head_chunk)
    b, width = batch.completion_mask.shape
    return logp.new_zeros(b * width).scatter(0, dst, logp).view(b, width)


def _pass_logprobs(model: torch.nn.Module, seqs: list[TrainSequence], pass_: Pass, pad_id: int,
                   device: torch.device | str, bf16: bool, disable_adapter: bool,
                   layout: str, min_prefix: int) -> dict[str, torch.Tensor]:
    uniq = [seqs[i] for i in pass_.uniq]
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=bf16), \
            model.disable_adapter() if disable_adapter else contextlib.nullcontext():
        lp = completion_logprobs(model, pass_batch(uniq, pad_id, device, layout, min_prefix)).float()
    return {s.gen_id: lp[b, : len(s.completion_ids)].cpu() for b, s in enumerate(uniq)}


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, seqs: list[TrainSequence], passes: list[Pass], pad_id: int,
                       device: torch.device | str, disable_adapter: bool = False, desc: str = "old logprobs",
                       bf16: bool = False, shard: tuple[int, int] = (0, 1),
                       layout: str = "split", relay: Path | None = None,
                       min_prefix: int = 0) -> dict[str, torch.Tensor]:
    """Per gen_id, completion log-probs (fp32 values) of `model` in eval mode (no dropout) computed on `passes`
    (`pipeline.core.packing.logprob_passes`), under the same bf16 autocast as the training forward when `bf16`: π_old
    and π_θ are then the same computation at the first step (ratio 1, k3 0 before any update), and the pass costs
    half the fp32 time on CPU. A sequence in several passes takes the first pass's value.
    `shard=(rank, n)`: this rank computes passes[rank::n] (its share of the first step is exactly the passes it
    trains, `pipeline.stages.parallel.rank_share`) and the ranks' results are gathered. Rank 0 shows its progress
    (pipeline.engines.meter; `relay`: the stage call's relay file). `layout` and `min_prefix` lay passes out as
    training does (training.prompt_layout, training.shared_prefix_min)."""
    from pipeline.engines.meter import ProgressMeter
    from pipeline.stages.parallel import gather_logprobs

    rank, n_ranks = shard
    was_training = model.training
    model.eval()
    computed: dict[int, dict[str, torch.Tensor]] = {}
    mine = range(rank, len(passes), n_ranks)
    meter = ProgressMeter(len(mine), desc, "pass", relay=relay) if rank == 0 else None
    try:
        for pass_index in mine:
            computed[pass_index] = _pass_logprobs(model, seqs, passes[pass_index], pad_id, device, bf16,
                                                  disable_adapter, layout, min_prefix)
            if meter is not None:
                meter.update()
    finally:
        model.train(was_training)
        if meter is not None:
            meter.close()
    computed = gather_logprobs(computed, n_ranks)
    by_gen: dict[str, torch.Tensor] = {}
    for pass_index in sorted(computed):
        for gen, lp in computed[pass_index].items():
            by_gen.setdefault(gen, lp)
    return by_gen
