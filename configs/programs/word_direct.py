# Word problems (the headroom menu): the executor answers directly, asked for the final number only; the workflow
# returns the last number of its reply.
# design: answer directly: the helper gives the final number only, no reasoning
#   pipeline baseline configs/gsm-menu.yaml --method program:configs/programs/word_direct.py
# ruff: noqa: F821 (llm is the sandbox's helper)
import re


async def solve(problem):
    reply = (await llm(problem + "\nReply with the final number only."))[0]
    numbers = re.findall(r"-?\d[\d,]*\.?\d*", reply)
    return numbers[-1].replace(",", "") if numbers else reply
