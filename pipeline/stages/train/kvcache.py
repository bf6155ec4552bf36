"""The prompt's keys and values, shared by its completions (the `split` layout, `Batch`): the prompt pass records
them, the completion pass reads them, through HF's cache API.

Neither cache here appends: a layer under gradient checkpointing runs its forward again in the backward pass, and a
second append would double the prompt. transformers is imported where a cache is made, so this module (and
`completion_logprobs` above it) imports with torch alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from pipeline.stages.train.batch import Batch

if TYPE_CHECKING:
    from transformers.cache_utils import Cache


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


def _recording_cache() -> Cache:
    cache_cls, recording, _ = _cache_types()
    return cache_cls(layer_class_to_replicate=recording)


def _prefix_cache(rec: Cache, rows: torch.Tensor) -> Cache:
    """`rec`'s keys/values with batch rows `rows` (each sequence's prompt): index_select copies them, and its
    backward sums the completions' gradients into their prompt's."""
    cache_cls, _, prefix = _cache_types()
    return cache_cls(layers=[prefix(layer.keys.index_select(0, rows), layer.values.index_select(0, rows))
                             for layer in rec.layers])


@contextlib.contextmanager
def cache_under_checkpointing(decoder: torch.nn.Module) -> Iterator[None]:
    """HF drops `past_key_values` in a layer under gradient checkpointing unless the layer says its cache is safe to
    replay; ours are (see above), so the flag is set for the forward (the replay reuses the forward's arguments)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in decoder.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache


def prompt_states(decoder: torch.nn.Module, batch: Batch) -> Cache | None:
    """The prompts' per-layer keys and values (with their autograd history: gradients flow back into the prompt
    pass), expanded to one row per sequence as a read-only cache; None when no prompt has more than one token."""
    if batch.prompt_ids.shape[1] == 0:
        return None
    rec = _recording_cache()
    with cache_under_checkpointing(decoder):
        decoder(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask, past_key_values=rec, use_cache=False)
    return _prefix_cache(rec, batch.prompt_of)
