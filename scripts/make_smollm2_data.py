"""Write the example data of recipes/smollm2-own-data.yaml: 2-digit additions in our JSONL schemas.

    python scripts/make_smollm2_data.py            # → recipes/data/smollm2/{sft,dpo,problems,eval}.jsonl

Every file is a user's file as docs/data.md describes it: `sft` (messages), `preference` (prompt,
chosen, rejected), `problem` (prompt, answer, level). The eval problems are disjoint from every
training split (no (a, b) pair is asked in both). Seeded: the same files every time.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "posttrain" / "recipes" / "data" / "smollm2"
PROMPT = "Compute {a} + {b}. Reply with the number only."


def level(a: int, b: int) -> str:
    return "carry" if a % 10 + b % 10 >= 10 else "no_carry"


def main() -> None:
    rng = random.Random(0)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    evals, train = pairs[:100], pairs[100:]
    sft = [{"messages": [{"role": "user", "content": PROMPT.format(a=a, b=b)}, {"role": "assistant", "content": str(a + b)}]}
           for a, b in train[:200]]
    dpo = []
    for a, b in train[200:300]:
        wrong = a + b + rng.choice([-10, -1, 1, 10])
        dpo.append({"prompt": PROMPT.format(a=a, b=b), "chosen": str(a + b), "rejected": str(wrong)})
    problems = [{"prompt": PROMPT.format(a=a, b=b), "answer": str(a + b), "level": level(a, b)} for a, b in train[300:500]]
    evals_rows = [{"prompt": PROMPT.format(a=a, b=b), "answer": str(a + b), "level": level(a, b)} for a, b in evals]
    OUT.mkdir(parents=True, exist_ok=True)
    for name, rows in {"sft": sft, "dpo": dpo, "problems": problems, "eval": evals_rows}.items():
        (OUT / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{OUT / name}.jsonl: {len(rows)} rows")


if __name__ == "__main__":
    main()
