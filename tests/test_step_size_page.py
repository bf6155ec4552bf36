"""docs/results/step-size.md prints its numbers from docs/results/step-size.json: each table row is rebuilt here from
the file, and the page's verdict is the rule's reading of the file's dev differences."""

import json
from pathlib import Path

import pytest

from pipeline.studies import formatting

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "results" / "step-size.md").read_text()
DATA = json.loads((ROOT / "docs" / "results" / "step-size.json").read_text())
PROSE = " ".join(PAGE.split())  # the page's lines wrap anywhere in a sentence


def interval(d: dict) -> str:
    """The project's `mean [lo, hi]`, with the typographic minus the page is written in."""
    return f"{formatting.signed(d['mean'])} {formatting.span(d['lo'], d['hi'])}".replace("-", "−")


def assert_seed_table_is_the_files(seed: dict) -> None:
    """A measured seed pair's table: each stage's row, both sides' seconds and their ratio, then the seed's total."""
    label = {("run", 0): "round 0", ("run", 1): "round 1", ("eval-base", 0): "the base model's evaluation",
             ("eval-r1", 0): "the last round's evaluation"}
    for r in seed["stages"]:
        assert (f"| {label[r['part'], r['round']]} | {r['stage']} | {r['one_s']:,.1f} | {r['four_s']:,.1f} | "
                f"{r['four_s'] / r['one_s']:.2f} |") in PAGE
    one, four = seed["stages_s"]["one"], seed["stages_s"]["four"]
    assert f"| **{one:,.1f}** | **{four:,.1f}** | **{four / one:.2f}** |" in PAGE


@pytest.mark.parametrize("row", DATA["train"], ids=lambda r: r["key"])
def test_each_train_stage_row_is_the_files(row):
    line = (f"| {row['label']} | {row['steps']} | {row['stage_s']:,.1f} | {row['ratio']:.3f} | {row['steps_s']:,.1f} | "
            f"{row['padding_share']:.3f} |")
    assert line in PAGE


def test_the_dev_rows_and_the_verdict_are_the_files():
    arms, diffs = DATA["dev"]["arms"], DATA["dev"]["diffs"]
    for key, label in (("mb8", "four groups a step, lr 1e-4"), ("mb8lr4", "four groups a step, lr 4e-4")):
        assert f"| {label} | {arms[key]['mean_at_l']:.3f} | {interval(diffs[key + '-base'])} |" in PAGE
    assert f"| one group a step | {arms['base']['mean_at_l']:.3f} | |" in PAGE
    assert f"| {arms['zero']['mean_at_l']:.3f} | {interval(diffs['zero-base'])} |" in PAGE
    # the rule, as written before the read: a point estimate of at least -0.05 at one of the lrs, the higher lr's mean
    passing = [k for k in ("mb8", "mb8lr4") if diffs[k + "-base"]["mean"] >= -0.05]
    assert passing == ["mb8"] and "at lr 1e-4 passes on seed 0, by 0.001" in PAGE
    base_model = arms["zero"]["mean_at_l"]
    gain = (arms["mb8"]["mean_at_l"] - base_model) / (arms["base"]["mean_at_l"] - base_model)
    assert f"{round(100 * gain)}% of one group a step's gain" in PAGE


def test_the_seed_arithmetic_and_the_bench_are_the_files():
    seed = DATA["seed_arithmetic"]
    assert f"seed would take about {round(seed['four_groups_packed_s'], -1):,.0f} s" in PAGE
    assert f"{seed['at_four_groups_packed']:.2f}x (" in PAGE and f"({seed['at_packed_alone']:.2f}x with" in PAGE
    four = next(b for b in DATA["prefix_bench"] if b["queries"] == 4)
    assert f"{four['step_cpu_s']['old']:.1f} s a step whole against {four['step_cpu_s']['new']:.1f} s" in PAGE
    assert f"**{four['step_ratio']:.2f}x**" in PAGE
    assert f"{four['slots']['old']:,} against {four['slots']['new']:,}" in PAGE


def test_the_three_seeds_rows_and_their_rule_are_the_files():
    dev, other = DATA["dev_seeds"], {r["seed"]: r for r in DATA["train_other_seeds"]}
    assert [s["seed"] for s in dev["seeds"]] == [0, 1, 2]
    for s in dev["seeds"]:
        row = f"| {s['seed']} | {s['one_group']:.3f} | {s['four_groups']:.3f} | {interval(s)} |"
        assert row in PAGE
        if s["seed"] in other:
            r = other[s["seed"]]
            assert f"| {r['ratio']:.3f} packed ({r['mb8packed_s']:,.1f} / {r['base_s']:,.1f} s) |" in PAGE
    pooled = dev["pooled"]
    assert pooled["n"] == 270 and f"**{interval(pooled)}**" in PAGE
    # the second rule keeps four groups a step where the pooled point estimate is at least -0.05
    assert pooled["mean"] >= -0.05 and "By the second, over three seeds, it stays" in PAGE


def test_the_measured_seed_rows_are_the_files():
    seed = DATA["seed_measured"]
    assert_seed_table_is_the_files(seed)
    # the totals are the stages' sums plus the curate stages the table leaves out
    for side in ("one", "four"):
        summed = sum(r[f"{side}_s"] for r in seed["stages"]) + seed["curate"][f"{side}_s"]
        assert round(summed, 1) == seed["stages_s"][side]
    one, four = seed["stages_s"]["one"], seed["stages_s"]["four"]
    assert f"**The seed took {four / one:.2f}x**" in PAGE
    # the 0.5x goal: what the train stages would need, given the other stages as measured
    train = next(b for b in seed["by_stage"] if b["stage"] == "train")
    rest = four - train["four_s"]
    assert f"the other stages, {rest:,.1f} s on the four-group side, are {rest / one:.2f}x" in PROSE
    assert f"both train stages in {0.5 * one - rest:.0f} s ({(0.5 * one - rest) / train['one_s']:.2f}x)" in PROSE


def test_the_second_rounds_dev_read_and_its_rule_are_the_files():
    r = DATA["dev_round1"]
    assert (r["queries"], r["l"], r["round"]) == (90, 2, 1)
    assert f"| one group a step | {r['one_group']:.3f} | |" in PAGE
    assert f"| four groups a step, packed | {r['four_groups']:.3f} | {interval(r)} |" in PAGE
    # the rule written before the runs: the point estimate at least -0.05 keeps it for two-round runs
    assert r["passes"] == (r["mean"] >= -0.05) and r["passes"] and f"It stays: **{interval(r)}**" in PAGE


def test_the_bf16_pair_rows_and_its_comparisons_are_the_files():
    bf16, fp32 = DATA["seed_measured_bf16"], DATA["seed_measured"]
    assert_seed_table_is_the_files(bf16)
    one, four = bf16["stages_s"]["one"], bf16["stages_s"]["four"]
    bf16_one = {b["stage"]: b["one_s"] for b in bf16["by_stage"]}
    fp32_one = {b["stage"]: b["one_s"] for b in fp32["by_stage"]}
    assert (f"the train stages most ({bf16_one['train'] / fp32_one['train']:.2f}x of their fp32 seconds, the "
            f"rollouts {bf16_one['rollout'] / fp32_one['rollout']:.2f}x, the scores "
            f"{bf16_one['score'] / fp32_one['score']:.2f}x; the whole one-group seed "
            f"{one / fp32['stages_s']['one']:.2f}x)") in PROSE
    fp32_share = fp32_one["train"] / fp32["stages_s"]["one"]
    assert f"({bf16_one['train'] / one:.0%}, against {fp32_share:.0%} in fp32)" in PROSE
    assert f"the bf16 seed with four groups a step takes {four / fp32['stages_s']['one']:.2f}x" in PROSE
