"""A pass's tensors, in the two layouts of `training.prompt_layout`: `split` (`Batch`: the distinct prompts, then the
completions reading their keys and values) and `packed` (`PackedBatch`: a prompt and its completions in one row
under a 4D mask). Both give `pipeline.stages.train.logprobs.completion_logprobs` the same [B, Tc] output grid, Tc
the longest completion of the pass. Imports torch alone (`pipeline bench train` runs on a bare GPU machine)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.core.packing import shared_prefix
from pipeline.stages.train.data import TrainSequence


@dataclass
class Batch:
    """One forward pass in two or three parts: the prompts' shared prefix once (`prefix_ids`, when the pass shares
    one: `pipeline.core.packing.shared_prefix`), the distinct prompts (each without its last token, after the
    prefix) once, attending to the prefix, then every sequence's last prompt token and completion, attending to its
    prompt's keys and values (prefix included). Position j of the last part's grid predicts completion token j, so
    the grids of `input_ids`, `tgt` and `completion_mask` coincide."""

    prompt_ids: torch.Tensor  # [P, Lp] distinct prompts minus their last token and the prefix, right-padded (Lp >= 0)
    prompt_mask: torch.Tensor  # [P, Lp]
    prompt_of: torch.Tensor  # [B] the row of each sequence's prompt
    input_ids: torch.Tensor  # [B, Tc] last prompt token + completion[:-1], right-padded
    position_ids: torch.Tensor  # [B, Tc] positions in the full sequence (len(prompt) - 1 + j)
    src: torch.Tensor  # [N] flat positions (b*Tc + j) of the completion tokens in the [B, Tc] grid
    tgt: torch.Tensor  # [N] the completion token ids
    completion_mask: torch.Tensor  # [B, Tc]
    advantages: torch.Tensor  # [B]
    prefix_ids: torch.Tensor | None = None  # [1, Lc] the prompts' shared prefix (None: none; prompts whole)

    @property
    def prefix_len(self) -> int:
        return 0 if self.prefix_ids is None else self.prefix_ids.shape[1]

    def context_mask(self) -> torch.Tensor:
        """[B, Lc + Lp]: which of the keys before its completion each sequence attends to (the prefix, then its
        prompt's row)."""
        rows = self.prompt_mask.index_select(0, self.prompt_of)
        if not self.prefix_len:
            return rows
        return torch.cat([rows.new_ones((rows.shape[0], self.prefix_len)), rows], dim=1)

    @property
    def slots(self) -> int:
        """Token positions the pass computes, padding included (prefix + prompt grid + completion grid)."""
        return self.prefix_len + self.prompt_ids.numel() + self.input_ids.numel()

    @property
    def tokens(self) -> int:
        """Token positions that hold a real token."""
        return self.prefix_len + int(self.prompt_mask.sum()) + int(self.completion_mask.sum())


def collate(seqs: list[TrainSequence], pad_id: int, device: torch.device | str = "cpu",
            share_prompts: bool = True, min_prefix: int = 0) -> Batch:
    """`share_prompts=False` gives every sequence its own prompt row (the per-sequence cost, for benches);
    `min_prefix` > 0 computes the distinct prompts' common prefix once when it has at least that many tokens
    (`pipeline.core.packing.shared_prefix`)."""
    prompts: dict[tuple[int, ...], int] = {}
    prompt_of = [prompts.setdefault(tuple(s.prompt_ids[:-1]) if share_prompts else (b, *s.prompt_ids[:-1]),
                                    len(prompts)) for b, s in enumerate(seqs)]
    body = [p if share_prompts else p[1:] for p in prompts]
    cut = shared_prefix(body, min_prefix) if share_prompts else 0
    prefix, body = body[0][:cut] if cut else None, [p[cut:] for p in body]
    lp, width = max(map(len, body), default=0), max(len(s.completion_ids) for s in seqs)
    pids, pmask = torch.full((len(body), lp), pad_id, dtype=torch.long), torch.zeros((len(body), lp), dtype=torch.long)
    for i, p in enumerate(body):
        pids[i, : len(p)], pmask[i, : len(p)] = torch.tensor(p, dtype=torch.long), 1
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    tgt = torch.zeros((len(seqs), width), dtype=torch.long)
    cmask, pos = torch.zeros((len(seqs), width)), torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        c = len(s.completion_ids)
        ids[b, :c] = torch.tensor([s.prompt_ids[-1], *s.completion_ids[:-1]])
        tgt[b, :c], cmask[b, :c] = torch.tensor(s.completion_ids), 1
        pos[b] = torch.arange(len(s.prompt_ids) - 1, len(s.prompt_ids) - 1 + width)
    src = cmask.flatten().nonzero().squeeze(1)
    return Batch(*(t.to(device) for t in (pids, pmask, torch.tensor(prompt_of), ids, pos, src, tgt.flatten()[src],
                                          cmask, _advantages(seqs))),
                 prefix_ids=None if prefix is None else torch.tensor([prefix], dtype=torch.long).to(device))


@dataclass
class PackedBatch:
    """One forward pass as rows that each hold a distinct prompt followed by its sequences' completions (all tokens
    but the last), under a 4D mask: a completion sees its prompt and its own earlier tokens, not its siblings
    (Prefix Grouper's layout, arXiv 2506.05433). One decoder call and no padding between completions; the same
    outputs as `Batch` (`completion_logprobs` returns the same [B, Tc] grid). When the pass's prompts share a prefix
    (`pipeline.core.packing.shared_prefix`), one row holds it once, then each prompt's rest followed by its
    completions: a prompt's rest sees the prefix and itself, a completion the prefix, its prompt's rest and itself."""

    input_ids: torch.Tensor  # [R, T] prompt, then each completion[:-1], right-padded
    position_ids: torch.Tensor  # [R, T] prompt 0..Lp-1; each completion from Lp again
    attention_mask: torch.Tensor  # [R, 1, T, T] bool, True = attends
    src: torch.Tensor  # [N] flat positions (r*T + i) of the hidden states predicting the completion tokens
    dst: torch.Tensor  # [N] their places (b*Tc + j) in the [B, Tc] output grid
    tgt: torch.Tensor  # [N] the completion token ids
    completion_mask: torch.Tensor  # [B, Tc]
    advantages: torch.Tensor  # [B]
    real: int  # token positions that hold a real token

    @property
    def slots(self) -> int:
        return self.input_ids.numel()

    @property
    def tokens(self) -> int:
        return self.real


def collate_packed(seqs: list[TrainSequence], pad_id: int, device: torch.device | str = "cpu",
                   min_prefix: int = 0) -> PackedBatch:
    """`PackedBatch` of `seqs` (prompts of at least one token: a completion's first token is predicted from its
    prompt's last position). A row is a prefix every token of the row sees, then prompt parts, each followed by its
    completions: without a shared prefix one row per distinct prompt (the prompt is the prefix, its part empty),
    with one (`min_prefix`, measured on the prompts minus their last token as in `collate`) a single row."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for seq_index, seq in enumerate(seqs):
        by_prompt.setdefault(tuple(seq.prompt_ids), []).append(seq_index)
    cut = shared_prefix([p[:-1] for p in by_prompt], min_prefix)
    if cut:
        layout = [(next(iter(by_prompt))[:cut], [(prompt[cut:], members) for prompt, members in by_prompt.items()])]
    else:
        layout = [(prompt, [((), members)]) for prompt, members in by_prompt.items()]
    width = max(len(s.completion_ids) for s in seqs)
    built, src, dst, tgt = [], [], [], []  # per row (ids, positions, part, owner); src as (row, index)
    for row, (prefix, parts) in enumerate(layout):
        # part: which prompt part a position belongs to (-1: the prefix); owner: which sequence (-1: a prompt's)
        ids, pos, part, own = list(prefix), list(range(len(prefix))), [-1] * len(prefix), [-1] * len(prefix)
        for part_index, (rest, members) in enumerate(parts):
            prompt_len = len(prefix) + len(rest)
            ids, pos = ids + list(rest), pos + list(range(len(prefix), prompt_len))
            part, own = part + [part_index] * len(rest), own + [-1] * len(rest)
            last = len(ids) - 1  # the prompt's last position predicts each completion's first token
            for seq_index in members:
                c = seqs[seq_index].completion_ids
                src += [(row, last)] + [(row, len(ids) + j) for j in range(len(c) - 1)]
                dst += [seq_index * width + j for j in range(len(c))]
                tgt += c
                ids, pos = ids + c[:-1], pos + list(range(prompt_len, prompt_len + len(c) - 1))
                part, own = part + [part_index] * (len(c) - 1), own + [seq_index] * (len(c) - 1)
        built.append((ids, pos, part, own))
    row_len = max(len(ids) for ids, *_ in built)
    ids_t = torch.full((len(built), row_len), pad_id, dtype=torch.long)
    pos_t = torch.zeros((len(built), row_len), dtype=torch.long)
    # padding: a part and an owner of its own (it sees the prefix and itself: no empty row)
    part_t = -2 - torch.arange(row_len).repeat(len(built), 1)
    own_t = part_t.clone()
    for row, (ids, pos, part, own) in enumerate(built):
        used = len(ids)
        for t, x in ((ids_t, ids), (pos_t, pos), (part_t, part), (own_t, own)):
            t[row, :used] = torch.tensor(x, dtype=torch.long)
    idx = torch.arange(row_len)
    same_part = part_t[:, None, :] == part_t[:, :, None]
    sees_owner = (own_t[:, None, :] == -1) | (own_t[:, None, :] == own_t[:, :, None])
    mask = (idx[None, :] <= idx[:, None]) & ((part_t[:, None, :] == -1) | (same_part & sees_owner))
    cmask = torch.zeros((len(seqs), width))
    for seq_index, seq in enumerate(seqs):
        cmask[seq_index, : len(seq.completion_ids)] = 1
    src_t = torch.tensor([r * row_len + i for r, i in src], dtype=torch.long)
    dst_t = torch.tensor(dst, dtype=torch.long)
    real = sum(len(ids) for ids, *_ in built)
    tgt_t = torch.tensor(tgt, dtype=torch.long)
    return PackedBatch(*(x.to(device) for x in (ids_t, pos_t, mask[:, None], src_t, dst_t, tgt_t, cmask,
                                                _advantages(seqs))), real)


def _advantages(seqs: list[TrainSequence]) -> torch.Tensor:
    return torch.tensor([s.advantage for s in seqs], dtype=torch.float32)


def pass_batch(seqs: list[TrainSequence], pad_id: int, device: torch.device | str,
               layout: str = "split", min_prefix: int = 0) -> Batch | PackedBatch:
    """A pass's tensors in `training.prompt_layout`, a shared prompt prefix once from `min_prefix` tokens
    (`training.shared_prefix_min`; 0: prompts whole)."""
    if layout == "packed":
        return collate_packed(seqs, pad_id, device, min_prefix)
    return collate(seqs, pad_id, device, min_prefix=min_prefix)
