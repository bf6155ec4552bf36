# The "best fixed workflow" candidate for HumanEval (the real-task study): the hand-written prompt's example workflow
# design: generate, check against the public tests, repair once with the failures
# (configs/prompts/code/example_code.txt, byte for byte below this header) run as a fixed program: ask the executor
# for the function, run the public tests, ask once more with the failures. The trained generator copies it.
# `run_tests` reads a fenced reply as its code block (as the hidden tests do), so the repair call runs only when the
# public tests fail: 1 executor call, or 2.
#   pipeline baseline configs/humaneval-learn.yaml --method program:configs/programs/code_generate_test_repair.py
# ruff: noqa: E501, F821 (the example's long line; llm and run_tests are the sandbox's helpers)
async def solve(problem):
    entry_point = problem.split("def ")[-1].split("(")[0]
    ask = [{"role": "user", "content": "Complete this Python function. Reply with the whole function in a Python code block.\n" + problem}]
    code = (await llm(ask))[0]
    feedback = await run_tests(code, entry_point)
    if feedback != "no error":
        ask += [{"role": "assistant", "content": code}, {"role": "user", "content": f"The tests failed: {feedback}\nReply with the corrected function in a Python code block."}]
        code = (await llm(ask))[0]
    return code
