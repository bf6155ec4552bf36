"""A model's own hidden states of a text, mean-pooled over the text's tokens: the features of the learned router's
hidden-state probe (pipeline.studies.router, analyzer `hidden:<layer>`), which asks whether what the base model
itself reads in a query routes it better than its words do.

Each text's pooled states (every layer at once: the embeddings are layer 0, layer k the k-th block's output) are
computed once per model and text on this machine and kept by joblib.Memory under the model cache, so an experiment's
summary, `--report` and the gate read them again without loading the model. They are computed in float32 on the
CPU on every machine, so a probe's features do not depend on whether the CPU has bf16.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from pipeline.engines.models import cache_dir, resolve_model


def pooled_states(model_key: str, text: str, load: Callable[[], tuple]) -> np.ndarray:
    """(layers + 1, hidden size): the mean over `text`'s tokens of each layer's hidden states, from `load()`'s
    (model, tokenizer). `model_key` names the model for the cache; `load` is called only when the cache misses."""
    import torch

    model, tokenizer = load()
    ids = tokenizer(text, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise ValueError("hidden states: an empty text has no token to pool")
    with torch.no_grad():
        states = model(input_ids=ids, output_hidden_states=True).hidden_states
    return torch.stack([h[0].mean(dim=0) for h in states]).float().numpy()


class HiddenStates:
    """`embed(texts, layer)` -> (len(texts), hidden size): each text's `pooled_states` at `layer` (0: the token
    embeddings; the model's block count: its last block), for the model `model_ref` (a generator.model ref)."""

    def __init__(self, model_ref: str, cache: Path | None = None):
        import joblib

        self.model_ref = model_ref
        self._key = f"{model_ref} at {resolve_model(model_ref)}"
        # the loader is not part of a call's identity: the model and text are
        self._pooled = joblib.Memory(cache or cache_dir() / "hidden-states", verbose=0).cache(pooled_states,
                                                                                             ignore=["load"])
        self._loaded: tuple | None = None
        self._seen: dict[str, np.ndarray] = {}

    def _load(self) -> tuple:
        if self._loaded is None:
            from pipeline.engines.models import load_causal_lm, load_tokenizer

            self._loaded = load_causal_lm(self.model_ref, "float32", "cpu"), load_tokenizer(self.model_ref)
        return self._loaded

    def __call__(self, texts: Sequence[str], layer: int) -> np.ndarray:
        if not texts:
            return np.zeros((0, 0))
        for text in texts:
            if text not in self._seen:
                self._seen[text] = self._pooled(self._key, text, load=self._load)
        out = np.stack([self._seen[t] for t in texts])
        if not 0 <= layer < out.shape[1]:
            raise ValueError(f"hidden states: layer {layer} of {self.model_ref}, which has layers 0 (the token "
                             f"embeddings) to {out.shape[1] - 1}")
        return out[:, layer, :]
