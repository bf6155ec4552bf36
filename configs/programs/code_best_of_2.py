# Equal-budget reference for HumanEval (issue 26), matched per run: best of K = 2 executor samples, checked on the
# public tests. A trained workflow run makes about 1.2 executor calls (generate, repair on a failing public test):
# two samples a run is the closest match in calls and tokens (code_best_of_k.py's four samples cost about twice the
# workflows' executor tokens). Otherwise the same program as code_best_of_k.py: one llm() call with n = K at
# temperature 0.7, the first sample whose code passes the public tests, else the first sample.
#   pipeline baseline configs/humaneval-learn.yaml --program configs/programs/code_best_of_2.py
import re

K = 2


def code_of(reply):
    """The first ```python block of a reply, else the reply: run_tests compiles exactly what it is given."""
    blocks = re.findall(r"```(?:python|py)?[ \t]*\n(.*?)```", reply, re.DOTALL)
    return blocks[0] if blocks else reply


async def solve(problem):
    entry_point = problem.split("def ")[-1].split("(")[0]
    ask = [{"role": "user", "content": "Complete this Python function. Reply with the whole function in a Python "
            "code block.\n" + problem}]
    samples = await llm(ask, temperature=0.7, n=K)  # noqa: F821 (llm and run_tests are the sandbox's helpers)
    for sample in samples:
        if await run_tests(code_of(sample), entry_point) == "no error":  # noqa: F821
            return sample
    return samples[0]
