"""W4S's multi-turn refinement (rollout.mode: refine): RLAO rewards and the state prompt by hand; the loop through the
rollout stage with a scripted generator and a 4-item benchmark whose accuracies are known (T=3 turns x K=3
candidates, a skip, a repair, a resume), then its scores, curation and SQL; one real run through Prefect (slow)."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import numpy as np
import pytest

import pipeline.stages.rollout as rollout
from pipeline.config import ConfigError, config_from_dict
from pipeline.engines.benchmarks.base import Benchmark, Item, MetricResult
from pipeline.engines.generation import Completion, Generator
from pipeline.run import RunContext
from pipeline.stages.refine import (
    State,
    Task,
    best_index,
    candidate_id,
    make_tasks,
    rlao_rewards,
    rwr_weights,
    state_prompt,
)
from pipeline.store import Store

REPO = Path(__file__).resolve().parents[1]

# ---- pure ----------------------------------------------------------------------------------------------------------


def test_rlao_rewards_golden():
    # 0.5: not above the best 0.6, above the previous 0.4 -> 0.5; 0.25: neither, and below 0.3 -> 0 - 0.1;
    # 0.75: above the best -> 1
    assert rlao_rewards([0.5, 0.25, 0.75], 0.6, 0.4) == [0.5, -0.1, 1.0]
    # below 0.3 but above the best (1 - 0.1) or only above the previous (0.5 - 0.1)
    assert rlao_rewards([0.2, 0.29], 0.1, 0.0) == pytest.approx([0.9, 0.9])
    assert rlao_rewards([0.29], 0.5, 0.2) == pytest.approx([0.4])
    # equal is not above: equal to the best but above the previous -> 0.5; equal to the previous -> 0; 0.3 is no penalty
    assert rlao_rewards([0.6, 0.4, 0.3], 0.6, 0.4) == [0.5, 0.0, 0.0]
    assert rlao_rewards([], 0.5, 0.5) == []


def test_best_index_and_rwr_weights():
    assert best_index([0.5, None, 0.75, 0.75]) == 2  # the first of the ties
    assert best_index([None, 0.0]) == 1 and best_index([None, None]) is None
    assert rwr_weights([1.0, 0.5, -0.1, 0.0], 0.4) == pytest.approx([math.e ** 2.5, math.e ** 1.25, math.e ** -0.25, 1])


def test_tasks_are_chunks_of_task_size_or_single_queries():
    items = [Item(f"q{i}", f"{i}+{i}", {"answer": str(2 * i)}) for i in range(5)]
    tasks = make_tasks(items, "task", 2)
    assert [(t.id, [it.id for it in t.items]) for t in tasks] == [
        ("task:q0+2", ["q0", "q1"]), ("task:q2+2", ["q2", "q3"]), ("task:q4+1", ["q4"])]
    assert [(t.id, len(t.items)) for t in make_tasks(items, "query", 2)] == [(f"q{i}", 1) for i in range(5)]


def _run(answer, reward, status="ok", error=None):
    return {"status": status, "answer": answer, "error": error, "reward": reward}


def test_state_prompt_shows_code_accuracy_and_failure_cases():
    items = [Item("q0", "What is 2+3?", {"answer": "5"}), Item("q1", "What is 7-4?", {"answer": "3"}),
             Item("q2", "What is 9*9?", {"answer": "81"}), Item("q3", "What is 6/2?", {"answer": "3"})]
    task = Task("task:q0+4", items)
    code = "async def solve(problem):\n    return 'UNIQUE-MARKER'"
    runs = [_run("5", 1.0), _run("1", 0.0), _run(None, 0.0, "exec_error", "Traceback ...\nZeroDivisionError: boom"),
            _run("4", 0.0)]
    st = State("r0-task:q0+4-t0-c1", code, 0.25, 0.5, runs, [("start", 0.5), ("turn 1", 0.25)])
    text = state_prompt(task, st, 1, 3, "task", "procedural", "procedural", 2, True, random.Random(0))
    assert code in text and "Refinement turn 2 of 3" in text
    assert "Validation accuracy: 0.25 (1 of 4 correct)." in text
    assert "Accuracy so far: start 0.50, turn 1 0.25; best 0.50." in text
    assert "Failed cases (2 of 3):" in text and text.count("- Question:") == 2  # failure_cases = 2 of the 3 failed
    assert "What is 2+3?" not in text.split("Failed cases")[1]  # a correct item is never a failure case
    assert text.count("Correct answer:") == 2  # task unit: gold answers of training items, as W4S
    # all three failures shown with failure_cases = 3: the answer, the error's tail and the gold answer of each
    full = state_prompt(task, st, 1, 3, "task", "procedural", "procedural", 3, True, random.Random(0))
    for q, ans, gold in (("What is 7-4?", "1", "3"), ("What is 6/2?", "4", "3")):
        assert f"- Question: {q}\n  Workflow answer: {ans}\n  Correct answer: {gold}" in full
    assert ("- Question: What is 9*9?\n  Workflow answer: (none)\n  Error: exec_error: Traceback ... "
            "ZeroDivisionError: boom\n  Correct answer: 81") in full
    assert "analysis" in full and "do not hard-code" in full
    # the query unit never shows the gold answer (it is the answer asked for); no gold with show_gold off either
    one = Task("q1", [items[1]])
    q = state_prompt(one, State(None, code, 0.0, 0.0, [runs[1]], [("start", 0.0)]), 0, 3, "query", "procedural",
                     "procedural", 3, True, random.Random(0))
    assert "Task:\nWhat is 7-4?" in q and "Correct answer" not in q and "Workflow answer: 1" in q
    assert "the start workflow" in q and "Accuracy so far" not in q
    assert "Correct answer" not in state_prompt(task, st, 1, 3, "task", "procedural", "procedural", 3, False,
                                                random.Random(0))


def test_a_menu_task_refines_from_its_drawn_design_and_its_turns_show_the_menu():
    """W4S on a menu task: each task starts from the design its first slot draws (as SMC's particles and a flat
    rollout's slot 0 do) and every turn's prompt lists the menu; without a menu it starts from the prompt folder's
    example, not the shipped one."""
    from types import SimpleNamespace

    from pipeline.engines.prompting import example, load_design
    from pipeline.stages.refine import Refine
    from pipeline.stages.sampling import draw_design

    paths = [f"configs/programs/mixed_{d}.py" for d in ("direct", "steps", "vote", "pot")]
    menu = [load_design(p) for p in paths]
    items = [Item(f"q{i}", f"What is {i} + 1?", {"answer": str(i + 1)}) for i in range(8)]
    cfg = config_from_dict({"rollout": {"mode": "refine", "prompt_dir": "configs/prompts/mixed-menu",
                                        "example_menu": paths, "menu_choice": "drawn", "refine": {"task_size": 4}}})
    ref = Refine(SimpleNamespace(cfg=cfg), SimpleNamespace(items=items, menu=menu, family="procedural"), None, None)
    assert [t.id for t in ref.tasks] == ["task:q0+4", "task:q4+4"]
    assert all(ref.start_code[t.id] == menu[draw_design(0, t.id, 0, 4)].code for t in ref.tasks)
    task = ref.tasks[0]
    st = State(None, ref.start_code[task.id], 0.0, 0.0, [_run("1", 0.0)] * 4, [("start", 0.0)])
    text = state_prompt(task, st, 0, 3, "task", "procedural", "procedural", 2, True, random.Random(0),
                        "configs/prompts/mixed-menu", menu)
    assert "Designs a workflow can use, alone or combined:\n- mixed_direct: " in text and "- mixed_pot: " in text
    word = config_from_dict({"rollout": {"mode": "refine", "prompt_dir": "configs/prompts/word",
                                         "refine": {"task_size": 4}}})
    plain = Refine(SimpleNamespace(cfg=word), SimpleNamespace(items=items, menu=[], family="procedural"), None, None)
    assert plain.start_code["task:q0+4"] == example("procedural", "configs/prompts/word") != example("procedural")
    assert "Designs a workflow" not in state_prompt(task, st, 0, 3, "task", "procedural", "procedural", 2, True,
                                                    random.Random(0), "configs/prompts/word")


def test_refine_config_fields_and_defaults():
    cfg = config_from_dict({"rollout": {"mode": "refine"}})
    rc = cfg.rollout.refine
    assert (rc.turns, rc.candidates, rc.unit, rc.task_size, rc.failure_cases, rc.start) == (3, 4, "task", 8, 3, None)
    assert all(f.description for f in type(rc).model_fields.values())
    with pytest.raises(ConfigError, match="rollout.refine.rounds: unknown field"):
        config_from_dict({"rollout": {"refine": {"rounds": 2}}})
    assert config_from_dict({}).config_hash() == config_from_dict({"rollout": {"refine": {}}}).config_hash()


def test_evaluation_and_derived_runs_of_a_refine_run_sample_flat(tmp_path):
    """Refine feedback reads gold answers: held-out runs never refine (and never need refine turns to score)."""
    import yaml

    from pipeline.run import open_run
    from pipeline.studies.evaluate import derived_run_changes, eval_changes, open_eval_run

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"run_id": "rf", "store": {"root": str(tmp_path)}, "rollout": {"mode": "refine"}}))
    cfg = open_run(path, "rf").cfg
    assert derived_run_changes("test", cfg)["rollout.mode"] == "flat" and eval_changes(cfg)["rollout.m"] == 4
    assert "rollout.mode" not in derived_run_changes("test", config_from_dict({}))
    ev = open_eval_run(str(tmp_path), "rf", -1, "test", changes=eval_changes(cfg))
    assert (ev.cfg.rollout.mode, ev.cfg.rollout.m, ev.cfg.benchmark.train_split) == ("flat", 4, "test")


# ---- the loop through the rollout stage ------------------------------------------------------------------------------


def wf(body: str) -> str:
    return f"```python\nasync def solve(problem):\n    {body}\n```"


EXACT = wf("return str(eval(problem))")  # accuracy 1
PLUS = wf("return str(eval(problem)) if '+' in problem else 'x'")  # 2 of 4: 0.5
THREE = wf("return 'x' if problem == '9-1' else str(eval(problem))")  # 3 of 4: 0.75
WRONG = wf("return 'x'")  # 0
BROKEN_A = wf("return str(1/0)")  # fails its self-check; its repairs are broken again: skipped
BROKEN_B = wf("return str([][1])")  # fails its self-check; its repair is PLUS
TURNS = {0: [EXACT, PLUS, BROKEN_A], 1: [PLUS, WRONG, BROKEN_B], 2: [WRONG, THREE, EXACT]}
REPAIRS = {"1/0": BROKEN_A, "[][1]": PLUS}


class FourSums(Benchmark):
    name, family = "foursums", "math"

    def load(self) -> list[Item]:
        return [Item(f"q{i}", p, {"answer": str(eval(p))}) for i, p in enumerate(["1+1", "2+3", "7-4", "9-1"])]

    def items(self, split=None) -> list[Item]:
        return self.load()

    def score(self, item, answer) -> MetricResult:
        return MetricResult(float(answer.strip() == item.reference["answer"]))


class Scripted(Generator):
    """State prompts get TURNS[turn] (the turn is read from the prompt); a repair prompt gets REPAIRS of the failed
    code it quotes; `crash_on`: raise on the repair of that code (a rollout killed mid-turn)."""

    backend = "scripted"

    def __init__(self, crash_on: str | None = None):
        self.prompts: list[str] = []
        self.crash_on = crash_on

    def _generate(self, prompts, sampling, adapter):
        out = []
        for p in prompts:
            self.prompts.append(p)
            if "failed its check" in p:
                key = next(k for k in REPAIRS if k in p)
                if key == self.crash_on:
                    raise RuntimeError("killed mid-turn")
                texts = [REPAIRS[key]] * sampling.n
            else:
                t = int(re.search(r"Refinement turn (\d+) of", p).group(1)) - 1
                texts = ["The workflow fails; a better one:\n" + x for x in TURNS[t][:sampling.n]]
            out.append([Completion(x, [1, 2, 3], [4, 5], [-0.5, -0.25], "stop") for x in texts])
        return out


def _ctx(tmp_path) -> RunContext:
    data = {"run_id": "rf", "store": {"root": str(tmp_path)}, "generator": {"batch_size": 4},
            "rollout": {"mode": "refine", "repair_attempts": 2,
                        "refine": {"turns": 3, "candidates": 3, "task_size": 4, "failure_cases": 2, "start": WRONG}},
            "scoring": {"timeout_s": 20, "concurrency": 2}}
    cfg = config_from_dict(data)
    return RunContext(cfg, Store(tmp_path), "rf", 0, cfg.config_hash())


def _rollout(monkeypatch, ctx, gen: Scripted) -> dict:
    monkeypatch.setattr(rollout, "load_benchmark", lambda cfg: FourSums(cfg))
    monkeypatch.setattr(rollout, "make_generator", lambda g, enable_lora=False: gen)
    return rollout.run_rollout(ctx)


TASK = "task:q0+4"


def cid(t, k, fix=0):
    return candidate_id(0, TASK, t, k) + (f"-fix{fix}" if fix else "")


# per turn and slot: (gen_id, accuracy, reward, advanced, skipped, attempts); by hand from the rule (start: WRONG, 0):
# turn 0 best 0, previous 0: EXACT 1 > 0 -> 1; PLUS 0.5 > 0 -> 1; BROKEN_A skipped after 2 repairs
# turn 1 (EXACT advanced) best 1, previous 1: PLUS 0.5 -> 0; WRONG 0 -> 0 - 0.1; BROKEN_B's repair PLUS 0.5 -> 0
# turn 2 (PLUS of slot 0 advanced: the first of the ties) best 1, previous 0.5: WRONG -> -0.1; THREE 0.75 -> 0.5;
#   EXACT 1 is not above the best 1 but above 0.5 -> 0.5, and advances
EXPECTED = [
    (0, 0, cid(0, 0), 1.0, 1.0, True, False, 0), (0, 1, cid(0, 1), 0.5, 1.0, False, False, 0),
    (0, 2, cid(0, 2, 2), None, None, False, True, 2),
    (1, 0, cid(1, 0), 0.5, 0.0, True, False, 0), (1, 1, cid(1, 1), 0.0, -0.1, False, False, 0),
    (1, 2, cid(1, 2, 1), 0.5, 0.0, False, False, 1),
    (2, 0, cid(2, 0), 0.0, -0.1, False, False, 0), (2, 1, cid(2, 1), 0.75, 0.5, False, False, 0),
    (2, 2, cid(2, 2), 1.0, 0.5, True, False, 0),
]
PARENTS = {0: None, 1: cid(0, 0), 2: cid(1, 0)}  # turn t's state is turn t-1's advanced candidate
STATE = {0: (0.0, 0.0), 1: (1.0, 1.0), 2: (0.5, 1.0)}  # (previous, best_before)


def _turns(st: Store) -> list[tuple]:
    df = st.read("turns", "rf", 0).sort(["turn", "slot"])
    return [(r["turn"], r["slot"], r["gen_id"], r["accuracy"], r["reward"], r["advanced"], r["skipped"], r["attempts"])
            for r in df.iter_rows(named=True)]


def _assert_turns(st: Store) -> None:
    got = _turns(st)
    assert [g[:3] + g[5:] for g in got] == [e[:3] + e[5:] for e in EXPECTED]
    for g, e in zip(got, EXPECTED, strict=True):
        assert g[3] == pytest.approx(e[3]) and g[4] == pytest.approx(e[4]), (g, e)
    df = st.read("turns", "rf", 0)
    for r in df.iter_rows(named=True):
        assert r["task_id"] == TASK and r["parent_id"] == PARENTS[r["turn"]]
        assert (r["previous"], r["best_before"]) == STATE[r["turn"]]
        assert r["items"] == (0 if r["skipped"] else 4)
        assert r["root_id"] == candidate_id(0, TASK, r["turn"], r["slot"])


@pytest.mark.usefixtures("shared_sandbox")
def test_refine_turns_skip_repair_rewards_scores_and_curation(tmp_path, monkeypatch):
    from pipeline.core.grpo import group_advantages
    from pipeline.stages.curate import run_curate
    from pipeline.stages.score import run_score

    ctx = _ctx(tmp_path)
    gen = Scripted()
    out = _rollout(monkeypatch, ctx, gen)
    st = Store(tmp_path)
    _assert_turns(st)
    assert (out["tasks"], out["turns"], out["candidates"], out["skipped"], out["advanced"]) == (1, 3, 9, 1, 3)
    assert out["repairs"] == 3 and out["workflows"] == 12  # 9 candidates + 2 repairs of BROKEN_A + 1 of BROKEN_B
    # generations: the task id as query_id, the state's workflow as parent, the turn, repairs chained
    gens = {r["gen_id"]: r for r in st.read("generations", "rf", 0).iter_rows(named=True)}
    assert {r["query_id"] for r in gens.values()} == {TASK}
    for t in range(3):
        for k in range(3):
            g = gens[cid(t, k)]
            assert (g["turn"], g["slot"], g["parent_id"], g["attempt"], g["repair_of"]) == (t, k, PARENTS[t], 0, None)
            assert g["prompt_token_ids"] == [1, 2, 3] and g["token_ids"] == [4, 5]
    assert (gens[cid(0, 2, 2)]["repair_of"], gens[cid(0, 2, 2)]["turn"]) == (cid(0, 2, 1), 0)
    assert (gens[cid(1, 2, 1)]["repair_of"], gens[cid(1, 2, 1)]["parent_id"]) == (cid(1, 2), cid(0, 0))
    # the state prompts showed the current workflow, its accuracy and failure cases (the gold answer included)
    states = [p for p in gen.prompts if "Refinement turn" in p]
    assert len(states) == 3 and "return 'x'" in states[0] and "Validation accuracy: 0.00 (0 of 4 correct)" in states[0]
    assert "Failed cases (2 of 4):" in states[0] and "Correct answer:" in states[0]
    assert "eval(problem)) if '+' in problem" in states[2] and "Validation accuracy: 0.50 (2 of 4 correct)" in states[2]
    assert "Accuracy so far: start 0.00, turn 1 1.00, turn 2 0.50; best 1.00." in states[2]
    # checks: one validation run per (validated workflow, item) with the item's metric, self-checks on the first item
    checks = st.read("checks", "rf", 0)
    val = checks.filter(checks["purpose"] == "refine")
    assert val.height == 4 * (1 + 8) and val.select("gen_id", "query_id").unique().height == val.height
    assert set(val["query_id"]) == {"q0", "q1", "q2", "q3"}
    three = val.filter(val["gen_id"] == cid(2, 1)).sort("query_id")
    assert three["reward"].to_list() == [1.0, 1.0, 1.0, 0.0]
    selfc = checks.filter(checks["purpose"] == "repair")
    assert selfc.height == 12 and set(selfc["query_id"]) == {"q0"}

    # the score stage: nothing runs, the accuracy is the score
    res = run_score(ctx)
    assert res["ran"] == 0 and res["written"] == 12 and ctx.done("score")
    scores = {r["gen_id"]: r for r in st.generation_scores("rf", 0, 1, set()).iter_rows(named=True)}
    assert scores[cid(2, 1)]["score"] == pytest.approx(0.75) and scores[cid(1, 2, 1)]["score"] == 0.5
    assert scores[cid(1, 2)]["score"] == 0.0 and not scores[cid(1, 2)]["final"]  # the broken original of a repair
    assert scores[cid(0, 2, 2)]["score"] == 0.0 and scores[cid(0, 2, 2)]["final"]  # the skipped candidate
    assert run_score(ctx)["written"] == 0  # re-running writes nothing
    usage = st.sql("SELECT sum(llm_calls) n FROM latest_scores WHERE run_id = 'rf'")["n"][0]
    assert usage == 0  # executor usage stays with the checks rows

    # curation: per turn a weighted row (exp(RLAO / 0.4)) and a GRPO group row over the non-skipped candidates
    counts = run_curate(ctx)
    assert {k: counts[k] for k in ("level", "tasks", "turns", "candidates", "skipped", "advanced")} == {
        "level": "refine", "tasks": 1, "turns": 3, "candidates": 9, "skipped": 1, "advanced": 3}
    groups = {r["group_id"]: r for r in st.read("groups", "rf", 0).iter_rows(named=True)}
    assert sorted(groups) == sorted(f"{TASK}/t{t}/{k}" for t in range(3) for k in ("weighted", "group"))
    w = {t: groups[f"{TASK}/t{t}/weighted"] for t in range(3)}
    assert w[0]["members"] == [cid(0, 0), cid(0, 1)] and w[0]["member_scores"] == [1.0, 0.5]
    assert w[0]["weights"] == pytest.approx([math.exp(2.5), math.exp(2.5)])  # r = 1, 1
    assert w[1]["members"] == [cid(1, 0), cid(1, 1), cid(1, 2, 1)]
    assert w[1]["weights"] == pytest.approx([1.0, math.exp(-0.25), 1.0])  # r = 0, -0.1, 0
    assert w[2]["weights"] == pytest.approx([math.exp(-0.25), math.exp(1.25), math.exp(1.25)])  # r = -0.1, 0.5, 0.5
    assert all(r["kind"] == "weighted" and r["kept"] and r["level"] == "flat" for r in w.values())
    g1 = groups[f"{TASK}/t1/group"]
    assert g1["kind"] == "group" and g1["kept"] and g1["members"] == w[1]["members"]
    assert g1["advantages"] == pytest.approx(group_advantages([0.5, 0.0, 0.5], 1e-6).tolist())
    assert g1["kl_mask"] == [True, False, True] and g1["variance"] == pytest.approx(np.var([0.5, 0.0, 0.5]))

    # SQL over the catalog: turns with rewards, repairs and skips
    per_turn = st.sql("SELECT turn, count(*) n, count(*) FILTER (WHERE skipped) skipped, sum(attempts) repairs, "
                      "max(accuracy) FILTER (WHERE advanced) state_next FROM turns WHERE run_id = 'rf' "
                      "GROUP BY turn ORDER BY turn")
    assert per_turn.rows() == [(0, 3, 1, 2, 1.0), (1, 3, 0, 1, 0.5), (2, 3, 0, 0, 1.0)]
    repairs = st.sql("SELECT g.gen_id, g.repair_of, g.attempt, c.status FROM generations g JOIN checks c "
                     "ON c.run_id = g.run_id AND c.gen_id = g.gen_id AND c.purpose = 'repair' "
                     "WHERE g.run_id = 'rf' AND g.repair_of IS NOT NULL ORDER BY g.gen_id")
    assert repairs.rows() == [(cid(0, 2, 1), cid(0, 2), 1, "exec_error"), (cid(0, 2, 2), cid(0, 2, 1), 2, "exec_error"),
                              (cid(1, 2, 1), cid(1, 2), 1, "ok")]


@pytest.mark.usefixtures("shared_sandbox")
def test_refine_resumes_an_interrupted_turn_without_duplicates(tmp_path, monkeypatch):
    ctx = _ctx(tmp_path)
    with pytest.raises(RuntimeError, match="killed mid-turn"):
        _rollout(monkeypatch, ctx, Scripted(crash_on="[][1]"))  # dies repairing turn 1's broken candidate
    st = Store(tmp_path)
    assert st.manifest("rf", 0, "rollout") is None
    assert sorted(set(st.read("turns", "rf", 0)["turn"])) == [0]  # turn 1 was sampled and self-checked, not finished
    assert {cid(1, k) for k in range(3)} <= set(st.read("generations", "rf", 0)["gen_id"])
    before = {t: sorted(p.name for p in st.parts(t, "rf", 0)) for t in ("generations", "checks", "turns")}
    gen = Scripted()
    out = _rollout(monkeypatch, ctx, gen)
    assert st.manifest("rf", 0, "rollout") is not None and out["candidates"] == 9
    # the resumed run sampled only what was missing: turn 1's repair, then turn 2; nothing of turn 0 again
    assert ["failed its check" in p for p in gen.prompts] == [True, False]
    assert "Refinement turn 3 of 3" in gen.prompts[1]
    for t, parts in before.items():
        assert set(parts) <= {p.name for p in st.parts(t, "rf", 0)}, f"{t}: a part of the first attempt was lost"
    gens = st.read("generations", "rf", 0)
    assert gens["gen_id"].n_unique() == gens.height == 12
    checks = st.read("checks", "rf", 0)
    assert checks.select("gen_id", "query_id", "purpose").unique().height == checks.height
    _assert_turns(st)  # the same turns as an uninterrupted run
    assert len(st.read("turns", "rf", 0)) == 9
    # a third run finds every turn done and samples nothing
    assert _rollout(monkeypatch, ctx, gen)["sampled_now"] == 0 and len(gen.prompts) == 2


# ---- one real round on the embedded model (slow) ---------------------------------------------------------------------


@pytest.mark.slow
def test_refine_round_on_the_embedded_model(tmp_path):
    """SmolLM2-135M writes the workflows and executes them: T=2 turns x K=2 candidates of one task of 2 items, one
    repair allowed; the stages run in this process (the Prefect path of the same stages in child processes is
    tests/test_flows.py::test_one_real_round_end_to_end's check). The tiny model's samples decide how many
    candidates are repaired or skipped, so the SQL checks that the numbers add up. Two turns, not three: turn 1
    already refines turn 0's state (each turn costs the same decoding), and a third turn's bookkeeping is the
    scripted tests' (T=3) above."""
    import yaml

    from pipeline.run import open_run
    from pipeline.stages.rounds import direct_call
    from pipeline.stages.runner import RetryPolicy

    data = yaml.safe_load((REPO / "tests" / "data" / "tiny_flow.yaml").read_text())
    data.update(run_id="refine-e2e", store={"root": str(tmp_path / "runs")})
    data["benchmark"]["max_queries"] = 2
    data["generator"].update(max_new_tokens=48, temperature=1.0)
    data["rollout"] = {"mode": "refine", "repair_attempts": 1,
                       "workflow_prefix": "```python\nasync def solve(problem):\n    ",
                       "refine": {"turns": 2, "candidates": 2, "task_size": 2, "failure_cases": 1}}
    data["training"]["objective"] = "rwr"
    cfg = tmp_path / "refine.yaml"
    cfg.write_text(yaml.safe_dump(data))
    ctx = open_run(cfg, "refine-e2e")

    call = direct_call(RetryPolicy(1, 1.0), isolate=False)
    res = [call(stage=s, run_id=ctx.run_id, round=0, store_root=str(ctx.store.root), sets=None)
           for s in ("rollout", "score", "curate", "train")]
    assert [r.skipped for r in res] == [False, False, False, False]
    st = Store(tmp_path / "runs")
    turns = st.sql("SELECT turn, count(*) n, count(*) FILTER (WHERE skipped) skipped, "
                   "count(*) FILTER (WHERE advanced) advanced, sum(attempts) repairs FROM turns "
                   "WHERE run_id = 'refine-e2e' GROUP BY turn ORDER BY turn")
    assert turns["turn"].to_list() == [0, 1] and turns["n"].to_list() == [2, 2]
    for r in turns.iter_rows(named=True):
        assert r["advanced"] == (1 if r["skipped"] < 2 else 0)  # one advances unless all were skipped
    n_repairs = st.sql("SELECT count(*) n FROM generations WHERE run_id = 'refine-e2e' AND repair_of IS NOT NULL")
    assert n_repairs["n"][0] == turns["repairs"].sum()  # every repair row is one of a candidate's attempts
    gens = st.sql("SELECT count(*) n, count(DISTINCT turn) t, count(DISTINCT query_id) q FROM generations "
                  "WHERE run_id = 'refine-e2e'").row(0)
    assert gens == (4 + n_repairs["n"][0], 2, 1)
    skipped = turns["skipped"].sum()
    odd = st.sql("SELECT count(*) n FROM turns WHERE run_id = 'refine-e2e' AND skipped AND attempts <> 1")["n"][0]
    assert odd == 0  # a skipped candidate used its one repair first
    val = st.sql("SELECT count(*) n FROM checks WHERE run_id = 'refine-e2e' AND purpose = 'refine'")["n"][0]
    assert val == 2 * (1 + 4 - skipped)  # the start and every candidate not skipped, on both items
    sc = st.sql("SELECT count(*) n FROM generation_scores WHERE run_id = 'refine-e2e' AND score IS NOT NULL")["n"][0]
    assert sc == gens[0]
    cur = st.manifest("refine-e2e", 0, "curate")["counts"]
    assert (cur["level"], cur["candidates"], cur["skipped"], cur["turns"]) == ("refine", 4, skipped, 2)
    kinds = st.sql("SELECT kind, count(*) n FROM groups WHERE run_id = 'refine-e2e' GROUP BY kind")
    assert dict(kinds.rows()).get("weighted") == 2
    # RLAO: the train stage regresses on the kept weighted rows' candidates, weights exp(r / 0.4)
    trained = st.sql("SELECT coalesce(sum(len(members)), 0) n FROM groups WHERE run_id = 'refine-e2e' AND kept "
                     "AND kind = 'weighted'")["n"][0]
    tr = st.manifest("refine-e2e", 0, "train")["counts"]
    assert tr["objective"] == "rwr" and tr["sequences"] == trained
    assert (st.checkpoint_dir("refine-e2e", 0) / "adapter_model.safetensors").is_file()
