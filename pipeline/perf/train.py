"""`pipeline bench train`: tokens/s of one training step (forward, ioGRPO-mKL loss, backward) against
TRL's GRPO loss + backward (`GRPOTrainer.compute_loss`, loss_type="grpo") on the same LoRA model and
the same batch, in the same process. Also checks the two losses agree (mask off, sequence norm):
same formula, two implementations. On a GPU it runs under bf16 autocast and prints MFU.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

from pipeline.train import TrainSequence, collate, completion_logprobs, grpo_mkl_terms

MODEL = "embedded:smollm2-135m-instruct"
BATCH, REPS, BETA, EPS = 8, 3, 0.1, 0.2
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 tensor-core peaks


def _batch(tok, device: str, completion_len: int) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(BATCH):
        prompt = tok.apply_chat_template([{"role": "user", "content": f"Write workflow {i} that solves the task."}],
                                         add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        n = completion_len - 16 * (i % 4)  # ragged completions, as in real rounds
        comp = torch.randint(100, tok.vocab_size, (n,), generator=g).tolist()
        seqs.append(TrainSequence(f"s{i}", list(prompt), comp, 1.0 if i % 2 else -1.0, None))
    return seqs


def _timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _trl_trainer(model, tok, out_dir: str, bf16: bool):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=BATCH, num_generations=BATCH, beta=BETA,
                      epsilon=EPS, loss_type="grpo", report_to="none", bf16=bf16, use_cpu=not bf16,
                      logging_steps=1, max_completion_length=256)
    ds = Dataset.from_dict({"prompt": ["x"] * BATCH})
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=ds, processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1  # normally set inside Trainer's loop; one step, no accumulation
    return trainer


def _trl_inputs(seqs: list[TrainSequence], old: torch.Tensor, pad_id: int, device: str) -> dict:
    """TRL's layout: left-padded prompts, right-padded completions, [B, Tc] old/ref logprobs."""
    p = max(len(s.prompt_ids) for s in seqs)
    c = max(len(s.completion_ids) for s in seqs)
    pid = torch.full((len(seqs), p), pad_id)
    pm = torch.zeros((len(seqs), p), dtype=torch.long)
    cid = torch.full((len(seqs), c), pad_id)
    cm = torch.zeros((len(seqs), c), dtype=torch.long)
    for b, s in enumerate(seqs):
        pid[b, p - len(s.prompt_ids):] = torch.tensor(s.prompt_ids)
        pm[b, p - len(s.prompt_ids):] = 1
        cid[b, : len(s.completion_ids)] = torch.tensor(s.completion_ids)
        cm[b, : len(s.completion_ids)] = 1
    adv = torch.tensor([s.advantage for s in seqs])
    return {k: v.to(device) for k, v in dict(prompt_ids=pid, prompt_mask=pm, completion_ids=cid, completion_mask=cm,
                                             advantages=adv, old_per_token_logps=old,
                                             ref_per_token_logps=old).items()}


def main(completion_len: int | None = None) -> None:
    from peft import LoraConfig, get_peft_model

    from pipeline.config import TrainingConfig
    from pipeline.models import load_causal_lm, load_tokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = device == "cuda"
    completion_len = completion_len or (512 if bf16 else 128)  # CPU: keep the bench to about a minute
    tc = TrainingConfig()
    tok = load_tokenizer(MODEL)
    base = load_causal_lm(MODEL, dtype="float32", device=device)
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=tc.lora_r, lora_alpha=tc.lora_alpha,
                                            lora_dropout=0.0, target_modules=list(tc.target_modules)))
    seqs = _batch(tok, device, completion_len)
    batch = collate(seqs, tok.pad_token_id, device)
    with torch.no_grad():
        old = completion_logprobs(model, batch).detach()
    # perturb π_old so ratios differ from 1 and clipping / KL are exercised
    old = (old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1)).to(device)) * \
        batch.completion_mask
    n_tok = int(batch.completion_mask.sum())
    all_tok = int(batch.attention_mask.sum())
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16)
    model.train()

    ours_loss = []

    def ours():
        model.zero_grad(set_to_none=True)
        with autocast:
            logp = completion_logprobs(model, batch)
        terms = grpo_mkl_terms(logp.float(), old, old, batch.advantages, batch.completion_mask, BETA, EPS,
                               kl_mask=False)
        terms.loss.backward()
        ours_loss.append(float(terms.loss.detach()))

    with tempfile.TemporaryDirectory() as out_dir:
        trainer = _trl_trainer(model, tok, out_dir, bf16)
        trl_model = trainer.model
        inputs = _trl_inputs(seqs, old, tok.pad_token_id, device)
        trl_loss = []

        def trl():
            trl_model.zero_grad(set_to_none=True)
            loss = trainer.compute_loss(trl_model, inputs)
            loss.backward()
            trl_loss.append(float(loss.detach()))

        trl_model.train()
        times = {"ours": [], "trl": []}
        for r in range(REPS + 1):  # first round is warm-up; alternate so drift hits both equally
            for name, fn in (("ours", ours), ("trl", trl)):
                dt = _timed(fn, device)
                if r:
                    times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"device {device}{' (bf16 autocast)' if bf16 else ' (fp32)'}; batch {BATCH} sequences, "
          f"{n_tok} completion tokens ({all_tok} with prompts); median of {REPS} steps")
    for k in ("ours", "trl"):
        print(f"  {k:5s} {med[k] * 1e3:8.1f} ms/step  {n_tok / med[k]:9.0f} completion tokens/s")
    print(f"  ratio ours/TRL tokens/s: {med['trl'] / med['ours']:.2f}x  (goal >= 1.0x)")
    print(f"  loss: ours {ours_loss[-1]:.6f} vs TRL {trl_loss[-1]:.6f} (same formula with kl_mask off)")
    if device == "cuda":
        params = sum(p.numel() for p in base.parameters())
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
        flops = 6 * params * all_tok  # forward + backward, dense approximation
        for k in ("ours", "trl"):
            mfu = f"{flops / med[k] / peak:.1%}" if peak else "n/a (unknown peak)"
            print(f"  {k:5s} MFU {mfu} of {name} bf16 peak (6·N·tokens, N={params / 1e6:.0f}M)")


if __name__ == "__main__":
    main()
