"""Writes questions.jsonl: 100 unit-conversion questions, 20 of each kind, the same on every run (a fixed seed).

    python examples/unit-conversion/make_data.py

Each row: id, question, answer (the exact value as text), kind (the part label), unit (what the answer is in).
"""

import json
import random
from pathlib import Path

# kind -> (from unit, to unit, factor): the answer is value * factor
CONVERSIONS = {
    "length": [("metres", "centimetres", 100), ("kilometres", "metres", 1000), ("centimetres", "millimetres", 10)],
    "mass": [("kilograms", "grams", 1000), ("tonnes", "kilograms", 1000), ("grams", "milligrams", 1000)],
    "time": [("hours", "minutes", 60), ("minutes", "seconds", 60), ("days", "hours", 24)],
    "volume": [("litres", "millilitres", 1000), ("cubic metres", "litres", 1000)],
    "data": [("kilobytes", "bytes", 1000), ("megabytes", "kilobytes", 1000)],
}
PER_KIND = 20


def number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def rows(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    asked = set()
    for kind, options in CONVERSIONS.items():
        made = 0
        while made < PER_KIND:  # every question once
            source, target, factor = rng.choice(options)
            value = rng.choice([rng.randint(2, 12), rng.randint(2, 9) + 0.5])
            question = f"How many {target} are in {number(value)} {source}?"
            if question in asked:
                continue
            asked.add(question)
            out.append({"id": f"{kind}-{len(out):03d}", "question": question, "answer": number(value * factor),
                        "kind": kind, "unit": target})
            made += 1
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("questions.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    print(f"{path}: {len(rows())} questions")
