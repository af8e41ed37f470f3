"""The README's "Adapting" file lists hold: each family's files, imported in a fresh process from the recipe folder,
read no file outside their list, so a copy of that list runs on its own. The MLA kind: its four model files; the
V4 kind: its four, its encoding and chat format, and the vision files only for a vision checkpoint (a text-only
V4 tiny checkpoint is written and loaded without them)."""
import json
import subprocess
import sys
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "deepseek"
OWN = {p.stem for p in RECIPE.glob("*.py")}  # the recipe's top-level modules

PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
for name in sys.argv[3:]:
    __import__(name)
if sys.argv[2] != "-":
    import torch, tiny_deepseek_v4, weights_deepseek_v4
    path = tiny_deepseek_v4.write_tiny_checkpoint(sys.argv[2], quantized=False, vision=False)
    model = weights_deepseek_v4.load_model(path, torch.float32)
    assert model.vision_model is None and model.engine_contract().encoder is None
print(json.dumps(sorted(sys.modules)))
"""


def recipe_modules_read(*names: str, tiny: Path | None = None) -> set[str]:
    r = subprocess.run([sys.executable, "-c", PROBE, str(RECIPE), str(tiny or "-"), *names], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout.splitlines()[-1])) & OWN


def test_the_mla_family_reads_only_its_four_files():
    four = {"config_deepseek_v3", "modeling_deepseek_v3", "weights_deepseek_v3", "tiny_deepseek_v3"}
    assert recipe_modules_read(*four) == four


def test_a_text_only_v4_model_reads_neither_v3_nor_the_vision_files(tmp_path):
    files = {"config_deepseek_v4", "modeling_deepseek_v4", "weights_deepseek_v4", "tiny_deepseek_v4",
             "encoding_deepseek_v4", "chat_format_deepseek_v4"}
    assert recipe_modules_read(*files, tiny=tmp_path / "v4") == files
