"""The README's "Adapting" file lists hold: each family's model files, copied alone into an empty folder and
imported from there in a fresh process, run without any other recipe file. The MLA kind: its four model files;
the V4 kind, text only: its four, its encoding and chat format (the vision files are read for a vision checkpoint
only), with a text-only V4 tiny checkpoint written and loaded by the copy."""
import shutil
import subprocess
import sys
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "deepseek"

PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
for name in sys.argv[3:]:
    __import__(name)
if sys.argv[2] != "-":
    import torch, tiny_deepseek_v4, weights_deepseek_v4
    path = tiny_deepseek_v4.write_tiny_checkpoint(sys.argv[2], quantized=False, vision=False)
    model = weights_deepseek_v4.load_model(path, torch.float32)
    assert model.vision_model is None and model.engine_contract().encoder is None
"""


def run_copy(folder: Path, names: set[str], tiny: Path | None = None) -> None:
    folder.mkdir()
    for name in names:
        shutil.copy(RECIPE / f"{name}.py", folder)
    r = subprocess.run([sys.executable, "-c", PROBE, str(folder), str(tiny or "-"), *sorted(names)],
                       capture_output=True, text=True, timeout=300, cwd=folder)
    assert r.returncode == 0, r.stderr


def test_the_mla_family_runs_from_its_four_files(tmp_path):
    run_copy(tmp_path / "copy", {"config_deepseek_v3", "modeling_deepseek_v3", "weights_deepseek_v3",
                                 "tiny_deepseek_v3"})


def test_a_text_only_v4_model_runs_without_v3_or_the_vision_files(tmp_path):
    run_copy(tmp_path / "copy", {"config_deepseek_v4", "modeling_deepseek_v4", "weights_deepseek_v4",
                                 "tiny_deepseek_v4", "encoding_deepseek_v4", "chat_format_deepseek_v4"},
             tiny=tmp_path / "v4")
