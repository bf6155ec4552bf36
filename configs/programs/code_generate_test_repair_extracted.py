# Generate, run the public tests, repair once (issue 26) -- the example workflow of configs/prompts/code with one
# change: the public tests run on the code inside the executor's ```python block, not on the whole reply (which
# does not compile, so code_generate_test_repair.py always repairs). The repair call runs only when the public tests
# fail, and shows their real failures. 1 executor call when the first answer passes, else 2.
#   pipeline baseline configs/humaneval-learn.yaml \
#       --method program:configs/programs/code_generate_test_repair_extracted.py
import re


def code_of(reply):
    """The first ```python block of a reply, else the reply."""
    blocks = re.findall(r"```(?:python|py)?[ \t]*\n(.*?)```", reply, re.DOTALL)
    return blocks[0] if blocks else reply


async def solve(problem):
    entry_point = problem.split("def ")[-1].split("(")[0]
    ask = [{"role": "user", "content": "Complete this Python function. Reply with the whole function in a Python "
            "code block.\n" + problem}]
    code = (await llm(ask))[0]  # noqa: F821 (llm and run_tests are the sandbox's helpers)
    feedback = await run_tests(code_of(code), entry_point)  # noqa: F821
    if feedback != "no error":
        ask += [{"role": "assistant", "content": code}, {"role": "user", "content": f"The tests failed: {feedback}\n"
                 "Reply with the corrected function in a Python code block."}]
        code = (await llm(ask))[0]  # noqa: F821
    return code
