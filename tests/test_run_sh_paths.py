"""`bash recipes/<model>/run.sh` from the repository root with root-relative paths: inputs are found from the
caller's folder (then the recipe folder, as the READMEs write them) and outputs are written next to the caller."""
import os
import subprocess
from pathlib import Path

import pytest

from common.cli_paths import CALLER_DIR_ENV

ROOT = Path(__file__).resolve().parents[1]


def run(recipe, *args, cwd=ROOT, env=None, timeout=300):
    return subprocess.run(["bash", f"recipes/{recipe}/run.sh", *map(str, args)] if cwd == ROOT else
                          ["bash", str(ROOT / "recipes" / recipe / "run.sh"), *map(str, args)],
                          cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout)


def from_root(recipe: str, path: Path) -> str:
    """`path` relative to the repository root, checked to mean nothing from the recipe folder."""
    rel = os.path.relpath(path, ROOT)
    assert (ROOT / rel).resolve() == path.resolve() and not (ROOT / "recipes" / recipe / rel).exists()
    return rel


def one_line_error(r, needle):
    return r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr


def test_deepseek(tmp_path):
    out = from_root("deepseek", tmp_path) + "/routing.json"
    r = run("deepseek", "--config", "recipes/deepseek/configs/tiny-cpu.yaml", "--prompts",
            "recipes/deepseek/prompts.txt", "--max-tokens", 1, "--record-routing", out)
    assert r.returncode == 0, r.stderr
    assert len([line for line in r.stdout.splitlines() if line.startswith("> ")]) == 4  # the bundled prompts
    assert (tmp_path / "routing.json").stat().st_size > 0


def test_deepseek_serve_reads_the_root_relative_preset():
    # this preset's expert parallel size cannot split the tiny model: refused after the preset is read
    r = run("deepseek", "--serve", "--config", "recipes/deepseek/configs/atlas-a3-flash.yaml")
    assert one_line_error(r, "moe_ep=16 does not divide"), r.stderr


def test_hstu(tmp_path):
    r = run("hstu", "--config", "recipes/hstu/configs/tiny-cpu.yaml")
    assert r.returncode == 0, r.stderr
    assert len([line for line in r.stdout.splitlines() if line.startswith("auc ")]) == 8
    assert "configs/tiny-cpu.yaml" in r.stdout  # the dtype line names the preset


def test_hunyuan_image(tmp_path):
    r = run("hunyuan-image", "--config", "recipes/hunyuan-image/configs/tiny-cpu.yaml", "--infer-steps", 1,
            "--output", from_root("hunyuan-image", tmp_path) + "/image.png")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "image.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hunyuan_video_counts_the_ranks_from_the_root_relative_preset(tmp_path):
    preset = tmp_path / "sp2.yaml"  # a preset asking for 2 ranks
    preset.write_text((ROOT / "recipes/hunyuan-video/configs/tiny-cpu.yaml").read_text() +
                      "\nparallel: {ulysses_degree: 2, ring_degree: 1}\n")
    r = run("hunyuan-video", "--config", from_root("hunyuan-video", preset), "--world-size")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["2", "2"]  # run.sh's torchrun branch: both ranks read the preset and count 2


def test_magihuman(tmp_path):
    from PIL import Image

    Image.new("RGB", (64, 64), (200, 120, 40)).save(tmp_path / "frame.png")
    rel = from_root("magihuman", tmp_path)
    r = run("magihuman", "--image", rel + "/frame.png", "--out", rel + "/clip.mp4")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "clip.mp4").read_bytes()[4:8] == b"ftyp"


@pytest.mark.parametrize("recipe, args", [
    ("deepseek", ["--config", "configs/nope.yaml"]),
    ("hstu", ["--config", "configs/nope.yaml"]),
    ("hunyuan-image", ["--config", "configs/nope.yaml"]),
    ("hunyuan-video", ["--config", "configs/nope.yaml"]),
    ("magihuman", ["--image", "nope.png"]),
])
def test_nonexistent_path_gives_one_line_naming_it_and_exit_2(recipe, args):
    r = run(recipe, *args)
    assert one_line_error(r, f"{ROOT / args[1]}:"), r.stderr  # looked for from the caller's folder


def test_readme_paths_relative_to_the_recipe_folder_still_work(tmp_path):
    r = run("hstu", "--config", "configs/tiny-cpu.yaml", "--batch-users", 0, cwd=tmp_path)
    assert one_line_error(r, "--batch-users 0"), r.stderr  # the preset was found, the next check refused


def test_a_run_sh_started_by_a_recipe_keeps_the_first_callers_folder(tmp_path):
    # common/serving/serve_dp.py starts its instances' run.sh from the recipe folder with the same arguments
    r = run("hstu", "--config", "recipes/hstu/configs/tiny-cpu.yaml", "--batch-users", 0, cwd=tmp_path,
            env={CALLER_DIR_ENV: str(ROOT)})
    assert one_line_error(r, "--batch-users 0"), r.stderr
