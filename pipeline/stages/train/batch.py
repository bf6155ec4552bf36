"""A pass's tensors, in the two layouts of `training.prompt_layout`: `split` (`Batch`: the distinct prompts, then the
completions reading their keys and values) and `packed` (`PackedBatch`: a prompt and its completions in one row
under a 4D mask). Both give `pipeline.stages.train.logprobs.completion_logprobs` the same [B, Tc] output grid, Tc
the longest completion of the pass. Imports torch alone (`pipeline bench train` runs on a bare GPU machine)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.stages.train.data import TrainSequence


@dataclass
class Batch:
    """One forward pass in two parts: the distinct prompts (each without its last token) once, then every sequence's
    last prompt token and completion, attending to its prompt's keys and values. Position j of the second part's
    grid predicts completion token j, so the grids of `input_ids`, `tgt` and `completion_mask` coincide."""

    prompt_ids: torch.Tensor  # [P, Lp] distinct prompts minus their last token, right-padded (Lp may be 0)
    prompt_mask: torch.Tensor  # [P, Lp]
    prompt_of: torch.Tensor  # [B] the row of each sequence's prompt
    input_ids: torch.Tensor  # [B, Tc] last prompt token + completion[:-1], right-padded
    position_ids: torch.Tensor  # [B, Tc] positions in the full sequence (len(prompt) - 1 + j)
    src: torch.Tensor  # [N] flat positions (b*Tc + j) of the completion tokens in the [B, Tc] grid
    tgt: torch.Tensor  # [N] the completion token ids
    completion_mask: torch.Tensor  # [B, Tc]
    advantages: torch.Tensor  # [B]

    @property
    def slots(self) -> int:
        """Token positions the pass computes, padding included (prompt grid + completion grid)."""
        return self.prompt_ids.numel() + self.input_ids.numel()

    @property
    def tokens(self) -> int:
        """Token positions that hold a real token."""
        return int(self.prompt_mask.sum()) + int(self.completion_mask.sum())


def collate(seqs: list[TrainSequence], pad_id: int, device: torch.device | str = "cpu",
            share_prompts: bool = True) -> Batch:
    """`share_prompts=False` gives every sequence its own prompt row (the per-sequence cost, for benches)."""
    prompts: dict[tuple[int, ...], int] = {}
    prompt_of = [prompts.setdefault(tuple(s.prompt_ids[:-1]) if share_prompts else (b, *s.prompt_ids[:-1]),
                                    len(prompts)) for b, s in enumerate(seqs)]
    body = [p if share_prompts else p[1:] for p in prompts]
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
                                          cmask, _advantages(seqs))))


@dataclass
class PackedBatch:
    """One forward pass as rows that each hold a distinct prompt followed by its sequences' completions (all tokens
    but the last), under a 4D mask: a completion sees its prompt and its own earlier tokens, not its siblings
    (Prefix Grouper's layout, arXiv 2506.05433). One decoder call and no padding between completions; the same
    outputs as `Batch` (`completion_logprobs` returns the same [B, Tc] grid)."""

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


def collate_packed(seqs: list[TrainSequence], pad_id: int, device: torch.device | str = "cpu") -> PackedBatch:
    """`PackedBatch` of `seqs` (prompts of at least one token: a completion's first token is predicted from its
    prompt's last position)."""
    rows: dict[tuple[int, ...], list[int]] = {}
    for seq_index, seq in enumerate(seqs):
        rows.setdefault(tuple(seq.prompt_ids), []).append(seq_index)
    width = max(len(s.completion_ids) for s in seqs)
    built, src, dst, tgt = [], [], [], []  # per row (ids, positions, owners); src as (row, index)
    for row, (prompt, members) in enumerate(rows.items()):
        prompt_len = len(prompt)
        ids, pos, own = list(prompt), list(range(prompt_len)), [-1] * prompt_len
        for seq_index in members:
            c = seqs[seq_index].completion_ids
            src += [(row, prompt_len - 1)] + [(row, len(ids) + j) for j in range(len(c) - 1)]
            dst += [seq_index * width + j for j in range(len(c))]
            tgt += c
            ids, pos = ids + c[:-1], pos + list(range(prompt_len, prompt_len + len(c) - 1))
            own = own + [seq_index] * (len(c) - 1)
        built.append((ids, pos, own))
    row_len = max(len(ids) for ids, _, _ in built)
    ids_t = torch.full((len(built), row_len), pad_id, dtype=torch.long)
    pos_t = torch.zeros((len(built), row_len), dtype=torch.long)
    # padding: an owner of its own (it sees itself: no empty row)
    own_t = -2 - torch.arange(row_len).repeat(len(built), 1)
    for row, (ids, pos, own) in enumerate(built):
        used = len(ids)
        ids_t[row, :used], pos_t[row, :used], own_t[row, :used] = (torch.tensor(x) for x in (ids, pos, own))
    idx = torch.arange(row_len)
    mask = (idx[None, :] <= idx[:, None]) & ((own_t[:, None, :] == -1) | (own_t[:, None, :] == own_t[:, :, None]))
    cmask = torch.zeros((len(seqs), width))
    for seq_index, seq in enumerate(seqs):
        cmask[seq_index, : len(seq.completion_ids)] = 1
    src_t = torch.tensor([r * row_len + i for r, i in src], dtype=torch.long)
    dst_t = torch.tensor(dst, dtype=torch.long)
    real = sum(len(ids) for ids, _, _ in built)
    tgt_t = torch.tensor(tgt, dtype=torch.long)
    return PackedBatch(*(x.to(device) for x in (ids_t, pos_t, mask[:, None], src_t, dst_t, tgt_t, cmask,
                                                _advantages(seqs))), real)


def _advantages(seqs: list[TrainSequence]) -> torch.Tensor:
    return torch.tensor([s.advantage for s in seqs], dtype=torch.float32)


def pass_batch(seqs: list[TrainSequence], pad_id: int, device: torch.device | str,
               layout: str = "split") -> Batch | PackedBatch:
    """A pass's tensors in `training.prompt_layout`."""
    return collate_packed(seqs, pad_id, device) if layout == "packed" else collate(seqs, pad_id, device)
