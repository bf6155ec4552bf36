import re


def score(answer, reference, **metadata):
    """1.0 when the answer's last number is the reference value (within 0.1%), else 0.0."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer.replace(",", ""))
    return float(bool(numbers) and abs(float(numbers[-1]) - float(reference)) <= 1e-3 * abs(float(reference)))
