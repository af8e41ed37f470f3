"""Recipe folders are not packages: put each on sys.path so tests import their modules (names are unique)."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for recipe in sorted((ROOT / "recipes").iterdir()):
    if recipe.is_dir():
        sys.path.insert(0, str(recipe))
