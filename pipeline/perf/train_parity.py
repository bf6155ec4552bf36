"""`pipeline bench train-parity`: the train step on each device and precision against the CPU's fp32, on one
random-weight model of the generator's architecture (`--arch`, default Qwen2.5-0.5B's shape), one LoRA init and one
batch. A bf16 side runs as `pipeline train` runs where bf16 is native: frozen linear weights stored in bf16
(`frozen_linears_bf16`), bf16 autocast, LoRA weights and the loss in fp32.

Each side computes its own π_old (as the stage does), then `steps` AdamW steps of the ioGRPO-mKL loss (reference =
π_old, advantage-masked KL) and the log-probs after them. Against the first side it reports the start log-probs'
difference, each step's loss, the first gradient's cosine and norm ratio, and the update's effect: the change of
every completion token's log-prob, as a cosine with the reference side's change and as the mean change of the
positive- and negative-advantage sequences (the direction the step should push them). Timings are per side, wall
clock after a synchronise; a side's first step includes its warm-up.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.core.grpo import grpo_mkl_terms
from pipeline.perf.train import build_arch, default_lora, id_batch, timed
from pipeline.stages.train.batch import collate
from pipeline.stages.train.logprobs import completion_logprobs
from pipeline.stages.train.policy import frozen_linears_bf16

BETA, EPS = 0.04, 0.2  # the configs' beta; the paper's clip


@dataclass(frozen=True)
class Side:
    device: str  # cpu, cuda
    precision: str  # fp32, bf16

    @property
    def name(self) -> str:
        return f"{self.device}:{self.precision}"


def parse_sides(text: str) -> list[Side]:
    sides = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        device, _, precision = part.partition(":")
        if device not in ("cpu", "cuda") or precision not in ("fp32", "bf16"):
            raise ValueError(f"a side is device:precision with device cpu or cuda and precision fp32 or bf16, "
                             f"not {part!r}")
        sides.append(Side(device, precision))
    if not sides:
        raise ValueError("no sides given")
    if len({s.name for s in sides}) < len(sides):
        raise ValueError(f"a side is given twice in {text!r}: a side on one device is deterministic")
    return sides


def run_side(model: torch.nn.Module, seqs: list, side: Side, steps: int, learning_rate: float) -> dict:
    """π_old, `steps` optimiser steps, the log-probs after them; everything returned on the CPU."""
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on CUDA too
    side_model = copy.deepcopy(model).to(side.device)
    bf16 = side.precision == "bf16"
    if bf16:
        frozen_linears_bf16(side_model)
    collated = collate(seqs, 0, side.device)
    autocast = torch.autocast(device_type=side.device, dtype=torch.bfloat16, enabled=bf16)
    with torch.no_grad(), autocast:
        old = completion_logprobs(side_model, collated).float()
    params = [p for p in side_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
    out: dict = {"logp0": old.cpu(), "loss": [], "grad_norm": [], "step_s": []}

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with autocast:
            logp = completion_logprobs(side_model, collated)
        terms = grpo_mkl_terms(logp.float(), old, old, collated.advantages, collated.completion_mask, BETA, EPS,
                               kl_mask=True)
        terms.loss.backward()
        if "grad0" not in out:
            out["grad0"] = torch.cat([p.grad.detach().float().flatten().cpu() for p in params])
        out["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
        opt.step()
        out["loss"].append(float(terms.loss.detach()))

    side_model.train()
    for _ in range(steps):
        out["step_s"].append(timed(step, side.device))
    side_model.eval()
    with torch.no_grad(), autocast:
        out["logp1"] = completion_logprobs(side_model, collated).float().cpu()
    out["mask"], out["adv"] = collated.completion_mask.cpu().bool(), collated.advantages.cpu()
    return out


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


def compare(ref: dict, other: dict) -> dict:
    """`other` against `ref` (the same batch: the same mask)."""
    mask = ref["mask"]
    d0 = (other["logp0"] - ref["logp0"])[mask].abs()
    delta_ref, delta = (ref["logp1"] - ref["logp0"])[mask], (other["logp1"] - other["logp0"])[mask]
    return {"logp0_max_abs_diff": float(d0.max()), "logp0_mean_abs_diff": float(d0.mean()),
            "loss_abs_diff": [abs(a - b) for a, b in zip(other["loss"], ref["loss"], strict=True)],
            "grad0_cosine": _cos(other["grad0"], ref["grad0"]),
            "grad0_norm_ratio": float(other["grad0"].norm() / ref["grad0"].norm()),
            "update_cosine": _cos(delta, delta_ref),
            "update_mean_ratio": float(delta.abs().mean() / delta_ref.abs().mean())}


def update_direction(side: dict) -> dict:
    """Mean change of a completion token's log-prob over the positive- and the negative-advantage sequences."""
    delta = (side["logp1"] - side["logp0"]) * side["mask"]
    per_seq = delta.sum(1) / side["mask"].sum(1)
    return {"positive": float(per_seq[side["adv"] > 0].mean()), "negative": float(per_seq[side["adv"] < 0].mean())}


def run(arch: str = "qwen2-0.5b", sides: list[Side] | None = None, batch: int = 8, prompt_len: int = 128,
        completion_len: int = 128, steps: int = 3, lr: float = 1e-4, json_path: str | Path | None = None,
        echo=print) -> dict:
    sides = sides or parse_sides("cpu:fp32,cuda:fp32,cuda:bf16")
    if any(s.device == "cuda" for s in sides) and not torch.cuda.is_available():
        raise ValueError("a cuda side needs a CUDA device; on this machine give e.g. --sides cpu:fp32,cpu:bf16")
    began = time.perf_counter()
    base = build_arch(arch)
    torch.manual_seed(1)  # the LoRA init, the same for every side (each side copies this model)
    model = default_lora(base)
    rng = torch.Generator().manual_seed(2)
    with torch.no_grad():  # LoRA's B starts at zero; a random B makes the adapter (and its gradient to A) count
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.02 * torch.randn(p.shape, generator=rng))
    seqs = id_batch(base.config.vocab_size, batch, prompt_len, completion_len, group_size=max(1, batch // 2))
    echo(f"{arch}: {sum(p.numel() for p in base.parameters()) / 1e6:.0f}M params, batch {batch} x (prompt "
         f"{prompt_len} + completions up to {completion_len}), {steps} AdamW steps at lr {lr} "
         f"(built in {time.perf_counter() - began:.0f} s)")
    results = {}
    for side in sides:
        results[side.name] = run_side(model, seqs, side, steps, lr)
        r = results[side.name]
        echo(f"  {side.name}: loss {' '.join(f'{x:.6f}' for x in r['loss'])}; step s "
             f"{' '.join(f'{x:.3f}' for x in r['step_s'])}; update {update_direction(r)}")
    first = sides[0].name
    report = {"arch": arch, "batch": batch, "prompt_len": prompt_len, "completion_len": completion_len,
              "steps": steps, "lr": lr, "reference_side": first,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "sides": {k: {"loss": v["loss"], "grad_norm": v["grad_norm"], "step_s": v["step_s"],
                            "update_direction": update_direction(v)} for k, v in results.items()},
              "against_reference": {k: compare(results[first], v) for k, v in results.items() if k != first}}
    for k, c in report["against_reference"].items():
        echo(f"  {k} vs {first}: start log-prob |diff| max {c['logp0_max_abs_diff']:.2e} mean "
             f"{c['logp0_mean_abs_diff']:.2e}; grad cosine {c['grad0_cosine']:.6f} (norm x{c['grad0_norm_ratio']:.4f});"
             f" update cosine {c['update_cosine']:.4f} (size x{c['update_mean_ratio']:.3f})")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=1) + "\n")
        echo(f"  wrote {json_path}")
    return report
