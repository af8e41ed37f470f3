"""Recipe folders are not packages: put each on sys.path, with its bench/ and tools/, so tests import their modules
(names are unique)."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for recipe in sorted((ROOT / "recipes").iterdir()):
    for folder in (recipe / "tools", recipe / "bench", recipe):  # a recipe's own modules first
        if folder.is_dir():
            sys.path.insert(0, str(folder))
