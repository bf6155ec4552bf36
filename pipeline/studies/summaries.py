"""An evaluation's summary as a typed record: what `eval_summary` computes for any run whose round 0 holds
workflows (a checkpoint held out, a baseline, SMC, plain sampling), the line every command prints for it, and the
dict it is stored as (`to_dict` gives back exactly the dict it was read from, so JSON written before stays the
same byte for byte)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from pipeline.studies.formatting import metrics_phrase, num, tokens_phrase


@dataclass
class EvalSummary:
    eval_run_id: str
    queries: int
    mean_at_l: float | None = None
    best_at_l: float | None = None
    majority_at_l: float | None = None
    valid_share: float | None = None
    workflows: int = 0
    pending: int = 0
    gen_tokens_per_query: float | None = None
    exec_tokens_per_query: float | None = None
    exec_computed_tokens_per_query: float | None = None
    exec_calls_per_query: float | None = None
    cost_usd_per_query: float | None = None
    cache_hit_rate: float | None = None
    truncated_share: float | None = None
    status: dict[str, int] = field(default_factory=dict)
    per_query: list[dict] = field(default_factory=list)
    # keys beyond the common ones, in their order: `select_at_l` (two-level runs), `selected` (task-best), ...
    extra: dict = field(default_factory=dict)
    # the stored dict's key order, so that to_dict rebuilds it as it was
    order: tuple[str, ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: dict) -> EvalSummary:
        """Read a stored summary; a key it lacks (written before that figure existed) reads as its default."""
        names = {f.name for f in fields(cls)} - {"extra", "order"}
        return cls(**{k: v for k, v in d.items() if k in names},
                   extra={k: v for k, v in d.items() if k not in names}, order=tuple(d))

    def to_dict(self) -> dict:
        merged = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("extra", "order")}
        merged.update(self.extra)
        if not self.order:  # built here, not read: every field
            return merged
        return ({k: merged[k] for k in self.order if k in merged}
                | {k: v for k, v in self.extra.items() if k not in self.order})

    @property
    def select_at_l(self) -> float | None:
        return self.extra.get("select_at_l")

    def line(self, more: str = "") -> str:
        """`<run>: N queries, Mean@L .., Best@L ..[, Sel@L ..], Majority@L .., valid .., tokens/query ..[, more],
        status {...}`: the one line each command prints for an evaluation."""
        metrics = metrics_phrase(self.mean_at_l, self.best_at_l, self.majority_at_l, self.select_at_l,
                                 "select_at_l" in self.extra)
        return (f"{self.eval_run_id}: {self.queries} queries, {metrics}, valid {num(self.valid_share, 2)}, "
                f"{tokens_phrase(self.gen_tokens_per_query, self.exec_tokens_per_query)}"
                f"{', ' + more if more else ''}, status {self.status}")
