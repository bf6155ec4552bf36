"""`transformers` backend: batched `model.generate` with left padding, an optional merged peft adapter,
fp32 logprobs of the sampled tokens recorded while sampling (no second forward pass), and each prompt
prefilled once for its n samples.

The sampling itself is exactly `model.generate(do_sample=True, temperature=T, top_p=p)`: we pass the same
temperature and top-p warpers in the same order, followed by a recorder that only reads the scores, so
the random stream and the tokens are identical to the raw call with the same seed. transformers would add
top_k=50 when none is given; we pass top_k=0 (off, as in vLLM) so every backend samples the same distribution.
"""

from __future__ import annotations

import logging
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from pipeline.engines.generation.base import Completion, Generator, Sampling, adapter_id, stop_length, stop_text
from pipeline.engines.models import load_causal_lm, load_tokenizer

log = logging.getLogger(__name__)


class _LogprobRecorder(LogitsProcessor):
    """Keeps log_softmax of the final (processed) scores of step t and, once step t's token is known
    (the last column of input_ids at step t+1, or of the output), gathers its logprob."""

    def __init__(self) -> None:
        self.prev: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def gather(self, tokens: torch.Tensor) -> None:
        if self.prev is not None:
            self.steps.append(self.prev.gather(1, tokens[:, None]).squeeze(1))
            self.prev = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.gather(input_ids[:, -1])
        self.prev = torch.log_softmax(scores.float(), dim=-1)
        return scores


class TransformersGenerator(Generator):
    backend = "transformers"

    def __init__(self, model_ref: str, dtype: str = "float32", device: str | None = None):
        self.model_ref = model_ref
        self.dtype = dtype
        self.device = device
        self.tokenizer = load_tokenizer(model_ref)
        self.tokenizer.padding_side = "left"
        self.model = load_causal_lm(model_ref, dtype=dtype, device=device)
        self.adapter: str | None = None

    def _use_adapter(self, adapter: str | None) -> None:
        """Merge the LoRA adapter into a fresh copy of the base weights (merged: no LoRA cost per token)."""
        if adapter == self.adapter:
            return
        model = load_causal_lm(self.model_ref, dtype=self.dtype, device=self.device) if self.adapter else self.model
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter_id(adapter)[2]).merge_and_unload().eval()
        self.model, self.adapter = model, adapter

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        enc = self.tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
        return {k: v.to(self.model.device) for k, v in enc.items()}

    @torch.inference_mode()
    def _generate(self, prompts: list[str], sampling: Sampling, adapter: str | None) -> list[list[Completion]]:
        sample = sampling.temperature > 0
        self._use_adapter(adapter)
        enc = self.encode(prompts)
        recorder = _LogprobRecorder()
        procs: list[LogitsProcessor] = []
        if sample and sampling.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(sampling.temperature))
        if sample and sampling.top_p < 1.0:
            procs.append(TopPLogitsWarper(sampling.top_p))
        procs.append(recorder)
        started = time.perf_counter()
        warp = dict(temperature=1.0, top_p=1.0, top_k=0) if sample else {}  # our warpers replace the built-in ones
        inputs = self._prefilled(enc, sampling.n) if sampling.n > 1 else {**enc, "num_return_sequences": 1}
        torch.manual_seed(sampling.seed)
        out = self.model.generate(
            **inputs, do_sample=sample, **warp, max_new_tokens=sampling.max_new_tokens,
            logits_processor=LogitsProcessorList(procs), pad_token_id=self.tokenizer.pad_token_id,
            **(dict(stop_strings=list(sampling.stop), tokenizer=self.tokenizer) if sampling.stop else {}),
        )
        seqs = out if isinstance(out, torch.Tensor) else out.sequences
        recorder.gather(seqs[:, -1])
        logprobs = torch.stack(recorder.steps, dim=1).cpu() if recorder.steps else torch.zeros(seqs.shape[0], 0)
        log.debug("generate: %d x %d in %.2fs", len(prompts), sampling.n, time.perf_counter() - started)
        return self._unpack(enc, seqs.cpu(), logprobs, sampling)

    @torch.inference_mode()
    def next_token_logprobs(self, prompts: list[str], token_ids: list[int],
                            adapter: str | None = None) -> list[list[float]]:
        self._use_adapter(adapter)
        enc = self.encode(prompts)
        pos = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # left padding: positions count real tokens only
        # logits of the last position only: the whole prompt's would be prompts x length x vocabulary floats
        last = self.model(**enc, position_ids=pos, logits_to_keep=1).logits[:, -1, :].float()
        return torch.log_softmax(last, dim=-1)[:, list(token_ids)].cpu().tolist()

    def _prefilled(self, enc: dict, samples: int) -> dict:
        """generate() inputs for n = `samples` samples per prompt with each prompt prefilled once, not n times: the KV
        cache of all but the last prompt token is computed for the batch, then repeated n times (generate() itself
        would repeat the prompt and prefill every copy). Same tokens as `num_return_sequences=n` (the prefill
        draws no random numbers); the prefill is most of a rollout's cost on CPU, more so with exemplars."""
        from transformers import DynamicCache

        ids, att = enc["input_ids"], enc["attention_mask"]
        if ids.shape[1] < 2:
            return {**enc, "num_return_sequences": samples}
        cache = DynamicCache(config=self.model.config)
        pos = (att.cumsum(-1) - 1).clamp(min=0)  # left padding: positions count real tokens only
        self.model(input_ids=ids[:, :-1], attention_mask=att[:, :-1], position_ids=pos[:, :-1], past_key_values=cache,
                   use_cache=True)
        cache.batch_repeat_interleave(samples)
        return {"input_ids": ids.repeat_interleave(samples, 0), "attention_mask": att.repeat_interleave(samples, 0),
                "past_key_values": cache}

    def _unpack(self, enc: dict, seqs: torch.Tensor, logprobs: torch.Tensor,
                sampling: Sampling) -> list[list[Completion]]:
        width = enc["input_ids"].shape[1]
        mask = enc["attention_mask"].cpu().bool()
        ids = enc["input_ids"].cpu()
        eos = set(self._eos_ids())
        results: list[list[Completion]] = []
        for i in range(ids.shape[0]):
            prompt_ids = ids[i][mask[i]].tolist()
            row: list[Completion] = []
            for j in range(sampling.n):
                sample_index = i * sampling.n + j  # generate repeats each prompt n times in place
                toks = seqs[sample_index, width:].tolist()
                stop = next((t for t, tok in enumerate(toks) if tok in eos), None)
                toks = toks if stop is None else toks[: stop + 1]
                # a row that wrote a stop string ends with it (generate pads it while the others run on)
                kept = stop_length(toks, self._decode, sampling.stop)
                toks, stop = (toks, stop) if kept is None else (toks[:kept], kept - 1)
                row.append(Completion(
                    text=stop_text(self._decode(toks), sampling.stop),
                    prompt_token_ids=prompt_ids,
                    token_ids=toks,
                    token_logprobs=logprobs[sample_index, : len(toks)].tolist(),
                    finish_reason="length" if stop is None else "stop",
                ))
            results.append(row)
        return results

    def _decode(self, toks: list[int]) -> str:
        return self.tokenizer.decode(toks, skip_special_tokens=True)

    def _eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return list(eos) if isinstance(eos, list | tuple) else [eos]
