"""`pipeline bench seed` (pipeline/perf/seed.py): each variant is the experiment's first seed in a store of its own
with what the variant turns off, its figures are the stages' own timings, and the cache's answers are counted from
the scores. The measurement itself (hours of a real executor) is a bench, in docs/performance.md."""

from __future__ import annotations

import json
import time

import pytest
from test_references import _experiment_config
from test_references import fake_stages as fake_stages  # the fixture: every stage a stand-in, in process

from pipeline.perf.seed import VARIANTS, SeedBench, cache_use, run_seed_bench
from pipeline.run import open_run
from pipeline.stages import runner
from pipeline.stages.rounds import direct_call
from pipeline.stages.runner import RetryPolicy
from pipeline.store import Store


class _StageClock:
    """The runner's clock, each gap between readings half a second longer than the last: every stage that did work
    times a different, known number of seconds however fast this machine runs the stand-ins (a fast CPU timed them
    all at 0.0 s, and a ratio of zero totals is undefined)."""

    def __init__(self) -> None:
        self.t = self.gap = 0.0

    def perf_counter(self) -> float:
        self.gap += 0.5
        self.t += self.gap
        return self.t

    def __getattr__(self, name: str):
        return getattr(time, name)


def test_each_variant_runs_the_first_seed_in_its_store_as_the_variant_says(tmp_path, fake_stages, monkeypatch):
    monkeypatch.setattr(runner, "time", _StageClock())
    path = _experiment_config(tmp_path, "b", {"seeds": [0, 1], "references": ["io"]}, rounds=2)
    path.write_text(path.read_text().replace("  eval_rounds: all\n", ""))  # the default: the last round only
    out = tmp_path / "bench"
    bench = run_seed_bench(path, out, direct_call(RetryPolicy(delay_s=0)), ["before", "after"])
    runs = {v: sorted(Store(out / v).runs()) for v in ("before", "after")}
    # one seed; before evaluates every round, after the base model and the last one
    assert runs["before"] == ["b-baseline-io", "b-s0", "b-s0-eval-base", "b-s0-eval-r0", "b-s0-eval-r1"]
    assert runs["after"] == ["b-baseline-io", "b-s0", "b-s0-eval-base", "b-s0-eval-r1"]
    before = open_run(None, "b-s0-eval-base", 0, None, str(out / "before")).cfg
    after = open_run(None, "b-s0-eval-base", 0, None, str(out / "after")).cfg
    assert (before.executor.cache, before.scoring.cache_verdicts, before.executor.common_random_numbers) == \
        ("off", False, False)
    assert (after.executor.cache, after.scoring.cache_verdicts, after.executor.common_random_numbers) == \
        ("auto", True, True)
    # the figures are the stages' own timings: the last line of each stage that did work, summed per part and stage
    # and kept to one decimal (so each part may be off its exact sum by 0.05 and no more)
    def part_of(rid: str) -> str:
        return "reference" if "baseline" in rid else "evaluate" if "-eval-" in rid else "train"

    for v in ("before", "after"):
        want: dict[tuple[str, str], float] = {}
        for rid in runs[v]:
            last: dict = {}
            for line in (out / v / rid / "timings.jsonl").read_text().splitlines():
                r = json.loads(line)
                if not r["skipped"]:
                    last[(r["round"], r["stage"])] = r["wall_s"]
            for (_, stage), s in last.items():
                want[(part_of(rid), stage)] = want.get((part_of(rid), stage), 0.0) + s
        got = {(p.part, p.stage): p.wall_s for p in bench.parts if p.variant == v}
        assert set(got) == {k for k, s in want.items() if s > 0}
        for k, s in got.items():
            assert s == pytest.approx(want[k], abs=0.05 + 1e-9), k
        assert bench.total(v) == pytest.approx(sum(got.values()))
    assert {p.part for p in bench.parts if p.variant == "before"} == {"train", "evaluate", "reference"}
    assert sum(p.stages for p in bench.parts if p.variant == "before" and p.part == "evaluate") == 3 * 2
    saved = json.loads((out / "seed-bench.json").read_text())
    assert saved["ratios"]["after"] == pytest.approx(bench.total("after") / bench.total("before"))
    assert list(bench.machines) == ["before", "after"] and bench.lines()[-3].startswith("after: ")
    # run again: every stage is done, nothing runs
    calls = list(fake_stages)
    run_seed_bench(path, out, direct_call(RetryPolicy(delay_s=0)), ["before", "after"])
    assert fake_stages == calls


def test_variants_are_checked_before_anything_runs(tmp_path, fake_stages):
    path = _experiment_config(tmp_path, "v", {"seeds": [0]}, rounds=1)
    call = direct_call(RetryPolicy(delay_s=0))
    with pytest.raises(ValueError, match="unknown variant 'fast'; variants: before, after, after_seeded_training"):
        run_seed_bench(path, tmp_path / "o", call, ["before", "fast"])
    with pytest.raises(ValueError, match="must hold `before`"):
        run_seed_bench(path, tmp_path / "o", call, ["after"])
    assert fake_stages == [] and set(VARIANTS) == {"before", "after", "after_seeded_training"}


def test_cache_use_counts_the_latest_attempts_calls_and_hits(tmp_path):
    """Run a: 3 calls, 2 cached; its retried row counts once (latest attempt: 4 calls, 1 cached); run b: 5 calls, none
    cached (a row written before the column: null hits). a + b: 4 + 5 calls, 1 + 0 hits."""
    st = Store(tmp_path)
    st.write("scores", [{"gen_id": "g1", "rep": 0, "attempt": 0, "status": "ok", "llm_calls": 3, "cached_calls": 2},
                        {"gen_id": "g1", "rep": 0, "attempt": 1, "status": "ok", "llm_calls": 4, "cached_calls": 1}],
             "a", 0)
    st.write("scores", [{"gen_id": "g2", "rep": 0, "attempt": 0, "status": "ok", "llm_calls": 5}], "b", 0)
    assert cache_use(st, ["a", "b"]) == (9, 1) and cache_use(st, ["a"]) == (4, 1) and cache_use(st, ["c"]) is None


def test_the_table_and_the_ratio_by_hand():
    from pipeline.perf.seed import PartTime

    parts = [PartTime("before", "train", "score", 600.0, 2, 100, 0), PartTime("before", "evaluate", "score", 400.0,
                                                                               4, 80, 0),
             PartTime("after", "train", "score", 500.0, 2, 100, 20), PartTime("after", "evaluate", "score", 100.0, 2,
                                                                              40, 30)]
    b = SeedBench("c.yaml", "o", ["before", "after"], parts, {"before": {"M (AVX2, 2 cores)": 6}, "after": {}})
    assert (b.total("before"), b.total("after"), b.ratio("after")) == (1000.0, 600.0, 0.6)
    lines = b.lines()
    assert lines[1] == "train / score | 600 | 500 | 0 of 100 | 20 of 100"
    assert lines[3] == "total | 1000 | 600 |  | " and lines[4] == "after: 0.600x before (goal: at most 0.4x)"
    assert lines[5] == "before timed on: M (AVX2, 2 cores): 6 stages"
