"""The report's per-query pages: their rows against the store, then the pages in a real headless browser."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from fake_run import install_fake_stages, write_config
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.stages.rounds import direct_call
from pipeline.stages.runner import RetryPolicy
from pipeline.store import Store
from pipeline.studies.browse import build_experiment_pages, build_run_pages, page_name
from pipeline.studies.experiment import run_experiment
from pipeline.studies.report import build_report

CHROMIUM = os.environ.get("PIPELINE_TEST_CHROMIUM", "/usr/bin/chromium")


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
    """One seed, one fake round, the base model and round 0 evaluated (tests/fake_run.py's rows); the tests only
    add pages, so they share it."""
    tmp_path = tmp_path_factory.mktemp("browse")
    with pytest.MonkeyPatch.context() as mp:
        install_fake_stages(mp)
        run_experiment(write_config(tmp_path, "tracking: []\n", rounds=1),
                       direct_call(RetryPolicy(delay_s=0), isolate=False))
    return Store(tmp_path / "runs")


def rows_of(page: str) -> dict[str, list[str]]:
    """The first table's rows, keyed by the workflow id, as cell texts."""
    table = page.split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    out = {}
    for tr in re.findall(r"<tr>(.*?)</tr>", table):
        cells = [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td>(.*?)</td>", tr)]
        out[cells[0]] = cells
    return out


def test_query_page_shows_each_workflow_with_its_store_rows(exp):
    index = build_run_pages(exp, "t-s0", 0)
    path = build_run_pages(exp, "t-s0", 0, "q0")  # one query: its page alone
    folder = exp.run_dir("t-s0") / "browse"
    assert index == folder / "index.html" and path == folder / page_name("r", 0, "q0")
    page = path.read_text()
    rows = rows_of(page)
    assert sorted(rows) == ["g0", "g1"]  # q1's workflows are on their own page
    # workflow, kind, slot, valid, status per rep, score, executor calls, tokens in, tokens out, groups
    assert rows["g0"][3:] == ["True", "ok", "0.5", "2", "200", "14", "q0-0 kept A=0.7"]
    assert rows["g1"][5:] == ["0", "1", "100", "7", "q0-0 kept A=-0.7"]
    assert "What is 0 + 40 + 2?" in page and "<div class=\"highlight\">" in page
    assert '<span class="k">async</span>' in page  # pygments marked the keyword
    q1 = (path.parent / page_name("r", 0, "q1")).read_text()
    assert "g3: score 0, valid False (syntax error)" in q1 and "q1-0 screened A=" in q1
    assert page_name("r", 0, "q1") in index.read_text() and (index.parent / "plotly.min.js").stat().st_size > 1_000_000


def test_experiment_pages_put_base_and_trained_side_by_side(exp):
    path = build_experiment_pages(exp, exp.root / "experiments" / "t", "q0")
    page = path.read_text()
    base, trained = page.split("<div class='cols'>", 1)[1].split("<h2>round 0: ", 1)
    assert "base model: t-s0-eval-base" in base and trained.startswith("t-s0-eval-r0")
    assert rows_of(base)["g0"][5] == "0.5" and rows_of(trained)["g0"][5] == "1"  # fake_run: a checkpoint scores 1
    assert "id='scores-0-g0'" in base and "id='scores-1-g0'" in trained  # each side's links land on its own card


def test_report_command_names_the_pages_and_refuses_an_unknown_query(exp):
    res = CliRunner().invoke(app, ["report", "t-s0", "--store", str(exp.root), "--round", "0", "--query", "q1"])
    assert res.exit_code == 0, res.output
    assert f"queries: {exp.run_dir('t-s0') / 'browse' / page_name('r', 0, 'q1')}" in res.output
    res = CliRunner().invoke(app, ["report", "t-s0", "--store", str(exp.root), "--query", "nope"])
    assert res.exit_code != 0 and "no scored workflows for query 'nope'" in res.output
    res = CliRunner().invoke(app, ["report", "t", "--store", str(exp.root)])
    assert res.exit_code == 0 and f"queries: {exp.root / 'experiments' / 't' / 'browse' / 'index.html'}" in res.output


def browser():
    """Debian's chromium driven by playwright (no browser download: it needs the network)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed: pip install -e '.[dev]' (the browser check did not run)")
    if not shutil.which(CHROMIUM) and not Path(CHROMIUM).is_file():
        pytest.skip(f"no browser at {CHROMIUM}: apt-get install -y chromium as root (scripts/setup.sh does), or "
                    "set PIPELINE_TEST_CHROMIUM (the browser check did not run)")
    return sync_playwright


def test_pages_render_in_headless_chromium(exp):
    sync_playwright = browser()
    run_pages = build_run_pages(exp, "t-s0")
    build_report(exp, "t-s0")
    compare = build_experiment_pages(exp, exp.root / "experiments" / "t", "q0")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])  # root in CI: no setuid sandbox
        try:
            page = b.new_page()
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(run_pages.as_uri())
            assert page.locator("tbody tr").count() == 2  # q0, q1
            page.click("text=q0")  # the index links to the query page
            page.wait_for_selector(".js-plotly-plot .main-svg")  # plotly drew the score plot
            assert page.locator("tbody tr").count() == 2 and page.locator(".highlight").count() == 2
            assert page.locator(".js-plotly-plot .bars path").count() >= 1  # bars, not an empty frame
            page.goto(compare.as_uri())
            page.wait_for_selector(".js-plotly-plot .main-svg")
            assert page.locator(".js-plotly-plot").count() == 2  # base and trained each have their plot
            page.goto((exp.run_dir("t-s0") / "report.html").as_uri())
            page.wait_for_selector(".js-plotly-plot .main-svg")
            assert page.locator(".js-plotly-plot").count() == 7 and page.locator("table tr").count() >= 2
            assert errors == []
        finally:
            b.close()
