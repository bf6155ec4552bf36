# HumanEval (the headroom menu): resample on failure. The greedy answer, checked on the public tests; when they fail,
# fresh samples at temperature 0.7 (not a repair: earlier runs found the example's repair never fixes a failing first
# answer on the test problems, 0 of 22, while fresh samples do), the first passing one, else the greedy answer.
# design: resample on failure: the greedy function, checked on the public tests; if it fails, K fresh samples, the first that passes
#   pipeline baseline configs/humaneval-menu.yaml --method program:configs/programs/code_resample.py
# ruff: noqa: E501, F821 (llm and run_tests are the sandbox's helpers)
K = 2


async def solve(problem):
    entry_point = problem.split("def ")[-1].split("(")[0]
    ask = [{"role": "user", "content": "Complete this Python function. Reply with the whole function in a Python code block.\n" + problem}]
    code = (await llm(ask))[0]
    if await run_tests(code, entry_point) == "no error":
        return code
    for sample in await llm(ask, temperature=0.7, n=K):
        if await run_tests(sample, entry_point) == "no error":
            return sample
    return code
