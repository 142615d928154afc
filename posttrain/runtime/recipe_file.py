"""A recipe file read and written: YAML in, `key=value` overrides, rounds expanded, validated — or one error
line per problem naming the file, the key path (as the user wrote it, a rounds copy at its block's stage)
and what was expected. The schema is `runtime/config.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from posttrain.runtime.config import Recipe, RecipeError
from posttrain.runtime.rounds import RoundsError, expand_rounds


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("pretrain", "sft", "grpo", "rejection_sampling", "reward_model", "dpo", "ppo", "constitutional_sl",
                      "constitutional_rl") or str(part).startswith("function-"):
            continue  # pydantic's discriminator tag, not a key the user wrote
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def format_validation_error(err: ValidationError, source: str, origin: list[str] | None = None) -> str:
    """One line per error: `file: key.path: what was expected (got …)`. `origin[i]`: where expanded
    stage i was written (a rounds block's copies point at the block's stage; their repeats are one line)."""
    lines: list[str] = []
    for e in err.errors():
        msg = e["msg"].removeprefix("Value error, ")
        got = "" if e["type"] in ("missing", "extra_forbidden") else f" (got {e.get('input')!r})"
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        loc = e["loc"]
        if origin and len(loc) >= 2 and loc[0] == "stages" and isinstance(loc[1], int) and loc[1] < len(origin):
            rest = _loc(loc[2:])
            where = origin[loc[1]] + ("" if rest == "(top level)" else "." + rest)
        else:
            where = _loc(loc)
        line = f"{source}: {where}: {msg}{got}"
        if line not in lines:
            lines.append(line)
    return "\n".join(lines)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """`stages.1.optim.lr=3e-4` style overrides; values parsed as YAML scalars."""
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r}: expected key=value")
        key, value = item.split("=", 1)
        node: Any = raw
        parts = key.split(".")
        for p in parts[:-1]:
            node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
        last = parts[-1]
        parsed = yaml.safe_load(value)
        if isinstance(node, list):
            node[int(last)] = parsed
        else:
            node[last] = parsed
    return raw


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    path = Path(path)
    if not path.is_file():  # a FIFO or device is refused here too, before read_text could block on it
        raise RecipeError(f"{path}: recipe file does not exist" if not path.exists()
                          else f"{path}: is not a regular file; expected a recipe YAML file")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: expected a mapping of recipe keys at the top level")
    try:
        raw = apply_overrides(raw, overrides or [])
    except (KeyError, IndexError, ValueError, TypeError) as e:
        raise RecipeError(f"{path}: bad override: {e}") from None
    try:
        raw, origin = expand_rounds(raw)
    except RoundsError as e:
        raise RecipeError(f"{path}: {e}") from None
    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:
        raise RecipeError(format_validation_error(e, str(path), origin)) from None


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
