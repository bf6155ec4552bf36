# Word problems (the headroom menu): chain of thought, one greedy answer ending in "Answer: <number>"; the workflow
# returns the last number after the last "Answer:".
# design: step by step: one reasoned answer at temperature 0, its final number
#   pipeline baseline configs/gsm-menu.yaml --method program:configs/programs/word_steps.py
# ruff: noqa: E501, F821 (llm is the sandbox's helper)
import re


async def solve(problem):
    ask = problem + "\nSolve it step by step. End with a line 'Answer: <number>'."
    reply = (await llm([{"role": "user", "content": ask}]))[0]
    numbers = re.findall(r"-?\d[\d,]*\.?\d*", reply.split("Answer:")[-1])
    return numbers[-1].replace(",", "") if numbers else reply
