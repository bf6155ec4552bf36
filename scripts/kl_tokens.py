"""Which tokens carry a round's KL? Per-token log-probs of round K's training sequences under round K's reference
(round K-1's checkpoint, which sampled them) and under round K's checkpoint, the tokens with the largest k3, and
both estimates per sequence: the loss's k3(π_θ, π_ref) and KL(π_ref‖π_θ) on the reference's samples.

    python scripts/kl_tokens.py --store data/runs --run-id he-learn-lr1e-4-s0 --round 1 --limit 8

(docs/learning-log.md: one decision token pushed from log p -1.4 to -31 makes the loss's k3 read 8e12.)
"""

from __future__ import annotations

import argparse

import torch
from peft import PeftModel

from pipeline.core.grpo import k3
from pipeline.engines.models import load_causal_lm, load_tokenizer
from pipeline.run import open_run
from pipeline.stages.train.batch import collate
from pipeline.stages.train.data import load_sequences
from pipeline.stages.train.logprobs import completion_logprobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--round", type=int, required=True, help="a trained round >= 1 (its reference is a checkpoint)")
    ap.add_argument("--limit", type=int, default=8, help="sequences, the negative-advantage ones first")
    a = ap.parse_args()
    if a.round < 1:
        ap.error("--round must be >= 1: round 0's reference is the base model, not a checkpoint")
    ctx = open_run(None, a.run_id, a.round, [], a.store)
    seqs = list({s.gen_id: s for s in load_sequences(ctx)[0]}.values())
    pick = sorted(seqs, key=lambda s: s.advantage)[: a.limit]
    tok = load_tokenizer(ctx.cfg.generator.model)
    lp: dict[tuple[int, str], torch.Tensor] = {}
    for r in (a.round - 1, a.round):
        model = PeftModel.from_pretrained(load_causal_lm(ctx.cfg.generator.model, dtype="float32", device="cpu"),
                                          str(ctx.store.checkpoint_dir(a.run_id, r))).eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=ctx.cfg.training.bf16):
            for s in pick:
                lp[(r, s.gen_id)] = completion_logprobs(model, collate([s], tok.pad_token_id or 0))[0].float()
    for s in pick:
        ref, new = lp[(a.round - 1, s.gen_id)], lp[(a.round, s.gen_id)]
        loss_k3, sampled_kl = k3(new, ref), k3(ref, new)
        i = int(torch.argmax(loss_k3))
        print(f"{s.gen_id} A={s.advantage:+.2f} tokens={len(s.completion_ids)}: "
              f"loss k3 mean {float(loss_k3.mean()):.4g}, "
              f"KL(ref||new) on the samples {float(sampled_kl.mean()):.4f}; top token {i} "
              f"{tok.decode([s.completion_ids[i]])!r} after {tok.decode(s.completion_ids[max(0, i - 8): i])!r}: "
              f"log p {float(ref[i]):.2f} -> {float(new[i]):.2f}")


if __name__ == "__main__":
    main()
