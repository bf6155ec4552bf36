"""Commands run as printed: every command the README, docs/ and a kept adapter's README.md show (in a shell code
block or an indented block) starts on this install: its program exists, `--help` of the command it names runs, and
each `--option` it passes is one that command takes. A failure names the file and line that shows the command.

`pipeline ...` (and `python -m pipeline.cli ...`) are checked in this process through typer's CliRunner; the other
programs (`python -m MODULE`, `prefect`, `vllm`, `python scripts/...`) run `--help` once per distinct command, side by
side; `bash scripts/X.sh` is checked with `bash -n` (running it would install or start things)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import typer
from typer.testing import CliRunner

from pipeline.cli import app

REPO = Path(__file__).resolve().parents[1]
SHELL_FENCES = {"", "bash", "sh", "shell", "console", "zsh"}  # fenced blocks whose lines are commands
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SUBCOMMAND = re.compile(r"^[a-z][a-z0-9-]*$")
ENDS = {"|", "||", "&&", "&", ";", ">", ">>", "2>", "2>&1", "<"}  # a token that ends the documented command
HELP_TIMEOUT_S = 180


def documented_files() -> list[Path]:
    """The README, every page under docs/, and the README.md of each kept adapter under data/stores/."""
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")),
             *sorted((REPO / "data" / "stores").glob("**/adapters/*/README.md"))]
    return [f for f in files if f.is_file()]


@dataclass(frozen=True)
class Shown:
    """A command as a page shows it: the file, the line it starts on, and its words (env assignments dropped)."""

    path: Path
    line: int
    words: tuple[str, ...]

    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}: {shlex.join(self.words)}"

    def options(self) -> list[str]:
        """The `--long` options it passes, without `=value` and without the brackets of an optional part."""
        names = (w.strip("[]").split("=", 1)[0] for w in self.words)
        return [n for n in names if n.startswith("--") and len(n) > 2]


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text) of the lines of shell fenced blocks and of indented blocks (4 spaces, after a blank line
    or another indented line), outside other fences."""
    out, fence, previous_blank, in_block = [], None, True, False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            fence = None if fence is not None else stripped[3:].strip().lower()
            in_block = False
        elif fence is not None:
            if fence in SHELL_FENCES:
                out.append((number, line))
        elif line.startswith(("    ", "\t")) and stripped and (previous_blank or in_block):
            out.append((number, line))
            in_block = True
        elif stripped:
            in_block = False
        previous_blank = not stripped
    return out


PROGRAMS = ("pipeline", "python", "python3", "bash", "prefect", "vllm")


def commands(path: Path) -> list[Shown]:
    """The commands `path` shows: a line (with its `\\` continuations and open quotes) whose first word after any
    `VAR=value` and a `$ ` prompt is one of PROGRAMS (python: `-m MODULE` or `scripts/...`, bash: `scripts/...`)."""
    lines, out, i = code_lines(path.read_text()), [], 0
    while i < len(lines):
        number, text = lines[i]
        text = text.strip().removeprefix("$ ")
        words = None
        while True:
            try:
                words = shlex.split(text.removesuffix("\\"), comments=True)
            except ValueError:  # a quote open across lines (a multi-line SQL string)
                words = None
            if (words is not None and not text.endswith("\\")) or i + 1 >= len(lines) \
                    or lines[i + 1][0] != lines[i][0] + 1:
                break
            i += 1
            text = text.removesuffix("\\") + "\n" + lines[i][1].strip()
        i += 1
        while words and ENV_ASSIGNMENT.match(words[0]):
            words = words[1:]
        if not words or words[0] not in PROGRAMS:
            continue
        cut = next((k for k, w in enumerate(words) if w in ENDS), len(words))
        words = words[:cut]
        first, second = words[0], words[1] if len(words) > 1 else ""
        if first in ("python", "python3") and not (second == "-m" or second.startswith("scripts/")):
            continue  # `python` with code or a file of the reader's: nothing of ours to run
        if first == "bash" and not second.startswith("scripts/"):
            continue
        if first == "pipeline" and second and not (second.startswith("-") or SUBCOMMAND.match(second)):
            continue  # prose in an indented block ("pipeline starts, ...")
        out.append(Shown(path, number, tuple(words)))
    return out


def all_commands() -> list[Shown]:
    return [c for f in documented_files() for c in commands(f)]


# ---- the collector itself ------------------------------------------------------------------------------------------


def test_the_collector_finds_shell_and_indented_commands_only(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Intro\n\n    pipeline run configs/smoke.yaml --rounds 2\n\n"
                    "```python\npipeline = 'not a command'\n```\n\n"
                    "```bash\n$ OMP_NUM_THREADS=1 pipeline sql \"SELECT 1\n  FROM t\" --store runs | head\n"
                    "python -m flows.serve \\\n  --task-runner dask:tcp://h:8786   # then trigger\n"
                    "bash scripts/setup.sh\npython -c 'print(1)'\n```\n\n"
                    "- a list item\n    pipeline starts, then\n")
    found = [(c.line, c.words) for c in commands(page)]
    assert found == [(3, ("pipeline", "run", "configs/smoke.yaml", "--rounds", "2")),
                     (10, ("pipeline", "sql", "SELECT 1\nFROM t", "--store", "runs")),
                     (12, ("python", "-m", "flows.serve", "--task-runner", "dask:tcp://h:8786")),
                     (14, ("bash", "scripts/setup.sh"))]
    assert commands(page)[0].options() == ["--rounds"]


def test_the_pages_show_commands():
    shown = all_commands()
    assert any(c.words[0] == "pipeline" for c in shown), "no `pipeline` command found in README.md or docs/"


# ---- the checks ----------------------------------------------------------------------------------------------------


def pipeline_problem(command: Shown, runner: CliRunner, root, helped: dict) -> str | None:
    """Why a documented `pipeline` command would not run as shown: an unknown command, an option that command does
    not take, or its `--help` failing (`helped`: command path -> its --help's problem, each run once); None if it
    runs."""
    words = list(command.words[1:])
    if command.words[:3] == ("python", "-m", "pipeline.cli"):
        words = list(command.words[3:])
    names, cmd = [], root
    while hasattr(cmd, "commands") and words and not words[0].startswith("-"):  # a group: its subcommand
        sub = cmd.commands.get(words[0])
        if sub is None:
            return f"`pipeline {' '.join([*names, words[0]])}`: no such command"
        names.append(words.pop(0))
        cmd = sub
    known = {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts)} | {"--help"}
    if unknown := [o for o in command.options() if o not in known]:
        return f"`pipeline {' '.join(names)}` takes no {', '.join(unknown)}"
    if tuple(names) not in helped:  # each command's --help once
        result = runner.invoke(app, [*names, "--help"])
        helped[tuple(names)] = None if result.exit_code == 0 else \
            f"`pipeline {' '.join(names)} --help` exited {result.exit_code}: {result.output[-300:]}"
    return helped[tuple(names)]


def is_pipeline(command: Shown) -> bool:
    return command.words[0] == "pipeline" or command.words[:3] == ("python", "-m", "pipeline.cli")


def test_every_documented_pipeline_command_runs_as_shown():
    root = typer.main.get_command(app)  # typer's own (vendored) click objects
    runner, helped = CliRunner(), {}
    problems = [f"{c.where()}\n    {why}" for c in all_commands() if is_pipeline(c)
                if (why := pipeline_problem(c, runner, root, helped))]
    assert not problems, "documented commands that do not run as shown:\n" + "\n".join(problems)


def help_invocation(command: Shown) -> tuple[list[str], str | None]:
    """(argv that prints the command's help, a problem found without running anything) of a non-`pipeline`
    command."""
    first, rest = command.words[0], list(command.words[1:])
    if first in ("python", "python3"):
        if rest[0] == "-m":
            module = rest[1]
            if importlib.util.find_spec(module) is None:
                return [], f"no module {module} on this install"
            return [sys.executable, "-m", module, *subcommands(rest[2:]), "--help"], None
        script = REPO / rest[0]
        if not script.is_file():
            return [], f"no file {rest[0]}"
        return [sys.executable, str(script), "--help"], None
    if first == "bash":
        script = REPO / rest[0]
        if not script.is_file():
            return [], f"no file {rest[0]}"
        return ["bash", "-n", str(script)], None
    program = shutil.which(first) or shutil.which(first, path=str(Path(sys.executable).parent))
    if program is None:
        return [], f"no `{first}` command on this install"
    return [program, *subcommands(rest), "--help"], None


def subcommands(words: list[str]) -> list[str]:
    """The subcommand path of a command's words: the leading plain words (`deployment run`, `server start`,
    `download`)."""
    path = []
    for word in words:
        if not SUBCOMMAND.match(word):
            break
        path.append(word)
    return path


def fingerprint(argv: list[str]) -> str | None:
    """What the `--help` of `argv` depends on, as a key: the argv and the modification times of the code it runs (an
    installed package: its top module; this repository's package or script: every .py file of it); None for
    `bash -n` (instant, nothing to keep)."""
    if argv[0] == "bash":
        return None
    if argv[:2] == [sys.executable, "-m"]:
        name = argv[2].split(".")[0]
    elif argv[0] == sys.executable:  # a script of this repository
        name = None
    else:
        name = Path(argv[0]).name
    spec = importlib.util.find_spec(name) if name else None
    origin = Path(spec.origin) if spec is not None and spec.origin else Path(argv[1])
    files = sorted(origin.parent.rglob("*.py")) if origin.is_relative_to(REPO) and origin.name == "__init__.py" \
        else [origin]
    return hashlib.sha1(repr((argv, [(str(f), f.stat().st_mtime_ns) for f in files])).encode()).hexdigest()


def run_help(argv: list[str]) -> tuple[int, str]:
    """The exit code and output of `argv`. A successful `--help` is kept in the temp folder under its `fingerprint`,
    so it runs again only when the command or its code changes (vLLM's imports take half a minute, the Prefect
    flows' several seconds)."""
    key = fingerprint(argv)
    cached = None if key is None else Path(tempfile.gettempdir()) / "workflow-grpo" / "documented-help" / f"{key}.txt"
    if cached is not None and cached.is_file():
        return 0, cached.read_text()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=HELP_TIMEOUT_S, cwd=REPO, env=env)
    except subprocess.TimeoutExpired:
        return -1, f"no answer in {HELP_TIMEOUT_S} s"
    output = done.stdout + done.stderr
    if cached is not None and done.returncode == 0:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(output)
    return done.returncode, output


def test_every_other_documented_command_runs_as_shown():
    shown = [c for c in all_commands() if not is_pipeline(c)]
    problems, by_argv = [], {}
    for c in shown:
        argv, problem = help_invocation(c)
        if problem:
            problems.append(f"{c.where()}\n    {problem}")
        else:
            by_argv.setdefault(tuple(argv), []).append(c)
    with ThreadPoolExecutor(max_workers=4) as pool:  # each distinct --help once, side by side
        results = dict(zip(by_argv, pool.map(lambda argv: run_help(list(argv)), by_argv), strict=True))
    for argv, (code, output) in results.items():
        for c in by_argv[argv]:
            if code != 0:
                problems.append(f"{c.where()}\n    `{shlex.join(argv)}` exited {code}: {output.strip()[-300:]}")
            elif argv[:2] != ("bash", "-n") and (unknown := [o for o in c.options() if o not in output]):
                problems.append(f"{c.where()}\n    its --help names no {', '.join(unknown)}")
    assert not problems, "documented commands that do not run as shown:\n" + "\n".join(problems)

