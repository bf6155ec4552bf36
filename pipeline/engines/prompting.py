"""Generator prompts: template files in pipeline/engines/prompts/ rendered with the generator's chat template.

Templates use `string.Template` (`$name`) so the Python braces of example workflows need no escaping.
"""

from __future__ import annotations

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
                    exemplar_plan: str | None = None, prompt_dir: str | None = None) -> str:
    """User message asking for a workflow (flat), or for a workflow under an agent plan (two-level), whose
    exemplars were written under the stored plan `exemplar_plan`."""
    values = dict(contract=contract(family, prompt_dir), example=example(family, prompt_dir),
                  exemplars=exemplar_block(shown, code=True, plan=exemplar_plan), problem=problem.strip())
    if plan is None:
        return _fill("workflow", prompt_dir, **values)
    return _fill("workflow_under_plan", prompt_dir, plan=plan.strip(), **values)


def agent_prompt(problem: str, shown: Sequence[Shown] = ()) -> str:
    """User message asking for an agent plan (two-level, outer level)."""
    return _fill("agent", exemplars=exemplar_block(shown, code=False), problem=problem.strip())


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
                  caution: str = "") -> str:
    """User message of a refine turn (W4S's state, pipeline.stages.refine): the task, the current workflow (`origin`:
    where it came from), the feedback of its validation runs, and the ask for an analysis plus a new workflow."""
    return _fill("refine", contract=contract(family), task=task.strip(), code=code.strip("\n"), origin=origin,
                 feedback=feedback.strip(), turn=str(turn), turns=str(turns), caution=caution)
