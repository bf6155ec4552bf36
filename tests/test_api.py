"""The Python API (docs/api.md): the page's examples run as written, one block after the other, on stand-in stages
whose train stage saves a real LoRA adapter of a tiny model; the page's tables name every public function of
pipeline.api with its signature; the CLI's summary line and the stored dict round-trip through EvalSummary."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from fake_run import fake_stage

from pipeline import api, stages
from pipeline.config import ConfigError
from pipeline.studies.summaries import EvalSummary

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def _train_with_adapter(model: str):
    """The fake train stage, then a LoRA adapter of `model` saved as the round's checkpoint."""
    train = fake_stage("train")

    def fn(ctx, only_failed=False):
        from peft import LoraConfig, get_peft_model

        from pipeline.engines.models import load_causal_lm

        out = train(ctx, only_failed)
        lora = get_peft_model(load_causal_lm(model, device="cpu"), LoraConfig(r=2, target_modules=["q_proj"]))
        lora.save_pretrained(ctx.store.checkpoint_dir(ctx.run_id, ctx.round))
        return out
    return fn


def test_the_worked_example_runs(tmp_path, monkeypatch, tiny_model, capsys):
    for name, st in list(stages.STAGES.items()):
        fn = _train_with_adapter(tiny_model) if name == "train" else fake_stage(name)
        monkeypatch.setitem(stages.STAGES, name, dataclasses.replace(st, fn=fn, isolated=False, checkpoint=False))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo.yaml").write_text(f"run_id: demo\nrounds: 1\nstore:\n  root: runs\n"
                                        f"generator:\n  model: {tiny_model}\n")
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:  # one after the other, as a notebook runs its cells
        exec(compile(block, str(DOC), "exec"), namespace)
    out = capsys.readouterr().out
    assert "rollout {'rows': 1}" in out and "train {'rows': 1}" in out
    assert f"nb {tiny_model}" in out
    assert "invalid" in out and "timeout" in out  # the fake score stage's status mix, as a frame
    store = api.open_store("runs")
    assert api.table(store, "generations", run_id="nb").height == 4
    assert api.table(store, "generations", run_id="nb", round=1).height == 0
    with pytest.raises(KeyError, match="unknown table"):
        api.table(store, "nope")
    with pytest.raises(ConfigError, match="not found"):
        api.run_config(store, "missing")
    with pytest.raises(ConfigError, match="no complete checkpoint for round 1"):
        api.round_policy(store, "nb", 1)
    tok, base = api.round_policy(store, "nb", -1)
    assert type(base).__name__ == "LlamaForCausalLM"
    # the second block: the trained round's evaluation (the stand-in scores round 0's adapter's first workflow 1.0:
    # q0 has 1.0 and 0.0, q1 a timeout and an invalid one), the comparison and the report
    evaluation = namespace["evaluation"]
    assert (evaluation.eval_run_id, evaluation.queries, evaluation.mean_at_l, evaluation.best_at_l) == (
        "nb-eval-r0", 2, 0.25, 0.5)
    assert "nb-eval-r0: 2 queries, Mean@L 0.250, Best@L 0.500" in out and "Mean@L 0.25 over 2 queries" in out
    rows = namespace["side_by_side"].rows
    assert [(r.run, r.mean_at_l) for r in rows] == [("nb-eval-r0", 0.25), ("nb", 0.125)]  # untrained: 0.5 not 1.0
    assert "| nb-eval-r0 |" in out and "same queries: True" in out
    assert Path(namespace["page"].report).is_file() and namespace["page"].kind == "run"


def _documented_functions() -> dict[str, str]:
    """function name -> the signature docs/api.md's tables give it (`name(args)` in a table row's first cell)."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)\((.*?)\)` \|", DOC.read_text(), re.M)}


def test_the_page_lists_every_function_of_the_api_with_its_signature():
    import inspect

    public = {name: fn for name, fn in vars(api).items() if inspect.isfunction(fn) and not name.startswith("_")
              and fn.__module__ in ("pipeline.api", "pipeline.run")}
    documented = _documented_functions()
    assert sorted(public) == sorted(documented)
    for name, args in documented.items():
        if "..." in args:  # a shortened row (`baselines(config, methods, ..., on_result=None)`): its names exist
            params = inspect.signature(public[name]).parameters
            assert all(a.split("=")[0].strip() in params for a in args.split(",") if a.strip() != "..."), name
            continue
        code = ", ".join(_as_written(p) for p in inspect.signature(public[name]).parameters.values())
        assert code == args, f"{name}: the page says ({args}), the code ({code})"


def _as_written(param) -> str:
    """A parameter as the page writes it: `name`, `name=default` (strings in double quotes), `**name`."""
    import inspect

    if param.kind is inspect.Parameter.VAR_KEYWORD:
        return f"**{param.name}"
    if param.default is inspect.Parameter.empty:
        return param.name
    return f"{param.name}={param.default!r}".replace("'", '"')


def test_eval_summary_round_trips_and_formats_its_line():
    stored = {"eval_run_id": "r-eval-r0", "queries": 2, "mean_at_l": 0.25, "best_at_l": 0.5, "majority_at_l": None,
              "valid_share": 0.75, "workflows": 4, "pending": 0, "gen_tokens_per_query": 12.0,
              "exec_tokens_per_query": None, "status": {"ok": 3, "timeout": 1}, "per_query": [],
              "selected": {"math": {"label": "io"}}}
    s = EvalSummary.from_dict(stored)
    assert s.to_dict() == stored and list(s.to_dict()) == list(stored)  # the same keys, in the same order
    assert s.extra == {"selected": {"math": {"label": "io"}}}
    assert s.line() == ("r-eval-r0: 2 queries, Mean@L 0.250, Best@L 0.500, Majority@L n/a, valid 0.75, "
                        "tokens/query generator 12 executor n/a, status {'ok': 3, 'timeout': 1}")
    two_level = EvalSummary.from_dict({**stored, "select_at_l": 1.0})
    assert "Best@L 0.500, Sel@L 1.000, Majority@L n/a" in two_level.line("workflow runs/query 2.0")
    assert two_level.line("workflow runs/query 2.0").endswith("n/a, workflow runs/query 2.0, status {'ok': 3, "
                                                              "'timeout': 1}")
