"""The prompt's keys and values, shared by its completions (the `split` layout, `Batch`): the prompt pass records
them, the completion pass reads them, through HF's cache API. With a shared prefix (`Batch.prefix_ids`) a prefix pass
records its keys and values once, the prompt pass reads them (broadcast to every prompt) and records the prompts'
rest, and the completion pass reads both.

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

    class PrefixRecordingLayer(PrefixLayer):
        """Read-only prefix keys/values followed by the new ones, like `PrefixLayer`, keeping the last new ones it
        was given (as `RecordingLayer`: a checkpointed replay stores the same again)."""

        def update(self, key_states, value_states, *args, **kwargs):
            self.new_keys, self.new_values = key_states, value_states
            return super().update(key_states, value_states, *args, **kwargs)

    return Cache, RecordingLayer, PrefixLayer, PrefixRecordingLayer


def _recording_cache() -> Cache:
    cache_cls, recording, *_ = _cache_types()
    return cache_cls(layer_class_to_replicate=recording)


def _prefix_cache(rec: Cache, rows: torch.Tensor) -> Cache:
    """`rec`'s keys/values with batch rows `rows` (each sequence's prompt): index_select copies them, and its
    backward sums the completions' gradients into their prompt's."""
    cache_cls, _, prefix, _ = _cache_types()
    return cache_cls(layers=[prefix(layer.keys.index_select(0, rows), layer.values.index_select(0, rows))
                             for layer in rec.layers])


def _broadcast(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A [1, ...] prefix tensor as `rows` rows: a view (expand), whose backward sums the rows' gradients into the
    one prefix: its gradient is accumulated once, not per prompt or per sequence."""
    return t.expand(rows, *t.shape[1:])


def _shared_prefix_cache(prefix: Cache, prompts: int) -> Cache:
    cache_cls, _, _, prefix_recording = _cache_types()
    return cache_cls(layers=[prefix_recording(_broadcast(layer.keys, prompts), _broadcast(layer.values, prompts))
                             for layer in prefix.layers])


def _joined_cache(prefix: Cache, prompts: Cache, rows: torch.Tensor) -> Cache:
    """Per sequence, the prefix's keys/values followed by its prompt's rest (`rows`: each sequence's prompt row)."""
    cache_cls, _, prefix_layer, _ = _cache_types()
    n = rows.shape[0]
    return cache_cls(layers=[
        prefix_layer(torch.cat([_broadcast(pre.keys, n), own.new_keys.index_select(0, rows)], dim=-2),
                     torch.cat([_broadcast(pre.values, n), own.new_values.index_select(0, rows)], dim=-2))
        for pre, own in zip(prefix.layers, prompts.layers, strict=True)])


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
    pass), expanded to one row per sequence as a read-only cache; None when no prompt has more than one token.
    With a shared prefix (`Batch.prefix_ids`), the prefix is encoded once and broadcast, with its gradient, to the
    prompt pass and to every sequence: one prefix computation, forward and backward, for the whole pass."""
    if batch.prefix_len:
        return _prefixed_states(decoder, batch)
    if batch.prompt_ids.shape[1] == 0:
        return None
    rec = _recording_cache()
    with cache_under_checkpointing(decoder):
        decoder(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask, past_key_values=rec, use_cache=False)
    return _prefix_cache(rec, batch.prompt_of)


def _prefixed_states(decoder: torch.nn.Module, batch: Batch) -> Cache:
    """The prefix pass (one row), then the prompts' rest attending to it (at least one prompt has a rest: a pass
    shares a prefix only among two or more distinct prompts, `pipeline.core.packing.shared_prefix`)."""
    prefix, prefix_len = _recording_cache(), batch.prefix_len
    prompts, width = batch.prompt_ids.shape
    with cache_under_checkpointing(decoder):
        decoder(input_ids=batch.prefix_ids, past_key_values=prefix, use_cache=False)
        cache = _shared_prefix_cache(prefix, prompts)
        mask = torch.cat([batch.prompt_mask.new_ones((prompts, prefix_len)), batch.prompt_mask], dim=1)
        positions = torch.arange(prefix_len, prefix_len + width, device=batch.prompt_ids.device).expand(prompts, width)
        decoder(input_ids=batch.prompt_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                use_cache=False)
    return _joined_cache(prefix, cache, batch.prompt_of)
