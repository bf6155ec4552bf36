# The mixed task's hand-written router (the headroom study, configs/mixed-learn.yaml; a reference, not a menu design): a
# person who has seen the three parts writes it in a few lines. A multiplication is computed in Python from the
# numbers in the question (no executor call); a calendar question about one date (a weekday, a day of the month, a
# leap year: a name or Yes/No) gets one step-by-step answer, the design that won that part on dev; a word problem or
# a count of days five step-by-step samples and a vote on the final number. Each branch is a menu design's idea, picked by the
# query's wording, so this is the per-part router the headroom study's `part_router` estimates, written by hand.
#   pipeline baseline configs/mixed-learn.yaml --method program:configs/programs/mixed_router.py
# ruff: noqa: F821 (llm is the sandbox's helper)
import re


async def solve(problem):
    product = re.search(r"multiplication:\s*(\d+)\s*\*\s*(\d+)", problem)
    if product:
        return str(int(product.group(1)) * int(product.group(2)))
    ask = problem + "\nSolve it step by step. End with a line 'Answer: <answer>'."
    if re.search(r"leap year|weekday|day of the (?:week|month)|\d\d/\d\d/\d{4}", problem):
        return (await llm(ask))[0].split("Answer:")[-1].strip().strip(".").strip("*").strip()
    replies = await llm(ask, temperature=0.7, n=5)
    votes = [m[-1].replace(",", "").rstrip(".") for r in replies
             if (m := re.findall(r"-?\d[\d,]*\.?\d*", r.split("Answer:")[-1]))]
    return max(votes, key=votes.count) if votes else replies[0]
