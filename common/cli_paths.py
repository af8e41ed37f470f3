"""Path arguments of the recipes' command lines, resolved against the folder the user ran the command from.

Every `run.sh` changes into its recipe folder before starting Python, and first records the caller's folder in
NPU_COOKBOOK_CALLER_DIR (kept as it is when a recipe starts another `run.sh`, as common/serving/serve_dp.py does
for its instances). A script started without `run.sh` has the working directory as its caller's folder.

- A path the command reads (`input_path(recipe_dir)`): absolute as given; relative: from the caller's folder when
  it exists there, else from the recipe folder when it exists there (the READMEs' `--config configs/X.yaml`), else
  from the caller's folder, so the script's own check names where it was looked for.
- A path the command writes (`output_path`): absolute as given; relative: from the caller's folder.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

CALLER_DIR_ENV = "NPU_COOKBOOK_CALLER_DIR"


def caller_dir() -> Path:
    """The folder the user ran the command from: what run.sh recorded, else the working directory."""
    return Path(os.environ.get(CALLER_DIR_ENV) or os.getcwd())


def _as_path(text: str) -> Path:
    if not text:
        raise argparse.ArgumentTypeError("empty path")
    return Path(text)


def input_path(recipe_dir: Path) -> Callable[[str], Path]:
    """argparse `type=` for a path the command reads: the caller's folder first, then `recipe_dir`."""
    def resolve(text: str) -> Path:
        path = _as_path(text)
        if path.is_absolute():
            return path
        from_caller = caller_dir() / path
        if from_caller.exists():
            return from_caller
        from_recipe = Path(recipe_dir) / path
        return from_recipe if from_recipe.exists() else from_caller

    resolve.__name__ = "input_path"  # argparse names the type in its messages
    return resolve


def output_path(text: str) -> Path:
    """argparse `type=` for a path the command writes: from the caller's folder."""
    path = _as_path(text)
    return path if path.is_absolute() else caller_dir() / path
