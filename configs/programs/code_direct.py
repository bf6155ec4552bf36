# HumanEval (the headroom menu): the executor answers directly, one greedy function, no test.
# design: answer directly: one function from the helper at temperature 0, not tested
#   pipeline baseline configs/humaneval-menu.yaml --method program:configs/programs/code_direct.py
# ruff: noqa: E501, F821 (llm is the sandbox's helper)
async def solve(problem):
    ask = [{"role": "user", "content": "Complete this Python function. Reply with the whole function in a Python code block.\n" + problem}]
    return (await llm(ask))[0]
