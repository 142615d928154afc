"""Rounds: a block of stages repeated N times, expanded into ordinary stages before validation.

The iterated pipelines of Llama 3 (Dubey et al. 2024, §4.1: about six rounds, each collecting fresh
preference and SFT data on the previous round's model) and Tülu 3 are a loop around the stages. A
recipe writes the loop once, as an item of its `stages:` list:

    stages:
      - {stage: sft, ...}
      - rounds:
          repeat: 3
          stages:
            - {stage: rejection_sampling, output: runs/x/data/r{round}.jsonl, ...}
            - {stage: sft, data: [{path: runs/x/data/r{round}.jsonl}], ...}

`expand_rounds` turns that into `repeat × len(stages)` plain stages, in order, round by round: each
named `r<k>.<name>` (`<name>`: the stage's `name`, else its kind), with `round: k` set, and `{round}`
→ k, `{prev_round}` → k − 1 substituted in every string value. Everything downstream — the run loop,
checkpoint folders, resume, evals, the doctor, the report, `posttrain phases` — sees ordinary stages:
each round starts from the previous stage's checkpoint like any stage does. Works on the plain YAML
data (no pydantic): errors are `RoundsError`s naming the field as the recipe wrote it.
"""

from __future__ import annotations

from typing import Any

ROUND, PREV_ROUND = "{round}", "{prev_round}"
BLOCK_KEYS = ("repeat", "stages")


class RoundsError(ValueError):
    """A rounds block that cannot be expanded: the message starts with the field's path."""


def substitute(value: Any, k: int) -> Any:
    """`value` with `{round}` → k and `{prev_round}` → k − 1 in every string inside it (dict keys kept)."""
    if isinstance(value, str):
        return value.replace(ROUND, str(k)).replace(PREV_ROUND, str(k - 1))
    if isinstance(value, dict):
        return {key: substitute(v, k) for key, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, k) for v in value]
    return value


def _placeholder(value: Any, where: str) -> str | None:
    """The path of the first string under `value` that holds `{round}` or `{prev_round}`, or None."""
    if isinstance(value, str):
        return where if ROUND in value or PREV_ROUND in value else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, v in items:
        found = _placeholder(v, f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}")
        if found:
            return found
    return None


def _block(item: dict, where: str) -> tuple[int, list[dict]]:
    """A rounds item's (repeat, stages), checked."""
    if set(item) != {"rounds"}:
        extra = sorted(set(item) - {"rounds"})
        raise RoundsError(f"{where}: a rounds item holds only `rounds: {{repeat, stages}}`, not also {extra}")
    block = item["rounds"]
    if not isinstance(block, dict):
        raise RoundsError(f"{where}.rounds: expected a mapping `{{repeat: N, stages: [...]}}` (got {block!r})")
    for key in block:
        if key not in BLOCK_KEYS:
            raise RoundsError(f"{where}.rounds.{key}: unknown key (a rounds block has {list(BLOCK_KEYS)})")
    repeat = block.get("repeat")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise RoundsError(f"{where}.rounds.repeat: expected an integer ≥ 1, the number of rounds (got {repeat!r})")
    stages = block.get("stages")
    if not isinstance(stages, list) or not stages:
        raise RoundsError(f"{where}.rounds.stages: expected a non-empty list of stages (got {stages!r})")
    for j, st in enumerate(stages):
        at = f"{where}.rounds.stages[{j}]"
        if not isinstance(st, dict):
            raise RoundsError(f"{at}: expected a stage mapping such as `{{stage: sft, ...}}` (got {st!r})")
        if "rounds" in st:
            raise RoundsError(f"{at}: rounds cannot nest; write the inner stages in the outer block "
                              f"(one block of repeat × stages)")
        if "round" in st:
            raise RoundsError(f"{at}.round: set by the rounds block (the round each copy belongs to); remove it")
    return repeat, stages


def _folder(stage: Any) -> str | None:
    """What a stage's checkpoint folder will be called (`name`, else its kind), as the recipe wrote it."""
    for key in ("name", "stage"):
        if isinstance(stage, dict) and isinstance(stage.get(key), str):
            return stage[key]
    return None


def expand_rounds(raw: dict) -> tuple[dict, list[str]]:
    """The recipe `raw` (plain YAML data) with every rounds block expanded, and where each resulting
    stage came from (`stages[2].rounds.stages[1]` for a copy, `stages[0]` for a plain stage), for error
    messages. A recipe without rounds comes back unchanged. Raises RoundsError: a bad block, a
    `{round}` outside any block, or two stages that would share a name (checkpoint folder)."""
    stages = raw.get("stages")
    if not isinstance(stages, list):
        return raw, []
    out: list[Any] = []
    origin: list[str] = []
    for i, item in enumerate(stages):
        where = f"stages[{i}]"
        if not (isinstance(item, dict) and "rounds" in item):
            found = _placeholder(item, where)
            if found:
                raise RoundsError(f"{found}: `{{round}}` and `{{prev_round}}` mean something only inside a rounds block")
            out.append(item)
            origin.append(where)
            continue
        repeat, block = _block(item, where)
        for k in range(1, repeat + 1):
            for j, st in enumerate(block):
                copy = substitute(st, k)
                copy["name"] = f"r{k}.{_folder(copy) or 'stage'}"
                copy["round"] = k
                out.append(copy)
                origin.append(f"{where}.rounds.stages[{j}]")
    seen: dict[str, int] = {}
    for n, st in enumerate(out):
        folder = _folder(st)
        if folder is None:
            continue
        if folder in seen:
            raise RoundsError(f"{origin[n]}.name: stage name {folder!r} is also that of {origin[seen[folder]]}; two stages would share a "
                              f"checkpoint folder — give them distinct `name`s")
        seen[folder] = n
    return ({**raw, "stages": out} if out != stages else raw), origin
