"""Generator prompts: template files in pipeline/engines/prompts/ rendered with the generator's chat template.

Templates use `string.Template` (`$name`) so the Python braces of example workflows need no escaping.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from string import Template

FAMILIES = ("code", "math", "qa", "procedural")


class PromptError(ValueError):
    """A prompt cannot be built (unknown family, a tokenizer without chat template)."""


@dataclass(frozen=True)
class Shown:
    """An exemplar as the prompt shows it: its score and its body (workflow code or plan text)."""

    gen_id: str
    score: float
    body: str


@cache
def template(name: str, prompt_dir: str | None = None) -> str:
    """The template `name`: from `prompt_dir` (`rollout.prompt_dir`, hand-written prompts) when it holds
    `<name>.txt`, else the shipped one."""
    if prompt_dir is not None:
        own = Path(prompt_dir) / f"{name}.txt"
        if own.is_file():
            return own.read_text()
    path = resources.files("pipeline.engines") / "prompts" / f"{name}.txt"
    if not path.is_file():
        raise PromptError(f"prompt template {name!r} missing ({path})")
    return path.read_text()


def _fill(name: str, prompt_dir: str | None = None, **values: str) -> str:
    return Template(template(name, prompt_dir)).substitute(**values)


def contract(family: str, prompt_dir: str | None = None) -> str:
    text = template("contract", prompt_dir).rstrip("\n")
    return text + "\n" + template("contract_code", prompt_dir).rstrip("\n") if family == "code" else text


def example(family: str, prompt_dir: str | None = None) -> str:
    if family not in FAMILIES:
        raise PromptError(f"unknown benchmark family {family!r}; known: {', '.join(FAMILIES)}")
    return template(f"example_{family}", prompt_dir).rstrip("\n")


@dataclass(frozen=True)
class Design:
    """A design of the example menu (`rollout.example_menu`): a workflow program file, shown as a prompt's example.
    `code` is the file without its header comments and `# noqa` trailers (the prompts ask for no comments), so the
    file run as a fixed program and the example differ in comments only; `note` is its `# design:` header line."""

    name: str  # the file's stem
    note: str
    code: str


@cache
def load_design(path: str) -> Design:
    """The design in program file `path`; a PromptError when it is missing or has no `# design:` line."""
    file = Path(path)
    if not file.is_file():
        raise PromptError(f"rollout.example_menu: {path} is not a file (relative paths start at the working "
                          f"directory, {Path.cwd()})")
    lines = file.read_text().splitlines()
    head = 0
    while head < len(lines) and (lines[head].startswith("#") or not lines[head].strip()):
        head += 1
    note = next((x.split(":", 1)[1].strip() for x in lines[:head] if x.lower().startswith("# design:")), None)
    if not note:
        raise PromptError(f"rollout.example_menu: {path} has no `# design: <what it does>` line in its header")
    body = [re.sub(r"\s+# noqa\b.*$", "", x) for x in lines[head:]]
    return Design(file.stem, note, "\n".join(body).strip("\n"))


def menu_code(paths: Sequence[str]) -> dict[str, str]:
    """The code of each design of the menu in `paths` by name: what `pipeline.core.designs.nearest_design` matches a
    written workflow against (the rollout stage, SMC and the report name designs the same way)."""
    return {d.name: d.code for d in map(load_design, paths)}


def menu_listing(menu: Sequence[Design]) -> str:
    """The `$menu` block: one line per design, its name and what it does."""
    return "\n".join(f"- {d.name}: {d.note}" for d in menu)


def menu_labels(menu: Sequence[Design]) -> dict[str, str]:
    """Each design's label in a prompt that lets the generator choose: its name without the prefix every name of the
    menu shares ("mixed_pot" -> "pot"), so the names differ from their first word; the names themselves where the
    prefix would leave one empty."""
    names = [d.name for d in menu]
    common = os.path.commonprefix(names) if len(names) > 1 else ""
    labels = [n[len(common):] for n in names]
    return dict(zip(names, labels if all(labels) else names, strict=True))


def menu_block(menu: Sequence[Design]) -> str:
    """The `$designs` block: every design with its label (`menu_labels`), what it does and its code, for a prompt
    that lets the generator choose (rollout.menu_choice policy)."""
    labels = menu_labels(menu)
    return "\n\n".join(f"{labels[d.name]}: {d.note}\n```python\n{d.code}\n```" for d in menu)


def design_prefix(design: Design, body_lines: int) -> str:
    """The assistant turn's opening for a drawn design: a ```python fence, the design's code through its
    `async def solve` line, then `body_lines` lines of its body (rollout.menu_prefix_lines)."""
    lines = design.code.splitlines()
    at = next((i for i, x in enumerate(lines) if x.startswith("async def solve")), None)
    if at is None:
        raise PromptError(f"design {design.name}: no `async def solve` line")
    return "```python\n" + "\n".join(lines[: at + 1 + body_lines]) + "\n"


def exemplar_block(shown: Sequence[Shown], code: bool, plan: str | None = None) -> str:
    """Empty when there are no exemplars (round 0), else the scored exemplars; code is fenced. `plan`: the stored
    plan the exemplar workflows were written under (two-level), shown above them."""
    if not shown:
        return ""
    items = "\n".join(
        f"Score {s.score:.2f}:\n" + (f"```python\n{s.body.strip()}\n```" if code else s.body.strip()) for s in shown
    )
    if plan is not None:
        return _fill("exemplars_under_plan", plan=plan.strip(), items=items)
    return _fill("exemplars", items=items)


def workflow_prompt(problem: str, family: str, shown: Sequence[Shown] = (), plan: str | None = None,
                    exemplar_plan: str | None = None, prompt_dir: str | None = None, design: Design | None = None,
                    menu: Sequence[Design] = ()) -> str:
    """User message asking for a workflow (flat), or for a workflow under an agent plan (two-level), whose
    exemplars were written under the stored plan `exemplar_plan`. `design`: the menu design drawn for this sample,
    shown as the example instead of the prompt folder's (`$design`: what it does; `$menu`: every design's name and
    line; `$designs`: every design's code too)."""
    values = dict(contract=contract(family, prompt_dir),
                  example=example(family, prompt_dir) if design is None else design.code,
                  design="" if design is None else design.note, menu=menu_listing(menu), designs=menu_block(menu),
                  exemplars=exemplar_block(shown, code=True, plan=exemplar_plan), problem=problem.strip())
    if plan is None:
        return _fill("workflow", prompt_dir, **values)
    return _fill("workflow_under_plan", prompt_dir, plan=plan.strip(), **values)


def agent_prompt(problem: str, shown: Sequence[Shown] = (), prompt_dir: str | None = None,
                 menu: Sequence[Design] = ()) -> str:
    """User message asking for an agent plan (two-level, outer level); `$menu`: every design of the example menu,
    for a prompt folder's `agent.txt` (the shipped one shows none)."""
    return _fill("agent", prompt_dir, exemplars=exemplar_block(shown, code=False), problem=problem.strip(),
                 menu=menu_listing(menu))


def agent_system(prompt_dir: str | None = None) -> str:
    """The system turn of an agent plan: the prompt folder's `agent_system.txt`, else the workflows' own (`system`):
    a folder whose system turn asks for a ```python block gives its planner another."""
    if prompt_dir is not None and (Path(prompt_dir) / "agent_system.txt").is_file():
        return template("agent_system", prompt_dir)
    return template("system", prompt_dir)


def require_chat_template(tokenizer, model_ref: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError(f"{model_ref}: its tokenizer has no chat template; use an instruct/chat model "
                          "(or add a chat_template to its tokenizer_config.json)")


def render(tokenizer, user: str, system: str | None = None, prompt_dir: str | None = None) -> str:
    """The prompt text the generator sees: system + user turn through the chat template, assistant turn open."""
    require_chat_template(tokenizer, getattr(tokenizer, "name_or_path", "generator"))
    system = system if system is not None else template("system", prompt_dir)
    messages = [{"role": "system", "content": system.strip()},
                {"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def repair_prompt(problem: str, family: str, code: str, error: str) -> str:
    """User message of self-repair: the task, the workflow that failed its check and why."""
    return _fill("repair", contract=contract(family), problem=problem.strip(), code=code.strip("\n"),
                 error=error.strip())


def refine_prompt(family: str, task: str, code: str, origin: str, feedback: str, turn: int, turns: int,
                  caution: str = "", prompt_dir: str | None = None, menu: Sequence[Design] = ()) -> str:
    """User message of a refine turn (W4S's state, pipeline.stages.refine): the task, the current workflow (`origin`:
    where it came from), the feedback of its validation runs, and the ask for an analysis plus a new workflow;
    `$menu`: every design of the example menu, for a prompt folder's `refine.txt` (the shipped one shows none)."""
    return _fill("refine", prompt_dir, contract=contract(family, prompt_dir), task=task.strip(),
                 code=code.strip("\n"), origin=origin, feedback=feedback.strip(), turn=str(turn), turns=str(turns),
                 caution=caution, menu=menu_listing(menu))
