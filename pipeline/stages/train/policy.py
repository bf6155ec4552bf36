"""The policy the round trains: the base model with the adapter that sampled the round (π_old), trainable."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from peft import PeftModel

    from pipeline.run import RunContext


def start_adapter(ctx: RunContext) -> Path | str | None:
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


def load_policy(ctx: RunContext, device: torch.device | str) -> PeftModel:
    """Base model (fp32) + the starting adapter (`start_adapter`), trainable; a fresh LoRA without one."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from pipeline.engines.models import load_causal_lm
    from pipeline.store import adapter_complete

    train_cfg = ctx.cfg.training
    base = load_causal_lm(ctx.cfg.generator.model, dtype="float32", device=device)
    start = start_adapter(ctx)
    if start is None:
        lora = LoraConfig(task_type="CAUSAL_LM", r=train_cfg.lora_r, lora_alpha=train_cfg.lora_alpha,
                          lora_dropout=train_cfg.lora_dropout, target_modules=list(train_cfg.target_modules))
        return get_peft_model(base, lora)
    if not adapter_complete(start):
        hint = (f"run `pipeline train --run-id {ctx.run_id} --round {ctx.round - 1}` first" if ctx.round > 0
                else "generator.adapter must name a saved peft adapter")
        raise RuntimeError(f"round {ctx.round} trains from the adapter {start}, which is missing or incomplete: {hint}")
    # the adapter's own rank and alpha, this run's dropout: a checkpoint saved with dropout > 0 would otherwise
    # make π_θ (train mode) differ from π_old (eval mode) before the first update
    lora = LoraConfig.from_pretrained(str(start))
    lora.lora_dropout = train_cfg.lora_dropout
    return PeftModel.from_pretrained(base, str(start), is_trainable=True, config=lora)


def frozen_linears_bf16(model: torch.nn.Module) -> int:
    """Store the frozen linear weights (and biases) in bf16 for a bf16-autocast policy; returns how many modules.
    Autocast caches its bf16 copy only of leaf tensors that require grad, so it casts every frozen fp32 weight again
    at every call (a step calls each layer twice: prompt, then completions), and the product it computes is that
    of the bf16-rounded weight anyway: the log-probs and gradients do not change (tests/test_shared_prompt.py), the
    casts go and the frozen weights take half the memory. Tied input embeddings stay fp32 (they start the residual
    stream, which autocast keeps in fp32)."""
    emb = model.get_input_embeddings().weight
    converted = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad and m.weight is not emb:
            for t in (m.weight, m.bias):
                if t is not None and not t.requires_grad:
                    t.data = t.data.to(torch.bfloat16)
            converted += 1
    return converted
