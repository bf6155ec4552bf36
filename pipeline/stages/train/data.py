"""The train stage's rows: every member of every kept `groups` row of the objective's kind, joined to its generation
(prompt and completion token ids, the rollout's log-probs)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.run import RunContext

log = logging.getLogger(__name__)


@dataclass
class TrainSequence:
    """One row: a sequence (prompt + completion, a generation) with its row's coefficient. A generation kept in
    several groups is several rows with the same `gen_id`."""

    gen_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float  # the row's coefficient: a group's advantage, another kind's loss weight
    gen_logprobs: list[float] | None  # as sampled (diagnostics, or π_old under training.old_logprobs: rollout)
    level: str = "flat"  # its group's level: flat | agent | workflow
    score: float | None = None  # its score in the row (score_dpo's s_w / s_l)
    group_id: str | None = None
    off_policy: bool = False  # a logged row (rollout.logged): `gen_logprobs` are the behaviour policy's, μ
    # its first token is a design label drawn by rollout.choice_step whose row stores only the draw's log-prob
    # (renormalised over the labels, at choice_temperature), not the policy's: the sampler-trainer mismatch leaves
    # it out and π_old is recomputed for it (rows that store the policy's, `choice_step.logprob`, carry that instead)
    drawn_label: bool = False


def split_level(level: str, gen_id: str, prompt: list[int], completion: list[int],
                logprobs: list[float] | None) -> tuple[str, list[int], list[int], list[float] | None]:
    """curation.choice_credit's levels of one generation: `choice` trains the label token alone (the completion's
    first token), `code` the tokens after it (the label joins the prompt). Each is a sequence of its own, keyed
    `<gen_id>/choice` or `<gen_id>/code`, so its π_old and reference log-probs are its own; other levels as they are."""
    if level == "choice":
        return f"{gen_id}/choice", prompt, completion[:1], logprobs[:1] if logprobs else logprobs
    if level == "code":
        return f"{gen_id}/code", prompt + completion[:1], completion[1:], logprobs[1:] if logprobs else logprobs
    return gen_id, prompt, completion, logprobs


def row_logprobs(logged: bool, sampling: str | None,
                 logprobs: list[float] | None) -> tuple[list[float] | None, bool]:
    """A generation's log-probs as training reads them, and whether its first token is a design label whose policy
    log-prob the row does not store (TrainSequence.drawn_label). A sampled row under rollout.choice_step stores the
    draw's log-prob first and the policy's own in its `sampling`: the policy's is π_old's. A logged row keeps the
    draw's: it is the behaviour probability μ."""
    policy_label, drawn = label_logprob(sampling) if not logged else (None, False)
    if policy_label is None or not logprobs:
        return logprobs, drawn
    return [policy_label, *logprobs[1:]], False


def label_logprob(sampling: str | None) -> tuple[float | None, bool]:
    """(the drawn label's log-prob under the policy's whole vocabulary, whether the row's first token is a label
    drawn by rollout.choice_step) from a generation's stored `sampling`; the log-prob is None where the row does not
    store it (rows sampled before it was stored)."""
    if not sampling or '"choice_step"' not in sampling:
        return None, False
    step = json.loads(sampling).get("choice_step") or {}
    return step.get("logprob"), True


def load_sequences(ctx: RunContext, kind: str = "group") -> tuple[list[TrainSequence], dict[str, int]]:
    """Kept `groups` rows of `kind` (pipeline.core.objectives.KINDS; the round of training.data_run when set), each
    member joined to its generation: a sequence with the row's coefficient (group: its advantage; other kinds: its
    weight) and score, and the counts the manifest reports. The completion tail is cut to max_seq_len. A pair with a
    member that cannot be trained on is dropped whole, so `pair` sequences stay (chosen, rejected) at positions
    (2p, 2p + 1)."""
    import polars as pl  # here, not above: the batch and log-prob modules import with torch alone

    max_len = ctx.cfg.training.max_seq_len
    data_run = ctx.cfg.training.data_run or ctx.run_id
    groups = (ctx.store.read("groups", data_run, ctx.round).filter(pl.col("kept"))
              .filter(pl.col("kind").fill_null("group") == kind))
    info = {"sequences_truncated": 0, "sequences_dropped": 0, "distinct_workflows": 0, "distinct_queries": 0}
    if groups.height == 0:
        return [], info
    coef = "advantages" if kind == "group" else "weights"
    members = (groups.select("group_id", "level", "members", pl.col(coef).alias("coef"), "member_scores")
               .explode("members", "coef", "member_scores").rename({"members": "gen_id", "member_scores": "score"}))
    gens = (ctx.store.scan("generations", data_run, ctx.round)
            .select("gen_id", "query_id", "prompt_token_ids", "token_ids", "token_logprobs", "source", "sampling")
            .unique("gen_id", keep="first").collect())
    rows = members.join(gens, on="gen_id", how="left", maintain_order="left")
    seqs, bad_groups = [], set()
    for row in rows.iter_rows(named=True):
        logged = row["source"] == "logged"
        logprobs, drawn = row_logprobs(logged, row["sampling"], row["token_logprobs"])
        key, prompt, comp, glp = split_level(row["level"], row["gen_id"], list(row["prompt_token_ids"] or []),
                                             list(row["token_ids"] or []), logprobs)
        if not prompt or not comp or len(prompt) >= max_len:
            info["sequences_dropped"] += 1  # no generation row, no tokens, or a prompt longer than the cap
            bad_groups.add(row["group_id"])
            continue
        if len(prompt) + len(comp) > max_len:
            info["sequences_truncated"] += 1
            comp = comp[: max_len - len(prompt)]
            glp = glp[: len(comp)] if glp else glp
        if logged and not (glp and len(glp) == len(comp)):  # refused at import; a row edited since is refused here
            raise ValueError(f"logged row {row['gen_id']} has no behaviour log-probs for its {len(comp)} tokens")
        drawn = drawn and row["level"] != "code"  # a code-level row holds the label in its prompt
        seqs.append(TrainSequence(key, prompt, comp, float(row["coef"]),
                                  list(glp) if glp and len(glp) == len(comp) else None, row["level"],
                                  None if row["score"] is None else float(row["score"]), row["group_id"], logged,
                                  drawn))
    if kind == "pair" and bad_groups:
        seqs = [s for s in seqs if s.group_id not in bad_groups]
    if info["sequences_dropped"]:
        log.warning("%d group members skipped (missing generation, empty completion or prompt >= max_seq_len)",
                    info["sequences_dropped"])
    generations = {s.gen_id.removesuffix("/choice").removesuffix("/code") for s in seqs}  # a level's key is its own
    trained = rows.filter(pl.col("gen_id").is_in(list(generations)))
    info["distinct_workflows"] = trained["gen_id"].n_unique()
    info["distinct_queries"] = trained["query_id"].n_unique()
    log.info("training on %d sequences (%s rows): %d distinct workflows from %d queries", len(seqs), kind,
             info["distinct_workflows"], info["distinct_queries"])
    return seqs, info
