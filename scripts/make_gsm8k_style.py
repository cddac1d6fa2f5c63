"""Regenerate configs/data/gsm8k-style/{train,eval}.jsonl: short grade-school math word problems with their
answers (integers, and fractions in LaTeX), made from templates with a fixed seed:
`python scripts/make_gsm8k_style.py`.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "configs" / "data" / "gsm8k-style"
NAMES = ("Ava", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Juno")
ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "cookies")


def latex(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"\\frac{{{value.numerator}}}{{{value.denominator}}}"


def problem(rng: random.Random) -> dict:
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    a, b, c = rng.randint(2, 30), rng.randint(2, 12), rng.randint(2, 9)
    kind = rng.randrange(4)
    if kind == 0:
        text = (f"{name} has {a} {item}. {other} gives {name} {b} more, then {name} gives away {c}. "
                f"How many {item} does {name} have now?")
        answer = Fraction(a + b - c)
    elif kind == 1:
        text = f"{name} buys {b} bags with {c} {item} in each bag. How many {item} does {name} buy?"
        answer = Fraction(b * c)
    elif kind == 2:
        text = (f"{name} shares {a} {item} equally among {c} friends. How many {item} does each friend get? "
                "Give a fraction if needed.")
        answer = Fraction(a, c)
    else:
        text = (f"A box holds {b} {item}. {name} fills {c} boxes and has {a} {item} left over. "
                f"How many {item} were there?")
        answer = Fraction(b * c + a)
    return {"prompt": text + " Put the final answer in \\boxed{}.", "answer": latex(answer)}


def main() -> None:
    rng = random.Random(2021)
    rows = [problem(rng) for _ in range(80)]
    OUT.mkdir(parents=True, exist_ok=True)
    for split, part in (("train", rows[:64]), ("eval", rows[64:])):
        (OUT / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in part))


if __name__ == "__main__":
    main()
