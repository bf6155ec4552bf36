# The "best fixed workflow" candidate for word problems (gsm_symbolic): the hand-written prompt's example
# design: sample and vote: three step-by-step answers at temperature 0.7, the most frequent final number
# workflow (configs/prompts/word/example_procedural.txt, byte for byte below this header) run as a fixed program:
# ask for a step-by-step solution ending in "Answer: <number>", 3 samples at temperature 0.7 in one llm() call, the
# most frequent final number wins. The trained generator starts from it (the workflow_prefix is its first lines).
#   pipeline baseline configs/gsm-learn.yaml --method program:configs/programs/word_example_vote.py
# ruff: noqa: E501, F821 (llm is the sandbox's helper)
import re


async def solve(problem):
    ask = problem + "\nSolve it step by step. End with a line 'Answer: <number>'."
    replies = await llm([{"role": "user", "content": ask}], temperature=0.7, n=3)
    votes = [m[-1] for r in replies if (m := re.findall(r"-?\d[\d,]*\.?\d*", r.split("Answer:")[-1]))]
    return max(set(votes), key=votes.count).replace(",", "") if votes else replies[0]
