"""Progress that moves (pipeline.engines.meter): the meter's line (done, rate, time left), its log lines at most
every `every_s` seconds on a fake clock, the relay file a Prefect task reads once per line; the generators' progress
reports (per request where the backend can tell, else at the call's end) and vLLM's own bar driven as vLLM drives it."""

from __future__ import annotations

import logging
import threading

from pipeline.engines.generation.base import Completion, Generator, Sampling
from pipeline.engines.generation.vllm_offline import request_bar
from pipeline.engines.meter import ProgressMeter, Relay, duration, relay_path


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_line_says_done_rate_and_time_left():
    clock = FakeClock()
    meter = ProgressMeter(40, "rollout r0", "gen", bar=False, clock=clock)
    assert meter.line() == "rollout r0: 0/40 gen (0%), no rate yet"
    clock.now += 20  # 10 done in 20 s: 0.5 a second, 30 left -> 60 s
    meter.update(10)
    assert meter.line() == "rollout r0: 10/40 gen (25%), 0.5 gen/s, about 1 min 0 s left"
    clock.now += 40
    meter.update(30)
    assert meter.line() == "rollout r0: 40/40 gen (100%), 0.667 gen/s, 1 min 0 s in all"


def test_a_resumed_loop_counts_only_its_own_work_in_the_rate():
    clock = FakeClock()
    meter = ProgressMeter(10, "train round 0", "step", bar=False, clock=clock, done=6)
    clock.now += 8
    meter.update(2)  # 2 steps in 8 s, 2 left
    assert meter.line() == "train round 0: 8/10 step (80%), 0.25 step/s, about 8 s left"


def test_durations_read_as_a_person_writes_them():
    assert [duration(s) for s in (0.4, 45, 133, 3900)] == ["0 s", "45 s", "2 min 13 s", "1 h 05 min"]


def test_log_lines_come_every_interval_and_once_at_the_end(caplog, tmp_path):
    clock = FakeClock()
    relay = tmp_path / "progress.log"
    meter = ProgressMeter(6, "score round 0", "run", bar=False, clock=clock, every_s=30, relay=relay)
    with caplog.at_level(logging.INFO, logger="pipeline.progress"), meter:
        for _ in range(6):
            clock.now += 10
            meter.update()
    lines = [r.getMessage() for r in caplog.records if r.name == "pipeline.progress"]
    # updates at +10 .. +60 s: a line at +30 (3 done) and +60 (6 done), then the closing line
    assert [line.split(":")[1].split(" ")[1] for line in lines] == ["3/6", "6/6", "6/6"]
    assert relay.read_text().splitlines() == lines


def test_the_relay_gives_each_new_line_once_and_not_the_earlier_calls(tmp_path):
    path = tmp_path / "p.log"
    path.write_text("an earlier call's line\n")
    relay = Relay(path)
    assert relay.new_lines() == []
    with path.open("a") as f:
        f.write("one\ntwo\nhalf a li")
    assert relay.new_lines() == ["one", "two"]
    with path.open("a") as f:
        f.write("ne\n")
    assert relay.new_lines() == ["half a line"] and relay.new_lines() == []
    assert Relay(tmp_path / "none.log").new_lines() == []


def test_a_stage_and_its_task_name_the_same_relay_file():
    assert relay_path("r", 0, "score") == relay_path("r", 0, "score")
    assert len({relay_path("r", 0, "score"), relay_path("r", 1, "score"), relay_path("r", 0, "train"),
                relay_path("r/x", 0, "score")}) == 4


class PerRequest(Generator):
    """A backend that ends its requests one by one (as vLLM and the OpenAI client do) and says so."""

    backend = "per-request"
    reports_progress = True

    def _generate(self, prompts, sampling, adapter, progress=None):
        out = []
        for p in prompts:
            out.append([Completion(p, [1], [2], None, "stop") for _ in range(sampling.n)])
            progress(sampling.n)
        return out


class AtTheEnd(PerRequest):
    backend = "at-the-end"
    reports_progress = False

    def _generate(self, prompts, sampling, adapter):
        return [[Completion(p, [1], [2], None, "stop") for _ in range(sampling.n)] for p in prompts]


def test_progress_advances_per_finished_request_where_the_backend_can_tell():
    told: list[int] = []
    PerRequest().generate(["a", "b", "c"], Sampling(n=2, temperature=1.0), progress=told.append)
    assert told == [2, 2, 2]
    told.clear()
    PerRequest().generate(["a", "b"], Sampling(n=3, temperature=0.0), progress=told.append)  # greedy: n=1 copies
    assert told == [1] * 6
    told.clear()
    AtTheEnd().generate(["a", "b", "c"], Sampling(n=2, temperature=1.0), progress=told.append)
    assert told == [6]  # the whole call, once it returns


def test_vllms_bar_tells_each_finished_request_as_vllm_drives_it():
    """vLLM's LLM._run_engine with `use_tqdm=<factory>`: the bar is made with the request count, its elapsed time read
    and postfix set at each finished request, `update(n)` with the request's completions; the prompts being
    rendered pass through a bar over an iterable (maybe_tqdm), which tells nothing."""
    told: list[int] = []
    factory = request_bar(told.append)
    rendered = list(factory(["p0", "p1", "p2"], desc="Rendering prompts"))
    assert rendered == ["p0", "p1", "p2"] and told == []
    bar = factory(total=3, desc="Processed prompts", dynamic_ncols=True, postfix="est. speed input: 0.00 toks/s")
    for finished in range(1, 4):
        in_speed = 10 / max(bar.format_dict["elapsed"], 1e-9)  # what vLLM computes for its postfix
        bar.postfix = f"est. speed input: {in_speed:.2f} toks/s"
        bar.update(2)
        assert told == [2] * finished  # told as the request ends, not at the call's end
    bar.refresh()
    bar.close()


def test_requests_ending_on_threads_are_all_told():
    told: list[int] = []

    class Threaded(PerRequest):
        def _generate(self, prompts, sampling, adapter, progress=None):
            threads = [threading.Thread(target=progress, args=(sampling.n,)) for _ in prompts]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return [[Completion(p, [1], [2], None, "stop")] * sampling.n for p in prompts]

    Threaded().generate([str(i) for i in range(50)], Sampling(n=1, temperature=1.0), progress=told.append)
    assert len(told) == 50 and sum(told) == 50


def test_the_rollout_meter_moves_with_each_request(tmp_path, monkeypatch):
    """The rollout stage hands its meter to the generator: 2 queries x m=3 in one batch of 2 prompts, each prompt's
    3 completions counted as that request ends (2 updates of 3, not one of 6 when the call returns)."""
    from test_rollout import WORKFLOW, TinyBench, make_ctx

    import pipeline.stages.rollout as rollout

    class Backend(PerRequest):
        def _generate(self, prompts, sampling, adapter, progress=None):
            out = []
            for _ in prompts:
                out.append([Completion(WORKFLOW, [1, 2], [7, 8, 2], [-0.5, -0.25, -0.125], "stop")] * sampling.n)
                progress(sampling.n)
            return out

    updates: list[int] = []

    class Recording(ProgressMeter):
        def update(self, n: int = 1) -> None:
            updates.append(n)
            super().update(n)

    monkeypatch.setattr(rollout, "load_benchmark", lambda cfg: TinyBench(cfg))
    monkeypatch.setattr(rollout, "make_generator", lambda cfg, enable_lora=False, **_: Backend())
    monkeypatch.setattr(rollout, "ProgressMeter", Recording)
    counts = rollout.run_rollout(make_ctx(tmp_path))
    assert counts["sampled_now"] == 6 and updates == [3, 3]


def test_a_prefect_task_logs_each_progress_line_of_its_stage_once(tmp_path):
    from flows.tasks import relaying

    class Logger:
        def __init__(self) -> None:
            self.lines: list[str] = []

        def info(self, fmt: str, *args: object) -> None:
            self.lines.append(fmt % args)

    path, logger = tmp_path / "stage.log", Logger()
    path.write_text("a line of an earlier call\n")
    with relaying(path, logger, every_s=0.01), path.open("a") as f:
        f.write("rollout r0: 2/6 gen (33%), 0.5 gen/s, about 8 s left\n")
        f.write("rollout r0: 6/6 gen (100%), 0.5 gen/s, 12 s in all\n")
    assert logger.lines == ["rollout r0: 2/6 gen (33%), 0.5 gen/s, about 8 s left",
                            "rollout r0: 6/6 gen (100%), 0.5 gen/s, 12 s in all"]
