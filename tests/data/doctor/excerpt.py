"""Copy a run folder's doctor inputs here, small: recipe.yaml, evals.jsonl, and metrics.jsonl without
the per-phase roofline keys (the rules never read them).

    python tests/data/doctor/excerpt.py RUN_DIR NAME [--stages sft,dpo]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

DROP = ("phase/", "telemetry/")


def main(run_dir: str, name: str, stages: str | None = None) -> None:
    src, dst = Path(run_dir), Path(__file__).parent / name
    dst.mkdir(parents=True, exist_ok=True)
    keep = set(stages.split(",")) if stages else None
    shutil.copy(src / "recipe.yaml", dst / "recipe.yaml")
    for fname in ("metrics.jsonl", "evals.jsonl"):
        if not (src / fname).is_file():
            continue
        out = []
        for line in (src / fname).read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if keep is not None and r.get("stage") not in keep | {"base"}:
                continue
            if fname == "metrics.jsonl":
                r = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items() if not k.startswith(DROP)}
            out.append(json.dumps(r, separators=(",", ":")))
        (dst / fname).write_text("".join(x + "\n" for x in out))


if __name__ == "__main__":
    args = sys.argv[1:]
    stages = args[args.index("--stages") + 1] if "--stages" in args else None
    main(args[0], args[1], stages)
