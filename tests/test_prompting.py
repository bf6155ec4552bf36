"""Prompt templates and their rendering with the generator's chat template."""

from __future__ import annotations

import copy

import pytest

from pipeline.engines.prompting import (
    FAMILIES,
    PromptError,
    Shown,
    agent_prompt,
    example,
    exemplar_block,
    render,
    require_chat_template,
    workflow_prompt,
)
from pipeline.engines.workflow import check_workflow, extract_code


@pytest.fixture
def tok(smol_tokenizer):
    return smol_tokenizer  # the session's tokenizer (conftest): not to be changed in place


@pytest.mark.parametrize("family", FAMILIES)
def test_example_workflows_satisfy_the_contract(family):
    assert check_workflow(example(family)) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_workflow_prompt_shows_contract_example_and_task(family):
    text = workflow_prompt("What is 2 + 3?", family)
    assert "async def solve(problem: str) -> str" in text
    assert "await llm(messages" in text
    assert example(family) in text
    assert text.rstrip().endswith("defining `async def solve(problem)`.")
    assert "What is 2 + 3?" in text
    assert ("run_tests(code, entry_point)" in text) == (family == "code")  # run_tests exists for code tasks only
    assert "Score" not in text  # round 0: no exemplars
    # the example shown is the one a reader extracts first: the model is asked for the same shape
    assert check_workflow(extract_code(text)) is None


def test_unknown_family_is_an_error():
    with pytest.raises(PromptError, match="unknown benchmark family 'poetry'"):
        workflow_prompt("x", "poetry")


def test_exemplar_block_lists_scores_and_fenced_code():
    shown = [Shown("g1", 0.75, "async def solve(problem):\n    return '1'\n"), Shown("g2", 0.0, "bad")]
    block = exemplar_block(shown, code=True)
    assert "Score 0.75:\n```python\nasync def solve(problem):\n    return '1'\n```" in block
    assert "Score 0.00:\n```python\nbad\n```" in block
    assert exemplar_block([], code=True) == ""
    plans = exemplar_block([Shown("a1", 0.5, "solver then reviewer")], code=False)
    assert "Score 0.50:\nsolver then reviewer" in plans and "```" not in plans


def test_workflow_under_plan_and_agent_prompts():
    text = workflow_prompt("Add 1 and 2.", "math", [Shown("w", 1.0, "async def solve(p):\n    return '3'")],
                           plan="Ask a solver, then a verifier.")
    assert "Plan to follow:\nAsk a solver, then a verifier." in text
    assert "Score 1.00:" in text and text.index("Plan to follow") < text.index("Task:")
    # two-level exemplars are shown with the stored plan they were written under
    under = workflow_prompt("Add 1 and 2.", "math", [Shown("w", 1.0, "async def solve(p):\n    return '3'")],
                            plan="Ask a solver, then a verifier.", exemplar_plan="Ask two solvers and vote.")
    assert "Earlier workflows written under this plan:\nAsk two solvers and vote.\nTheir scores" in under
    assert under.index("Plan to follow") < under.index("Ask two solvers") < under.index("Score 1.00:")
    plan = agent_prompt("Add 1 and 2.", [Shown("a", 0.25, "one solver")])
    assert "Score 0.25:\none solver" in plan and "Add 1 and 2." in plan and "no code" in plan


def test_render_uses_the_chat_template(tok):
    text = render(tok, workflow_prompt("What is 2 + 3?", "procedural"))
    assert text.startswith("<|im_start|>system\nYou are an expert Python programmer.")
    assert "<|im_start|>user\nA workflow is Python code" in text
    assert text.endswith("<|im_start|>assistant\n")
    # short enough for the demo generator's context with room for the completion
    assert len(tok(text, add_special_tokens=False).input_ids) < 400


def test_tokenizer_without_chat_template_is_refused(tok):
    plain = copy.deepcopy(tok)
    plain.chat_template = None
    with pytest.raises(PromptError, match="no chat template"):
        require_chat_template(plain, "some/base-model")
    with pytest.raises(PromptError, match="no chat template"):
        render(plain, "hi")


def test_extract_code_cuts_a_stray_closing_fence():
    # generators often write the code straight away and close a fence they never opened
    text = "# the sum\n\nasync def solve(problem: str) -> str:\n    return 141 - 365\n```\nThis returns the sum."
    assert extract_code(text) == "# the sum\n\nasync def solve(problem: str) -> str:\n    return 141 - 365"
    assert check_workflow(extract_code(text)) is None
    fenced = "Here:\n```python\nasync def solve(p):\n    return 1\n```\nand ```x``` later"
    assert extract_code(fenced) == "async def solve(p):\n    return 1"  # a fenced block still wins
    assert extract_code("no code at all") == "no code at all"


def test_a_prompt_dir_replaces_the_templates_it_holds_and_only_those(tmp_path, smol_tokenizer):
    from pipeline.engines.prompting import render, workflow_prompt

    (tmp_path / "example_code.txt").write_text("async def solve(problem):\n    return 'mine'\n")
    (tmp_path / "system.txt").write_text("You write tiny workflows.\n")
    own = workflow_prompt("def f(x):", "code", prompt_dir=str(tmp_path))
    shipped = workflow_prompt("def f(x):", "code")
    assert "return 'mine'" in own and "return 'mine'" not in shipped
    # the templates the folder lacks are the shipped ones: contract and the workflow frame are unchanged
    assert own.split("Example workflow:")[0] == shipped.split("Example workflow:")[0]
    assert own.rsplit("```", 1)[1] == shipped.rsplit("```", 1)[1]
    assert "You write tiny workflows." in render(smol_tokenizer, own, prompt_dir=str(tmp_path))
    assert "You write tiny workflows." not in render(smol_tokenizer, own)


def test_a_menu_folder_gives_the_planner_the_menu_and_a_system_turn_of_its_own():
    """Two-level on a menu task: the agent's prompt lists the designs (the flat prompt does), and its system turn
    is not the workflows' (which asks for one ```python block)."""
    from pipeline.engines.prompting import agent_system, load_design, template

    folder = "configs/prompts/mixed-menu"
    menu = [load_design(f"configs/programs/mixed_{d}.py") for d in ("direct", "steps", "vote", "pot")]
    plan = agent_prompt("What is 12 * 34?", prompt_dir=folder, menu=menu)
    assert "Designs a workflow can use, alone or combined:\n- mixed_direct: " in plan
    assert all(f"- {d.name}: {d.note}" in plan for d in menu) and "What is 12 * 34?" in plan
    assert "```python" not in agent_system(folder) and "```python" in template("system", folder)
    # a folder without agent_system.txt, and no folder: the workflows' system turn, as before
    assert agent_system("configs/prompts/word") == template("system", "configs/prompts/word")
    assert agent_system(None) == template("system")
    # the shipped agent prompt shows no menu even when there is one
    assert "Designs a workflow" not in agent_prompt("What is 12 * 34?", menu=menu)
    under = workflow_prompt("What is 12 * 34?", "procedural", plan="Compute it in Python.", prompt_dir=folder,
                            design=menu[3], menu=menu)
    assert "- mixed_vote: " in under and under.index("Designs") < under.index("Plan to follow:\nCompute it in Python.")
    assert f"```python\n{menu[3].code}\n```" in under
