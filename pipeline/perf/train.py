"""`pipeline bench train`: tokens/s of one training step (forward, ioGRPO-mKL loss, backward) against
TRL's GRPO loss + backward (`GRPOTrainer.compute_loss`, loss_type="grpo") on the same LoRA model and
the same batch, in the same process. Also checks the two losses agree (mask off, sequence norm):
same formula, two implementations. On a GPU it runs under bf16 autocast and prints MFU and peak memory.

The model is the embedded 135M one by default, or `--arch NAME`: a built-in architecture (ARCHS) made from its
config with seeded random weights, so no weights travel (a bare GPU machine can run a 1.5B-class step). Its batch
needs no tokenizer: random prompt ids of a fixed length plus ragged random completions; TRL gets a 3-token
in-memory tokenizer for its pad/eos ids.

MFU counts model FLOPs, the same for both implementations (recomputation under checkpointing is not counted):
6 per matmul parameter per token (forward 2 + backward 4, PaLM's model FLOPs), the LM head only at the completion
positions that are scored, embedding lookups none. With LoRA the frozen weights get no weight gradient, so the work a
step needs is nearer 4 per parameter per token: printed too ("4N"). PaLM's attention term, 12·L·d·T per token of a
T-token sequence (non-causal count), is printed as a third figure.

Utilisation: each side's achieved FLOP/s over the work it computes (`lora_step_flops`: 4 per frozen matmul parameter
per token, 6 per LoRA parameter per token; ours computes each shared prompt once, TRL every sequence's), against
the device's rate: on CPU the probe's matrix product of `pipeline bench dtype` in the step's weights dtype, measured
here on the step's threads; on a GPU its dense bf16 peak.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from pipeline.core.grpo import grpo_mkl_terms
from pipeline.stages.train.batch import collate, pass_batch
from pipeline.stages.train.data import TrainSequence
from pipeline.stages.train.logprobs import completion_logprobs

MODEL = "embedded:smollm2-135m-instruct"
BATCH, REPS, BETA, EPS, PROMPT_LEN = 8, 3, 0.1, 0.2, 256
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 tensor-core peaks
TRL_VERSION = "1.16.0"  # the version the project's venv has; what a GPU machine without TRL should carry

# `transformers.AutoConfig.for_model(model_type, **kwargs)`. qwen2-1.5b: Qwen2.5-1.5B's published shape.
ARCHS: dict[str, tuple[str, dict]] = {
    "qwen2-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                                 max_position_embeddings=32768, rms_norm_eps=1e-6, use_sliding_window=False)),
    # the generator's architecture as the embedded Qwen2.5-Coder-0.5B-Instruct is stored (its config.json: untied
    # LM head, 630M parameters)
    "qwen2-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=False, rope_theta=1e6,
                                 max_position_embeddings=32768, rms_norm_eps=1e-6, use_sliding_window=False)),
    "tiny": ("qwen2", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True, rope_theta=1e6,
                           max_position_embeddings=4096)),
}


def arch_config(name: str):
    from transformers import AutoConfig

    if name not in ARCHS:
        raise ValueError(f"unknown --arch {name!r}; built-in: {', '.join(ARCHS)}")
    model_type, kw = ARCHS[name]
    return AutoConfig.for_model(model_type, **kw)


def build_arch(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    """The architecture `name` with seeded random weights (`from_config`), built directly on `device`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(arch_config(name), dtype=dtype)


def default_lora(base):
    """`base` with a fresh LoRA of the training config's defaults (rank, alpha, target modules; no dropout), as a round
    0 policy starts."""
    from peft import LoraConfig, get_peft_model

    from pipeline.config import TrainingConfig

    tc = TrainingConfig()
    return get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=tc.lora_r, lora_alpha=tc.lora_alpha,
                                           lora_dropout=0.0, target_modules=list(tc.target_modules)))


def matmul_params(model) -> tuple[int, int]:
    """(N, head): N = parameters that are matmul weights per token, i.e. all but the input embedding (a tied
    embedding counts once, as the LM head); head = the LM head's V·d."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())  # parameters() lists a tied weight once
    return (total if emb is head else total - emb.numel()), head.numel()


def tiny_tokenizer():
    """A 3-token in-memory tokenizer: TRL's trainer wants pad/eos ids; the batch itself is made of ids."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _ragged(i: int, completion_len: int) -> int:
    return max(1, completion_len - 16 * (i % 4))  # ragged completions, as in real rounds


def _batch(tok, batch: int, completion_len: int, group_size: int) -> list[TrainSequence]:
    """Chat-template prompts, one per group of `group_size` consecutive sequences (a GRPO group shares its prompt)."""
    rng = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(batch):
        prompt = tok.apply_chat_template([{"role": "user", "content": f"Write workflow {i // group_size} that solves "
                                           "the task."}], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]
        comp = torch.randint(100, tok.vocab_size, (_ragged(i, completion_len),), generator=rng).tolist()
        seqs.append(TrainSequence(f"s{i}", list(prompt), comp, 1.0 if i % 2 else -1.0, None))
    return seqs


def id_batch(vocab: int, batch: int, prompt_len: int, completion_len: int, group_size: int = 1) -> list[TrainSequence]:
    """Tokenizer-free: random prompt ids of a fixed length, one prompt per group of `group_size` consecutive
    sequences, ragged random completions (ids 3.. : not pad/eos)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(-(-batch // group_size))]
    return [TrainSequence(f"s{i}", prompts[i // group_size],
                          torch.randint(3, vocab, (_ragged(i, completion_len),), generator=g).tolist(),
                          1.0 if i % 2 else -1.0, None) for i in range(batch)]


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


class TrlMissing(RuntimeError):
    pass


def _import_trl():
    try:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise TrlMissing(
            f"the TRL baseline needs `trl` (and `datasets`), which do not import here: {e}. Carry the wheels: on a "
            f"machine with PyPI, `pip download --no-deps -d .whl trl=={TRL_VERSION} datasets dill multiprocess` "
            "(docs/scale-out.md, GPU numbers: the full list and flags, ~5 MB), then here `pip install --no-deps "
            "--target /tmp/site .whl/*.whl` and `export PYTHONPATH=/tmp/site:$PYTHONPATH`") from e
    return Dataset, GRPOConfig, GRPOTrainer


def _trl_trainer(model, tok, out_dir: str, bf16: bool, batch: int, gradient_checkpointing: bool):
    Dataset, GRPOConfig, GRPOTrainer = _import_trl()
    # gradient_checkpointing mirrors ours: TRL's default (True) would add an input-grad hook to the shared model
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=batch, num_generations=batch, beta=BETA,
                      epsilon=EPS, loss_type="grpo", report_to="none", bf16=bf16, use_cpu=not bf16,
                      logging_steps=1, max_completion_length=256, gradient_checkpointing=gradient_checkpointing)
    ds = Dataset.from_dict({"prompt": ["x"] * batch})
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=ds, processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1  # normally set inside Trainer's loop; one step, no accumulation
    return trainer


def _trl_inputs(seqs: list[TrainSequence], old: torch.Tensor, pad_id: int, device: str) -> dict:
    """TRL's layout: left-padded prompts, right-padded completions, [B, Tc] old/ref logprobs."""
    prompt_len = max(len(s.prompt_ids) for s in seqs)
    completion_len = max(len(s.completion_ids) for s in seqs)
    prompt_ids = torch.full((len(seqs), prompt_len), pad_id)
    prompt_mask = torch.zeros((len(seqs), prompt_len), dtype=torch.long)
    completion_ids = torch.full((len(seqs), completion_len), pad_id)
    completion_mask = torch.zeros((len(seqs), completion_len), dtype=torch.long)
    for b, s in enumerate(seqs):
        prompt_ids[b, prompt_len - len(s.prompt_ids):] = torch.tensor(s.prompt_ids)
        prompt_mask[b, prompt_len - len(s.prompt_ids):] = 1
        completion_ids[b, : len(s.completion_ids)] = torch.tensor(s.completion_ids)
        completion_mask[b, : len(s.completion_ids)] = 1
    advantages = torch.tensor([s.advantage for s in seqs])
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=advantages, old_per_token_logps=old,
                  ref_per_token_logps=old)
    return {k: v.to(device) for k, v in inputs.items()}


@dataclass
class FlopCount:
    """Model FLOPs of one step (see the module docstring)."""

    n: int  # matmul parameters (LM head included once)
    head: int  # of which the LM head, V·d
    layers: int
    hidden: int

    def per_step(self, lengths: list[int], completion_tokens: int, per_param: int = 6, attention: bool = False):
        tokens = sum(lengths)
        f = per_param * ((self.n - self.head) * tokens + self.head * completion_tokens)
        if attention:
            f += sum(12 * self.layers * self.hidden * t * t for t in lengths)
        return f


def lora_step_flops(matmul: int, head: int, lora: int, tokens: int, scored: int) -> int:
    """Matmul FLOPs of one forward + backward of a LoRA step over a frozen base:

        F = 4·(N − head)·T + 4·head·S + 6·L·T

    N = `matmul` parameters (`matmul_params`: the LM head, V·d, counted once), T = `tokens` positions computed,
    S = `scored` positions whose logits are scored (the LM head runs there only), L = `lora` parameters. A frozen
    weight costs 2 per token forward and 2 backward (the gradient of its input, which the adapters below need), and no
    weight gradient; an adapter x·A·B costs 2 forward, 2 for its input's gradient and 2 for its own. Not counted:
    attention's score products (they hold no parameters), norms, activations, the embedding lookup; counted but not
    needed: the first layer's input gradient (about 1/layers of the frozen backward)."""
    return 4 * (matmul - head) * tokens + 4 * head * scored + 6 * lora * tokens


def _versions() -> dict:
    out = {}
    for d in ("torch", "transformers", "peft", "trl", "accelerate"):
        try:
            out[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            out[d] = None
    return out


def run(arch: str | None = None, batch: int = BATCH, completion_len: int | None = None, reps: int = REPS,
        prompt_len: int | None = None, gradient_checkpointing: bool = False, weights_dtype: str = "float32",
        json_path: str | Path | None = None, echo=print, group_size: int | None = None,
        prompt_layout: str = "split", compile_decoder: bool = False) -> dict:
    """Measure, print, and return (and write to `json_path`) the result dict. `group_size` consecutive sequences
    share a prompt (default: the whole batch is one GRPO group, as TRL's num_generations here); `prompt_len`: random
    prompt ids of that length (default: chat-template prompts on the embedded model, 256 ids with `arch`)."""
    _import_trl()  # fail before minutes of model building when TRL is absent
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = device == "cuda"
    completion_len = completion_len or (512 if bf16 else 128)  # CPU: keep the bench to about a minute
    if prompt_layout not in ("split", "packed"):
        raise ValueError(f"--prompt-layout must be split or packed, not {prompt_layout!r}")
    if weights_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--weights-dtype must be float32 or bfloat16, not {weights_dtype!r}")
    group_size = group_size or batch
    if arch is None:
        from pipeline.engines.models import load_causal_lm, load_tokenizer

        tok = load_tokenizer(MODEL)
        base = load_causal_lm(MODEL, dtype=weights_dtype, device=device)
        model_name = MODEL
    else:
        base = build_arch(arch, getattr(torch, weights_dtype), device)
        tok = tiny_tokenizer()
        model_name, prompt_len = arch, prompt_len or PROMPT_LEN
    if prompt_len is None:
        seqs = _batch(tok, batch, completion_len, group_size)
        batch_kind = f"chat-template prompts, one per {group_size} sequences + random completions"
    else:
        seqs = id_batch(base.config.vocab_size, batch, prompt_len, completion_len, group_size)
        batch_kind = f"random prompt ids x{prompt_len}, one per {group_size} sequences + random completions"
    matmul_weights, head = matmul_params(base)
    frozen = sum(p.numel() for p in base.parameters())
    if gradient_checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = default_lora(base)
    if compile_decoder:  # torch.compile the decoder both sides call (TRL through the model's forward)
        inner = model.get_base_model()
        setattr(inner, inner.base_model_prefix, torch.compile(getattr(inner, inner.base_model_prefix)))
    pad_id = tok.pad_token_id or 0
    # training.prompt_layout: split (two decoder calls) or packed
    collated = pass_batch(seqs, pad_id, device, prompt_layout)
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16)
    with torch.no_grad(), autocast:
        old = completion_logprobs(model, collated).float().detach()
    # perturb π_old so ratios differ from 1 and clipping / KL are exercised
    old = (old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1)).to(device)) * \
        collated.completion_mask
    n_tok = int(collated.completion_mask.sum())
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in seqs]
    model.train()

    ours_loss = []

    def ours():
        model.zero_grad(set_to_none=True)
        with autocast:
            logp = completion_logprobs(model, collated)
        terms = grpo_mkl_terms(logp.float(), old, old, collated.advantages, collated.completion_mask, BETA, EPS,
                               kl_mask=False)
        terms.loss.backward()
        ours_loss.append(float(terms.loss.detach()))

    with tempfile.TemporaryDirectory() as out_dir:
        trainer = _trl_trainer(model, tok, out_dir, bf16, batch, gradient_checkpointing)
        trl_model = trainer.model
        inputs = _trl_inputs(seqs, old, pad_id, device)
        trl_loss = []

        def trl():
            trl_model.zero_grad(set_to_none=True)
            loss = trainer.compute_loss(trl_model, inputs)
            loss.backward()
            trl_loss.append(float(loss.detach()))

        trl_model.train()
        times = {"ours": [], "trl": []}
        peak = {"ours": 0, "trl": 0}
        for rep in range(reps + 1):  # first round is warm-up; alternate so drift hits both equally
            for name, fn in (("ours", ours), ("trl", trl)):
                if device == "cuda":
                    model.zero_grad(set_to_none=True)  # the other side's grads are not this side's memory
                    torch.cuda.reset_peak_memory_stats()
                dt = timed(fn, device)
                if device == "cuda":
                    peak[name] = max(peak[name], torch.cuda.max_memory_allocated())
                if rep:
                    times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # the work each side computes: ours each shared prompt once, TRL every sequence's (padding not counted)
    work = {"ours": lora_step_flops(matmul_weights, head, lora, collated.tokens, n_tok),
            "trl": lora_step_flops(matmul_weights, head, lora, sum(lengths), n_tok)}
    fc = FlopCount(matmul_weights, head, base.config.num_hidden_layers, base.config.hidden_size)
    flops = {"6N": fc.per_step(lengths, n_tok), "4N": fc.per_step(lengths, n_tok, per_param=4),
             "6N+attn": fc.per_step(lengths, n_tok, attention=True)}
    if device == "cuda":
        dev_name = torch.cuda.get_device_name()
    else:  # the CPU kind, its widest vector extension and its cores: utilisations of two kinds do not compare
        from pipeline.engines.hardware import machine

        dev_name = machine()
    peak_flops = next((v for k, v in PEAK_BF16_FLOPS.items() if k in dev_name), None) if device == "cuda" else None
    rate = device_rate(device, weights_dtype, peak_flops)
    precision = ("bf16 autocast over " + ("fp32 master weights (as the trainer)" if weights_dtype == "float32"
                                          else "bf16 weights")) if bf16 else f"{weights_dtype}, no autocast"
    result = {
        "device": dev_name, "precision": precision, "model": model_name,
        "params": frozen,
        "lora_params": lora,
        "batch": batch, "batch_kind": batch_kind, "completion_len": completion_len,
        "completion_tokens": n_tok, "tokens": sum(lengths), "computed_tokens": collated.tokens,
        "group_size": group_size,
        "reps": reps,
        "gradient_checkpointing": gradient_checkpointing, "prompt_layout": prompt_layout,
        "compiled_decoder": compile_decoder,
        "flops_per_step": flops, "peak_bf16_flops": peak_flops, "device_rate": rate,
        "loss": {"ours": ours_loss[-1], "trl": trl_loss[-1]},
        "ratio_tokens_per_s": med["trl"] / med["ours"],
        "versions": _versions(),
    }
    for side in ("ours", "trl"):
        seconds = med[side]
        result[side] = {"ms_per_step": seconds * 1e3, "completion_tokens_per_s": n_tok / seconds,
                        "tokens_per_s": sum(lengths) / seconds,
                        "peak_memory_gib": peak[side] / 2 ** 30 if device == "cuda" else None,
                        "mfu": {f: flops[f] / seconds / peak_flops for f in flops} if peak_flops else None,
                        "work_flops": work[side], "achieved_flops": work[side] / seconds,
                        "utilisation": work[side] / seconds / rate["flops"] if rate else None}
    _print(result, echo)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
        echo(f"  wrote {json_path}")
    return result


def device_rate(device: str, weights_dtype: str, peak_flops: float | None) -> dict | None:
    """What a step's utilisation is taken against: on CPU the probe's product (`pipeline bench dtype`) in the weights'
    dtype on the threads the step uses, measured now; on a GPU its dense bf16 peak (None where unknown)."""
    if device == "cuda":
        return {"flops": peak_flops, "what": "dense bf16 peak"} if peak_flops else None
    from pipeline.engines.hardware import PROBE_SHAPE, matmul_gflops

    threads = torch.get_num_threads()
    shape = "x".join(map(str, PROBE_SHAPE))
    return {"flops": matmul_gflops(weights_dtype, threads) * 1e9, "dtype": weights_dtype, "threads": threads,
            "what": f"measured {weights_dtype} matmul ({shape}, {threads} threads)"}


def _si(x: float) -> str:
    return next(f"{x / d:.3g}{u}" for d, u in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, ""))
                if abs(x) >= d or d == 1)


def _print(result: dict, echo) -> None:
    checkpointing = ", gradient checkpointing" if result["gradient_checkpointing"] else ""
    echo(f"{result['model']}: {_si(result['params'])} frozen + {_si(result['lora_params'])} LoRA params on "
         f"{result['device']} ({result['precision']}{checkpointing})")
    echo(f"batch {result['batch']} sequences ({result['batch_kind']}): {result['completion_tokens']} completion "
         f"tokens, {result['tokens']} with prompts (TRL computes these), {result['computed_tokens']} with each prompt "
         f"once (ours); median of {result['reps']} steps after 1 warm-up")
    for k in ("ours", "trl"):
        side = result[k]
        mem = f"  peak {side['peak_memory_gib']:6.2f} GiB" if side["peak_memory_gib"] is not None else ""
        mfu = ("  MFU " + " | ".join(f"{v:.1%} ({f})" for f, v in side["mfu"].items())) if side["mfu"] else ""
        echo(f"  {k:5s} {side['ms_per_step']:8.1f} ms/step  {side['completion_tokens_per_s']:9.0f} completion tokens/s"
             f"{mem}{mfu}")
    echo(f"  ratio ours/TRL tokens/s: {result['ratio_tokens_per_s']:.2f}x  (goal >= 3x on HumanEval-length groups)")
    echo(f"  loss: ours {result['loss']['ours']:.6f} vs TRL {result['loss']['trl']:.6f} (same formula with kl_mask "
         "off)")
    f = result["flops_per_step"]
    echo(f"  model FLOPs/step {_si(f['6N'])} (6N: 6/param/token, LM head only where scored), "
         f"{_si(f['4N'])} (4N: LoRA, no frozen-weight grads), {_si(f['6N+attn'])} (6N + PaLM "
         f"attention 12·L·d·T)" + ("" if result["peak_bf16_flops"] else "; MFU on CUDA with a known peak only"))
    rate = result["device_rate"]
    if rate:
        sides = " | ".join(f"{k} {_si(result[k]['achieved_flops'])}FLOP/s = {result[k]['utilisation']:.1%}"
                           for k in ("ours", "trl"))
        echo(f"  utilisation (4N·T + 4·head·S + 6·LoRA·T over the tokens each side computes): {sides} of "
             f"{_si(rate['flops'])}FLOP/s ({rate['what']})")


def _step_seconds(model, seqs: list[TrainSequence], share: bool, reps: int) -> float:
    """Median wall time of our forward + ioGRPO-mKL loss + backward on `seqs`, prompts shared or not."""
    collated = collate(seqs, 0, share_prompts=share)
    with torch.no_grad():
        old = completion_logprobs(model, collated).detach()
    times = []
    for rep in range(reps + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        terms = grpo_mkl_terms(completion_logprobs(model, collated), old, old, collated.advantages,
                               collated.completion_mask, BETA, EPS)
        terms.loss.backward()
        if rep:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sweep(prompt_lens=(128, 512), group_sizes=(2, 4, 8), batch: int = BATCH, completion_len: int = 64,
          reps: int = 1, echo=print) -> list[dict]:
    """The shared-prompt saving against prompt length and group size on the embedded model (CPU fp32): the same
    step with each prompt once and with a prompt row per sequence (the cost without prompt sharing); the token ratio is
    what the saving tends to when compute is linear in tokens (Prefix Grouper's FLOP argument)."""
    from pipeline.engines.models import load_causal_lm

    model = default_lora(load_causal_lm(MODEL, dtype="float32", device="cpu")).train()
    rows = []
    echo(f"{'prompt':>6} {'group':>5} {'per-seq s':>9} {'shared s':>8} {'saving':>6} {'token ratio':>11}")
    for prompt_len in prompt_lens:
        for group_size in group_sizes:
            seqs = id_batch(model.config.vocab_size, batch, prompt_len, completion_len, group_size)
            full, shared = (_step_seconds(model, seqs, s, reps) for s in (False, True))
            ratio = collate(seqs, 0, share_prompts=False).tokens / collate(seqs, 0).tokens
            rows.append({"prompt_len": prompt_len, "group_size": group_size, "per_sequence_s": full, "shared_s": shared,
                         "saving": full / shared, "token_ratio": ratio})
            echo(f"{prompt_len:>6} {group_size:>5} {full:>9.2f} {shared:>8.2f} {full / shared:>5.2f}x {ratio:>10.2f}x")
    return rows


def main(completion_len: int | None = None, **kw) -> dict:
    return run(completion_len=completion_len, **kw)


if __name__ == "__main__":
    main()


def _pass_seconds(model, batches: list, reps: int, train: bool) -> list[tuple[float, float]]:
    """Per batch, the median (wall, CPU) seconds of a training step on it (forward, ioGRPO-mKL loss, backward) or,
    `train` False, of a no-grad forward (a π_old / reference pass); the batches alternate within each rep, so drift on
    a shared machine hits them alike. The process's CPU time is the steadier figure where other jobs share the
    cores (wall time then counts their turns)."""
    with torch.no_grad():
        olds = [completion_logprobs(model, b).detach() for b in batches]
    times: list[list[tuple[float, float]]] = [[] for _ in batches]
    for rep in range(reps + 1):  # the first is a warm-up
        for collated, old, kept in zip(batches, olds, times, strict=True):
            model.zero_grad(set_to_none=True)
            started, cpu = time.perf_counter(), time.process_time()
            if train:
                terms = grpo_mkl_terms(completion_logprobs(model, collated), old, old, collated.advantages,
                                       collated.completion_mask, BETA, EPS)
                terms.loss.backward()
            else:
                with torch.no_grad():
                    completion_logprobs(model, collated)
            if rep:
                kept.append((time.perf_counter() - started, time.process_time() - cpu))
    return [(statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for t in times]


def prefix(config: str | Path = "configs/mixed-choice.yaml", model_ref: str = MODEL, queries: tuple[int, ...] = (1, 4),
           per_query: int = 2, completion_len: int = 85, reps: int = 2, min_prefix: int = 32,
           layouts: tuple[str, ...] = ("split", "packed"), echo=print) -> list[dict]:
    """The shared-prefix saving (training.shared_prefix_min) on a config's own prompts: its first training queries'
    workflow prompts rendered with `model_ref`'s tokenizer (`pipeline.stages.sampling.workflow_prompt_ids`), each with
    `per_query` random completions of about `completion_len` tokens, in one pass of `q` queries for each q of
    `queries`. Per layout, the training step and a no-grad forward with each prompt whole (min_prefix 0: the
    layout before) and with their common prefix once, fp32 on this machine's CPU or GPU; the ratio new/old."""
    from pipeline.config import load_config
    from pipeline.core.packing import shared_prefix
    from pipeline.engines.benchmarks import load_benchmark
    from pipeline.engines.models import load_causal_lm, load_tokenizer
    from pipeline.stages.sampling import workflow_prompt_ids

    cfg = load_config(Path(config), [])
    bench = load_benchmark(cfg.benchmark)
    tok = load_tokenizer(model_ref)
    prompts = workflow_prompt_ids(cfg, bench.items()[: max(queries)], bench.family, tok)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = default_lora(load_causal_lm(model_ref, dtype="float32", device=device)).train()
    rng = torch.Generator().manual_seed(0)
    rows = []
    echo(f"{model_ref} fp32 on {device}: {config}'s prompts, {per_query} completions of ~{completion_len} tokens each;"
         f" median of {reps} after 1 warm-up")
    echo("seconds: wall / CPU of this process; ratio: new / old CPU")
    echo(f"{'layout':>6} {'queries':>7} {'prefix':>6} {'prompt':>6} {'slots old':>9} {'slots new':>9} "
         f"{'step old s':>13} {'step new s':>13} {'ratio':>6} {'fwd old s':>13} {'fwd new s':>13} {'ratio':>6}")
    for n_queries in queries:
        seqs = [TrainSequence(f"q{q}s{k}", prompts[q],
                              torch.randint(100, tok.vocab_size, (_ragged(k, completion_len),), generator=rng).tolist(),
                              1.0 if k % 2 else -1.0, None)
                for q in range(n_queries) for k in range(per_query)]
        shared = shared_prefix([p[:-1] for p in prompts[:n_queries]], min_prefix)
        for layout in layouts:
            old, new = (pass_batch(seqs, tok.pad_token_id or 0, device, layout, m) for m in (0, min_prefix))
            step = _pass_seconds(model, [old, new], reps, True)
            fwd = _pass_seconds(model, [old, new], reps, False)
            row = {"layout": layout, "queries": n_queries, "sequences": len(seqs), "prefix_tokens": shared,
                   "mean_prompt_tokens": sum(map(len, prompts[:n_queries])) / n_queries,
                   "slots": {"old": old.slots, "new": new.slots},
                   "step_s": {"old": step[0][0], "new": step[1][0]},
                   "step_cpu_s": {"old": step[0][1], "new": step[1][1]},
                   "forward_s": {"old": fwd[0][0], "new": fwd[1][0]},
                   "forward_cpu_s": {"old": fwd[0][1], "new": fwd[1][1]},
                   "step_ratio": step[1][1] / step[0][1], "forward_ratio": fwd[1][1] / fwd[0][1]}
            rows.append(row)
            pair = lambda t: f"{t[0]:6.1f}/{t[1]:6.1f}"  # noqa: E731
            echo(f"{layout:>6} {n_queries:>7} {shared:>6} {row['mean_prompt_tokens']:>6.0f} {old.slots:>9} "
                 f"{new.slots:>9} {pair(step[0]):>13} {pair(step[1]):>13} {row['step_ratio']:>5.2f}x "
                 f"{pair(fwd[0]):>13} {pair(fwd[1]):>13} {row['forward_ratio']:>5.2f}x")
    return rows
