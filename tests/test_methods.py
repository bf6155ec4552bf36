"""`pipeline compare-methods` (pipeline.studies.methods): the method registry's overlays, and the whole comparison on
configs/smoke.yaml with the real runner, manifests, evaluation runs, baselines and summary, where the four stage
functions are fakes that write rows with known scores (as tests/test_flows.py's experiment test), so every held-out
number and paired difference is known by hand."""

from __future__ import annotations

import dataclasses
import json

import polars as pl
import pytest

from pipeline import stages
from pipeline.config import ConfigError, as_sets, load_config, with_changes
from pipeline.engines.workflow import extract_code
from pipeline.run import open_run
from pipeline.stages.rounds import direct_call
from pipeline.stages.runner import RetryPolicy
from pipeline.store import CATALOG, Store
from pipeline.studies import methods as mm
from pipeline.studies.baselines import TASK_BEST
from pipeline.studies.summaries import BEST_FIXED_ARM

CONFIGS = ("configs/smoke.yaml", "configs/gsm-learn.yaml")


# ---- the registry ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS)
def test_every_methods_overlay_is_a_valid_config_of_its_paper(config):
    want = {"spogw": ("flat", "iogrpo_mkl", "previous"), "two_level": ("two_level", "iogrpo_mkl", "previous"),
            "w4s": ("refine", "rwr", "previous"), "scoreflow": ("flat", "score_dpo", "base"),
            "flowreasoner": ("flat", "grpo", "previous")}
    assert set(mm.METHODS) == {*want, "smc", "task_best"}
    for name, m in mm.METHODS.items():
        cfg = load_config(config, mm.method_sets(m, [], {"generator.seed": 1}, 3e-4 if m.trained else None))
        assert cfg.generator.seed == 1
        if not m.trained:
            assert m.changes == {} and cfg.rollout.mode == load_config(config).rollout.mode
            continue
        assert (cfg.rollout.mode, cfg.training.objective, cfg.training.reference) == want[name]
        assert cfg.training.lr == 3e-4
    fr = with_changes(load_config(config), mm.METHODS["flowreasoner"].changes).scoring.reward
    assert (fr.complexity_weight, fr.cost_weight, fr.diversity_weight) == (0.1, 0.1, 0.1)
    assert with_changes(load_config(config), mm.METHODS["spogw"].changes).training.kl_mask
    assert mm.METHODS["w4s"].evaluations == ("sample", "refined") and mm.METHODS["w4s"].arm("refined") == "w4s/refined"
    # held-out evaluations score the metric alone: FlowReasoner's evaluation has no reward shaping
    base = load_config(config)
    ev = with_changes(base, mm.METHODS["flowreasoner"].changes | mm.arm_eval_changes(base))
    assert (ev.scoring.reward.complexity_weight, ev.scoring.reward.cost_weight,
            ev.scoring.reward.diversity_weight) == (0, 0, 0)


def test_a_methods_swept_lr_stays_a_float_until_its_runs_get_it_as_text():
    """A method arm's variant is typed: the swept learning rate is the float 2e-4 in its changes and in the config
    `with_changes` makes; only the overrides its runs get are text, and they read back as the same config."""
    from pipeline.studies.experiment import seed_changes

    base = load_config("configs/smoke.yaml")
    changes = mm.method_changes(mm.METHODS["scoreflow"], seed_changes(1), 2e-4)
    assert changes == {"generator.seed": 1, "training.seed": 1, "curation.seed": 1, "rollout.mode": "flat",
                       "rollout.exemplars": "none", "training.objective": "score_dpo", "training.reference": "base",
                       "training.lr": 2e-4}
    assert type(changes["training.lr"]) is float and type(changes["generator.seed"]) is int
    variant = with_changes(base, changes)
    assert (variant.training.lr, variant.generator.seed, variant.training.objective) == (2e-4, 1, "score_dpo")
    text = mm.method_sets(mm.METHODS["scoreflow"], ["rounds=1"], seed_changes(1), 2e-4, ["training.beta=0.5"])
    assert text[0] == "rounds=1" and "training.lr=0.0002" in text and text[-1] == "training.beta=0.5"
    typed = with_changes(base, {"rounds": 1} | changes | {"training.beta": 0.5})
    assert load_config("configs/smoke.yaml", text) == typed


def test_two_level_shape_and_arm_sets():
    assert [mm.two_level_shape(L) for L in (1, 2, 4, 6, 8, 9)] == [(1, 1), (2, 1), (2, 2), (3, 2), (4, 2), (3, 3)]
    cfg = with_changes(load_config("configs/smoke.yaml"), mm.METHODS["two_level"].changes | {"experiment.eval_l": 6})
    changes = mm.arm_eval_changes(cfg)
    assert (changes["rollout.n_agents"], changes["rollout.n_workflows"]) == (3, 2)
    assert mm.parse_arm_sets(["w4s:training.lr=5e-4", "w4s:rollout.refine.turns=2", "spogw:training.beta=0"]) == {
        "w4s": ["training.lr=5e-4", "rollout.refine.turns=2"], "spogw": ["training.beta=0"]}
    with pytest.raises(ValueError, match="unknown method 'ppo'"):
        mm.parse_arm_sets(["ppo:training.lr=1"])
    with pytest.raises(ValueError, match="expected METHOD:key.path=value"):
        mm.parse_arm_sets(["training.lr=1"])
    with pytest.raises(ValueError, match="reserved"):
        mm.register_method(mm.Method("base", "x"))


# ---- the comparison with fake stages --------------------------------------------------------------------------------

REFINE_CANDIDATES = [(0, 0, 0.25), (0, 1, 0.75), (1, 0, 0.75), (1, 1, None)]  # (turn, slot, accuracy; None: skipped)
PROGRAM_SCORES = {"cot": 0.75, "refined": 0.5}  # baseline runs (fixed programs) by label; others 0.25


def trained_score(cfg, qi: int, agent: int) -> float:
    """A checkpoint's score on the qi-th held-out query (the base model: 0, 0.5, 0, ...)."""
    t = cfg.training
    if cfg.rollout.mode == "two_level":
        return 1.0 if agent == 0 else 0.0  # Mean@L 0.5, Sel@L = Best@L = 1
    return {"iogrpo_mkl": 1.0 if t.lr >= 2e-4 else 0.5, "score_dpo": 0.25 if qi % 2 == 0 else 1.0, "rwr": 0.5,
            "grpo": 0.75}[t.objective]


class Fakes:
    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def make(self, stage):
        def fn(ctx, only_failed=False, shard=None):
            self.calls.append((ctx.run_id, stage))
            if stage == "rollout":
                self.rollout(ctx)
            elif stage == "score":
                self.score(ctx)
            elif stage == "train":
                ctx.store.checkpoint_dir(ctx.run_id, ctx.round).mkdir(parents=True)
            ctx.finish(stage, rows=1)
            return {"rows": 1}
        return fn

    def rollout(self, ctx):
        from pipeline.engines.benchmarks import load_benchmark

        items, ro, st = load_benchmark(ctx.cfg.benchmark).items(), ctx.cfg.rollout, ctx.store
        rows = []
        if ro.mode == "refine":
            task = f"task:{items[0].id}+{len(items)}"
            turns = []
            for turn, slot, acc in REFINE_CANDIDATES:
                gid = f"c{turn}{slot}"
                rows.append({"gen_id": gid, "kind": "workflow", "query_id": task, "valid": True, "turn": turn,
                             "text": f"```python\nasync def solve(problem):\n    return '{gid}'\n```"})
                turns.append({"task_id": task, "turn": turn, "slot": slot, "gen_id": gid, "accuracy": acc,
                              "previous": 0.5 if turn == 0 else 0.75, "skipped": acc is None, "advanced": False})
            st.write("turns", turns, ctx.run_id, ctx.round)
        for it in items if ro.mode != "refine" else []:
            if ro.mode == "two_level":
                for a in range(ro.n_agents):
                    rows.append({"gen_id": f"{it.id}-a{a}", "kind": "agent", "query_id": it.id, "valid": True})
                    rows += [{"gen_id": f"{it.id}-a{a}-w{w}", "kind": "workflow", "query_id": it.id, "valid": True,
                              "parent_id": f"{it.id}-a{a}"} for w in range(ro.n_workflows)]
            else:
                rows += [{"gen_id": f"{it.id}-w{j}", "kind": "workflow", "query_id": it.id, "valid": True}
                         for j in range(ro.m)]
        st.write("generations", rows, ctx.run_id, ctx.round)

    def score(self, ctx):
        gens = ctx.store.read("generations", ctx.run_id, ctx.round).filter(pl.col("kind") == "workflow")
        index = {q: i for i, q in enumerate(sorted(set(gens["query_id"].to_list())))}
        rows = []
        for g in gens.iter_rows(named=True):
            qi = index[g["query_id"]]
            if g["backend"] == "baseline":
                s = PROGRAM_SCORES.get(g["model"], 0.25)
            elif ctx.cfg.generator.adapter is None:
                s = 0.5 * (qi % 2)
            else:
                s = trained_score(ctx.cfg, qi, int(g["gen_id"].split("-a")[-1][0]) if "-a" in g["gen_id"] else 0)
            rows.append({"gen_id": g["gen_id"], "rep": 0, "attempt": 0, "status": "ok", "score": s, "metric": s,
                         "answer": str(s)})
        ctx.store.write("scores", rows, ctx.run_id, ctx.round)

    def install(self, monkeypatch):
        # the `duckdb` CLI's catalog file, which `finish` rebuilds after every stage (tested in tests/test_store.py
        # and tests/test_cli.py), is not rebuilt: nothing here reads it (`Store.sql` makes its own views)
        monkeypatch.setattr(Store, "refresh_catalog", lambda self: self.root / CATALOG)
        for name, st in list(stages.STAGES.items()):
            monkeypatch.setitem(stages.STAGES, name, dataclasses.replace(st, fn=self.make(name), isolated=False,
                                                                         checkpoint=False))
        return self


def _sets(tmp_path, *more):
    return [f"store.root={tmp_path}", "rounds=1", "tracking=[]", "benchmark.max_queries=4", "experiment.eval_queries=2",
            "experiment.eval_l=4", "experiment.bootstrap=200", *more]


def _timings(store: Store, run: str) -> list[dict]:
    return [json.loads(x) for x in (store.run_dir(run) / "timings.jsonl").read_text().splitlines()]


def test_compare_methods_end_to_end_pairs_by_hand_and_resumes(tmp_path, monkeypatch):
    fakes = Fakes().install(monkeypatch)
    names = ["spogw", "two_level", "w4s", "scoreflow", "flowreasoner", "task_best"]
    call = direct_call(RetryPolicy(retries=0, delay_s=0))
    out = mm.run_methods("configs/smoke.yaml", call, names, seeds=1, run_id="cm", sets=_sets(tmp_path))
    st = Store(tmp_path)
    body = json.loads((tmp_path / "experiments" / "cm-methods" / "methods.json").read_text())
    arms = {a["arm"]: a for a in body["arms"]}
    assert list(arms) == ["base", "spogw", "two_level", "w4s", "w4s/refined", "scoreflow", "flowreasoner", "task_best"]
    assert all(a["n"] == 2 and a["seeds"] == [0] for a in arms.values())  # 2 held-out queries x 1 seed per arm
    got = {a: (x["mean_at_l"], x["best_at_l"], x.get("select_at_l")) for a, x in arms.items()}
    assert got == {"base": (0.25, 0.25, None), "spogw": (1.0, 1.0, None), "two_level": (0.5, 1.0, 1.0),
                   "w4s": (0.5, 0.5, None), "w4s/refined": (0.5, 0.5, None), "scoreflow": (0.625, 0.625, None),
                   "flowreasoner": (0.75, 0.75, None), "task_best": (0.75, 0.75, None)}

    # every paired difference is the mean of the stored per-query differences of the same seed and query
    pq = {(r["arm"], r["seed"], r["query_id"]): r for r in body["per_query"]}
    for p in body["paired"]:
        diffs = [r[p["metric"]] - pq[(p["against"], s, q)][p["against_metric"]]
                 for (a, s, q), r in pq.items() if a == p["arm"]]
        assert p["n"] == len(diffs) == 2 and p["mean"] == pytest.approx(sum(diffs) / len(diffs)), p
    paired = {(p["arm"], p["against"], p["metric"]): p for p in body["paired"]}
    # by hand: scoreflow (0.25, 1.0) - base (0, 0.5) = (0.25, 0.5); two-level's Sel@L (1, 1) against base's Mean@L
    assert paired[("scoreflow", "base", "mean_at_l")]["mean"] == pytest.approx(0.375)
    assert paired[("scoreflow", "spogw", "mean_at_l")]["mean"] == pytest.approx(-0.375)
    sel = paired[("two_level", "base", "select_at_l")]
    assert (sel["against_metric"], sel["mean"]) == ("mean_at_l", 0.75)
    assert paired[("task_best", "spogw", "mean_at_l")]["mean"] == pytest.approx(-0.25)
    # against the best fixed workflow chosen on dev (task_best: 0.75 on both queries), the baseline of that name
    assert paired[("spogw", "task_best", "mean_at_l")]["mean"] == pytest.approx(0.25)
    assert paired[("scoreflow", "task_best", "mean_at_l")]["mean"] == pytest.approx(0.625 - 0.75)
    assert ("task_best", "task_best", "mean_at_l") not in paired and BEST_FIXED_ARM == TASK_BEST
    table = (tmp_path / "experiments" / "cm-methods" / "methods.md").read_text()
    assert "Mean@L vs task_best" in table
    # smc, the one registered method not chosen, is named as not run
    assert body["not_run"] == ["smc"] and "Not run in this comparison (left out by --methods" in table
    assert ("spogw", "spogw", "mean_at_l") not in paired and not any(p["arm"] == "base" for p in body["paired"])

    # the runs: shared base per seed, arms with their overlays, evaluations scored by the metric alone
    runs = {r["arm"]: r for r in body["per_seed"]}
    # the base model's evaluation is `pipeline experiment`'s (run cm-s0); spogw changes smoke.yaml: its own run
    assert runs["base"]["eval_run_id"] == "cm-s0-eval-base" and runs["spogw"]["train_run_id"] == "cm-spogw-s0"
    cfg = open_run(None, "cm-scoreflow-s0", 0, store_root=str(tmp_path)).cfg
    assert (cfg.training.objective, cfg.training.reference, cfg.generator.seed) == ("score_dpo", "base", 0)
    assert open_run(None, "cm-flowreasoner-s0", 0, store_root=str(tmp_path)).cfg.scoring.reward.complexity_weight == 0.1
    ev = open_run(None, runs["flowreasoner"]["eval_run_id"], 0, store_root=str(tmp_path)).cfg
    assert ev.scoring.reward.complexity_weight == 0 and ev.benchmark.train_split == "test"
    tl = open_run(None, runs["two_level"]["eval_run_id"], 0, store_root=str(tmp_path)).cfg.rollout
    assert (tl.mode, tl.n_agents, tl.n_workflows) == ("two_level", 2, 2)  # N_A x N_W = L = 4

    # W4S: refined on the validation split with the checkpoint, the best validated candidate (c01: 0.75, earlier
    # than c10) run L times on each test query
    ref = runs["w4s/refined"]
    assert (ref["validation_run_id"], ref["validation_split"]) == ("cm-w4s-s0-eval-validate-r0-refine", "validate")
    assert ref["selected"] | {"task_id": None} == {"gen_id": "c01", "task_id": None, "turn": 0, "slot": 1,
                                                    "accuracy": 0.75, "start_accuracy": 0.5, "candidates": 3}
    vcfg = open_run(None, ref["validation_run_id"], 0, store_root=str(tmp_path)).cfg
    assert (vcfg.rollout.mode, vcfg.benchmark.train_split, vcfg.rollout.refine.task_size) == ("refine", "validate", 4)
    assert vcfg.generator.adapter == str(st.checkpoint_dir("cm-w4s-s0", 0))
    test = st.read("generations", ref["eval_run_id"], 0)
    assert test.height == 2 * 4 and set(test["text"]) == {extract_code("```python\nasync def solve(problem):\n"
                                                                        "    return 'c01'\n```")}

    # training wall time: the sum of the training run's stage wall seconds in its timings.jsonl
    lines = [t for t in _timings(st, "cm-spogw-s0") if not t["skipped"]]
    assert [t["stage"] for t in lines] == ["rollout", "score", "curate", "train"]
    assert runs["spogw"]["train_wall_s"] == pytest.approx(sum(t["wall_s"] for t in lines), abs=0.1)
    assert runs["task_best"]["train_wall_s"] is None
    # evaluation wall time: the evaluation run's sampling and scoring, or its scoring alone for a fixed program
    # (the summary rounds seconds to one decimal)
    ev = [t for t in _timings(st, runs["spogw"]["eval_run_id"]) if not t["skipped"]]
    assert [t["stage"] for t in ev] == ["rollout", "score"]
    assert runs["spogw"]["eval_wall_s"] == pytest.approx(ev[0]["wall_s"] + ev[1]["wall_s"], abs=0.05)
    fixed = [t for t in _timings(st, runs["task_best"]["eval_run_id"]) if not t["skipped"]]
    assert [t["stage"] for t in fixed] == ["score"]
    assert runs["task_best"]["eval_wall_s"] == pytest.approx(fixed[0]["wall_s"], abs=0.05)
    assert arms["spogw"]["eval_wall_s"] == runs["spogw"]["eval_wall_s"]  # one seed: its mean is itself
    md = (tmp_path / "experiments" / "cm-methods" / "methods.md").read_text()
    assert "| scoreflow | sample | 1 | 0.625 | 0.625 | 0.625 | n/a | +0.375 [" in md
    assert out.results.endswith("cm-methods")

    # `compare-methods --status` names the runs the comparison made, each stage done (so its time is known)
    rows = mm.status("configs/smoke.yaml", names, seeds=1, run_id="cm", sets=_sets(tmp_path))
    assert all(r["done"] for r in rows), [r for r in rows if not r["done"]]
    assert list(dict.fromkeys((r["part"], r["run_id"]) for r in rows)) == [
        ("evaluate", "cm-s0-eval-base"), ("train", "cm-spogw-s0"), ("evaluate", "cm-spogw-s0-eval-r0"),
        ("train", "cm-two_level-s0"), ("evaluate", "cm-two_level-s0-eval-r0"), ("train", "cm-w4s-s0"),
        ("evaluate", "cm-w4s-s0-eval-r0"), ("evaluate", "cm-w4s-s0-eval-validate-r0-refine"),
        ("evaluate", "cm-w4s-s0-baseline-refined"), ("train", "cm-scoreflow-s0"),
        ("evaluate", "cm-scoreflow-s0-eval-r0"), ("train", "cm-flowreasoner-s0"),
        ("evaluate", "cm-flowreasoner-s0-eval-r0"), ("reference", "cm-baseline-validate-select"),
        ("reference", "cm-baseline-task_best")]  # task_best: its selection (every candidate), then its winner
    assert {r["eval_run_id"] for r in body["per_seed"]} <= {r["run_id"] for r in rows}
    assert mm.status("configs/smoke.yaml", ["spogw"], seeds=2, run_id="cm", sets=_sets(tmp_path))[-1] == {
        "part": "evaluate", "run_id": "cm-spogw-s1-eval-r0", "round": 0, "stage": "score", "done": False,
        "wall_s": None, "machine": None, "workflows": 8, "saved_step": None}  # seed 1 not run: 2 queries x L = 4
    from typer.testing import CliRunner

    from pipeline.cli import app
    calls = list(fakes.calls)
    args = ["compare-methods", "configs/smoke.yaml", "--status", "--seeds", "2", "--run-id", "cm", "--methods", "spogw"]
    cli = CliRunner().invoke(app, args + [x for kv in _sets(tmp_path) for x in ("--set", kv)])
    # seed 1's 4 training stages and 2 of each evaluation, estimated from seed 0's stages of the same kind
    assert cli.exit_code == 0 and "8 of 16 stages left: about 0 min" in cli.output and "cm-spogw-s1" in cli.output
    assert fakes.calls == calls  # nothing ran

    # resume: a second call trains, rolls out and scores nothing; every stage is skipped by its manifest
    fakes.calls.clear()
    n_lines = len(_timings(st, "cm-spogw-s0"))
    again = mm.run_methods("configs/smoke.yaml", call, names, seeds=1, run_id="cm", sets=_sets(tmp_path))
    assert fakes.calls == []
    assert [t["skipped"] for t in _timings(st, "cm-spogw-s0")[n_lines:]] == [True] * 4
    assert [a.mean_at_l for a in again.arms] == [a["mean_at_l"] for a in body["arms"]]


def test_lr_sweep_chooses_on_dev_and_trains_the_arm_with_it(tmp_path, monkeypatch):
    Fakes().install(monkeypatch)
    call = direct_call(RetryPolicy(retries=0, delay_s=0))
    with pytest.raises(ConfigError, match="--lr-sweep chooses on the dev split"):
        mm.run_methods("configs/smoke.yaml", call, ["spogw"], seeds=1, run_id="sw", sets=_sets(tmp_path),
                       lr_sweep=[1e-4, 2e-4])
    sets = _sets(tmp_path, "benchmark.train_split=train", "benchmark.dev_share=0.5")
    out = mm.run_methods("configs/smoke.yaml", call, ["spogw"], seeds=1, run_id="sw", sets=sets,
                         lr_sweep=[1e-4, 2e-4, 5e-4])
    sweep = out.lr_sweep["spogw"]
    # the fake checkpoint scores 0.5 below lr 2e-4 and 1.0 from it: 2e-4 and 5e-4 tie, the first listed wins
    assert [(r.lr, r.mean_at_l) for r in sweep.runs] == [(1e-4, 0.5), (2e-4, 1.0), (5e-4, 1.0)]
    assert (sweep.chosen, sweep.split, out.lr) == (2e-4, "dev", {"spogw": 2e-4})
    assert [r.eval_run_id for r in sweep.runs] == ["sw-spogw-lr0.0001-s0-eval-dev-r0",
                                                          "sw-spogw-lr0.0002-s0-eval-dev-r0",
                                                          "sw-spogw-lr0.0005-s0-eval-dev-r0"]
    assert open_run(None, "sw-spogw-s0", 0, store_root=str(tmp_path)).cfg.training.lr == 2e-4
    swept = [r for r in mm.status("configs/smoke.yaml", ["spogw"], seeds=1, run_id="sw", sets=sets,
                                  lr_sweep=[1e-4, 2e-4, 5e-4]) if r["part"] == "lr sweep"]
    assert all(r["done"] for r in swept) and {r["run_id"] for r in swept} >= {r.eval_run_id for r in sweep.runs}
    held_out = {d.name for d in tmp_path.iterdir() if "-eval-" in d.name}
    assert {e for e in held_out if "-lr" in e} == {r.eval_run_id for r in sweep.runs}  # no sweep run on test
    assert json.loads((tmp_path / "experiments" / "sw-methods" / "methods.json").read_text())["lr"] == {"spogw": 2e-4}


def test_the_method_of_config_itself_reuses_the_experiment_run_of_its_seed(tmp_path, monkeypatch):
    """With smoke.yaml set to SPOGW's own settings, the spogw arm is `pipeline experiment`'s run: trained once, by
    whichever command comes first, the other skipping every stage."""
    from pipeline.studies.experiment import run_experiment

    fakes = Fakes().install(monkeypatch)
    call = direct_call(RetryPolicy(retries=0, delay_s=0))
    sets = _sets(tmp_path, *as_sets(mm.get_method("spogw").changes))
    run_experiment("configs/smoke.yaml", call, seeds=1, run_id="ex", sets=sets)
    trained = [c for c in fakes.calls if c[1] == "train"]
    assert len(trained) == 1
    fakes.calls.clear()
    out = mm.run_methods("configs/smoke.yaml", call, ["spogw"], seeds=1, run_id="ex", sets=sets)
    runs = {r.arm: r for r in out.per_seed}
    assert (runs["spogw"].train_run_id, runs["base"].eval_run_id) == ("ex-s0", "ex-s0-eval-base")
    assert fakes.calls == []  # trained and evaluated already by the experiment


def test_every_arm_is_compared_on_the_queries_all_hold(tmp_path):
    """The base model's evaluation holds 4 queries (the experiment's, which evaluated more), SPOGW's 2 (the
    comparison's eval_queries, a prefix): both are read on q1 and q2 only. By hand: the base's Mean@L there is
    (0 + 1) / 2 = 0.5 (q3 and q4 at 1 left out), its executor tokens (100 + 300) / 2 = 200 a query."""
    from pipeline.studies.summaries import ArmRun, EvalSummary

    def q(qid, mean, tokens):
        return {"query_id": qid, "mean_at_l": mean, "best_at_l": mean, "valid_share": 1.0, "gen_tokens_in": 0,
                "gen_tokens_out": 10, "exec_tokens_in": tokens, "exec_tokens_out": 0}

    base = EvalSummary(eval_run_id="b", queries=4, mean_at_l=0.75, valid_share=1.0, gen_tokens_per_query=10,
                       exec_tokens_per_query=400, per_query=[q("q1", 0.0, 100), q("q2", 1.0, 300), q("q3", 1.0, 500),
                                                            q("q4", 1.0, 700)])
    spogw = EvalSummary(eval_run_id="s", queries=2, mean_at_l=0.5, valid_share=1.0, gen_tokens_per_query=10,
                        exec_tokens_per_query=50, per_query=[q("q1", 1.0, 50), q("q2", 0.0, 50)])
    recs = [ArmRun(arm="base", method="base", evaluation="sample", seed=0, train_run_id=None, eval_run_id="b"),
            ArmRun(arm="spogw", method="spogw", evaluation="sample", seed=0, train_run_id=None, eval_run_id="s")]
    summaries = {"b": base, "s": spogw}
    keep = mm.shared_queries(recs, summaries)
    assert keep == {"q1", "q2"}
    empty = ArmRun(arm="w4s", method="w4s", evaluation="sample", seed=0, train_run_id=None, eval_run_id="e")
    assert mm.shared_queries([*recs, empty], {**summaries, "e": EvalSummary(eval_run_id="e", queries=0)}) == keep
    rows, row = mm.seed_rows(Store(tmp_path), recs[0], base, keep)
    assert [r["query_id"] for r in rows] == ["q1", "q2"]
    assert (row.queries, row.mean_at_l, row.exec_tokens_per_query, row.gen_tokens_per_query) == (2, 0.5, 200.0, 10.0)
    _, whole = mm.seed_rows(Store(tmp_path), recs[1], spogw, keep)  # nothing left out: the evaluation's own numbers
    assert (whole.queries, whole.exec_tokens_per_query) == (2, 50)


def test_an_evaluation_is_timed_only_when_each_of_its_stages_is(tmp_path):
    """eval_wall_s sums the evaluation run's stage lines, and is None while a stage its evaluation runs has none: an
    SMC run sampled before its sampling was timed has only its score line, and chunk lines are not the stage's."""
    from pipeline.stages.runner import StageResult, record_timing

    st = Store(tmp_path)
    record_timing(tmp_path, "r", StageResult("rollout", 0, False, 40.0, {}, shard="chunk 1/2"))
    record_timing(tmp_path, "r", StageResult("score", 0, False, 12.5, {}))
    assert mm.eval_wall_s(st, "r", "smc") is None and mm.eval_wall_s(st, "r", "task_best") == 12.5
    record_timing(tmp_path, "r", StageResult("rollout", 0, False, 70.3, {}))
    record_timing(tmp_path, "r", StageResult("score", 0, True, 0.0, {}))  # a resume's skip changes nothing
    assert mm.eval_wall_s(st, "r", "smc") == mm.eval_wall_s(st, "r", "sample") == 82.8  # 70.3 + 12.5


def test_design_counts_per_arm_on_the_kept_queries_pooled_over_seeds(tmp_path):
    """Held-out workflows per written design, counted by hand: only round 0's workflows (not agents), only the kept
    queries; a run without designs (fixed programs) has none; an arm pools its seeds' counts."""
    from pipeline.studies.summaries import MethodSeedRow

    st = Store(tmp_path)
    rows = [("g1", "workflow", "q1", "pot"), ("g2", "workflow", "q1", "pot"), ("g3", "workflow", "q2", "other"),
            ("g4", "workflow", "q3", "pot"), ("a1", "agent", "q1", None), ("g5", "workflow", "q2", "direct")]
    st.write("generations", [{"gen_id": g, "kind": k, "query_id": q, "slot": i, "valid": True, "text": "x",
                              "design": d} for i, (g, k, q, d) in enumerate(rows)], "ev", 0)
    st.write("generations", [{"gen_id": "f1", "kind": "workflow", "query_id": "q1", "slot": 0, "valid": True,
                              "text": "x", "design": None}], "fixed", 0)
    assert mm.design_counts(st, "ev") == {"direct": 1, "other": 1, "pot": 3}
    assert mm.design_counts(st, "ev", {"q1", "q2"}) == {"direct": 1, "other": 1, "pot": 2}
    assert mm.design_counts(st, "fixed") is None

    def row(seed, designs):
        return MethodSeedRow(arm="a", method="a", evaluation="sample", seed=seed, train_run_id=None,
                             eval_run_id=f"e{seed}", queries=2, designs=designs)

    assert mm.pooled_designs([row(0, {"pot": 2, "other": 1}), row(1, {"pot": 1, "direct": 4})]) == {
        "direct": 4, "other": 1, "pot": 3}
    assert mm.pooled_designs([row(0, None)]) is None


def test_a_run_of_fewer_methods_keeps_the_other_arms_of_the_summary(tmp_path, monkeypatch):
    """`--methods scoreflow` after a run of spogw and scoreflow: the summary still holds spogw, read again from its
    runs (the same numbers, by hand: 1.0 and 0.625), and pairs scoreflow with it; no stage of spogw runs again. A
    summary written for another L is replaced, not merged."""
    fakes = Fakes().install(monkeypatch)
    call = direct_call(RetryPolicy(retries=0, delay_s=0))
    mm.run_methods("configs/smoke.yaml", call, ["spogw", "scoreflow"], seeds=1, run_id="sub", sets=_sets(tmp_path))
    fakes.calls.clear()
    out = mm.run_methods("configs/smoke.yaml", call, ["scoreflow"], seeds=1, run_id="sub", sets=_sets(tmp_path))
    assert fakes.calls == []
    body = json.loads((tmp_path / "experiments" / "sub-methods" / "methods.json").read_text())
    # in the registry's order (spogw before scoreflow), as a run of both wrote them
    assert [(a["arm"], a["mean_at_l"]) for a in body["arms"]] == [("base", 0.25), ("spogw", 1.0),
                                                                  ("scoreflow", 0.625)]
    assert body["methods"] == out.methods == ["spogw", "scoreflow"] and "spogw" not in body["not_run"]
    paired = {(p["arm"], p["against"], p["metric"]): p["mean"] for p in body["paired"]}
    assert paired[("scoreflow", "spogw", "mean_at_l")] == pytest.approx(-0.375)
    assert [r["train_run_id"] for r in body["per_seed"]] == [None, "sub-spogw-s0", "sub-scoreflow-s0"]

    # another L: spogw's L=4 rows cannot pair with L=2 ones, so the old summary is replaced
    mm.run_methods("configs/smoke.yaml", call, ["scoreflow"], seeds=1, run_id="sub",
                   sets=_sets(tmp_path, "experiment.eval_l=2"))
    body = json.loads((tmp_path / "experiments" / "sub-methods" / "methods.json").read_text())
    assert [a["arm"] for a in body["arms"]] == ["base", "scoreflow"] and body["eval_l"] == 2


def test_a_resumed_run_keeps_a_summary_of_more_seeds_until_it_reaches_them(tmp_path, monkeypatch):
    """A resumed two-seed run passes seed 0 first: its interim write would replace the two-seed summary on disk with a
    one-seed one (as a crash during seed 1 would then leave it), so it writes only after its last seed. A first run
    writes after each seed; a run asking for fewer seeds than the summary holds replaces it at its end."""
    Fakes().install(monkeypatch)
    call = direct_call(RetryPolicy(retries=0, delay_s=0))
    writes: list[list[int]] = []
    real = mm.write_results

    def spy(store, summary, extra):
        writes.append(list(summary.seeds))
        return real(store, summary, extra)

    monkeypatch.setattr(mm, "write_results", spy)
    mm.run_methods("configs/smoke.yaml", call, ["spogw"], seeds=2, run_id="rs", sets=_sets(tmp_path))
    assert writes == [[0], [0, 1]]
    writes.clear()
    mm.run_methods("configs/smoke.yaml", call, ["spogw"], seeds=2, run_id="rs", sets=_sets(tmp_path))
    assert writes == [[0, 1]]
    body = json.loads((tmp_path / "experiments" / "rs-methods" / "methods.json").read_text())
    assert body["seeds"] == [0, 1]
    writes.clear()
    mm.run_methods("configs/smoke.yaml", call, ["spogw"], seeds=1, run_id="rs", sets=_sets(tmp_path))
    assert writes == [[0]]
