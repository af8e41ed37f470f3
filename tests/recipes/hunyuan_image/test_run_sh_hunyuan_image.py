"""`bash recipes/hunyuan-image/run.sh` as a user runs it: a subprocess, a real PNG; bad input -> one line, exit 2."""
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import generate_hunyuan_image

RUN_SH = Path(__file__).resolve().parents[3] / "recipes" / "hunyuan-image" / "run.sh"


def run(*args, timeout=180):
    return subprocess.run(["bash", str(RUN_SH), *map(str, args)], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """`run.sh --output a.png`, one rank: the default run, and the one the EP run is compared with (started once)."""
    out = tmp_path_factory.mktemp("default-run") / "a.png"
    return run("--output", out), out


def test_default_run_writes_a_png(default_run):
    r, out = default_run
    assert r.returncode == 0, r.stderr
    assert f"wrote {out}" in r.stdout
    stats = dict(kv.split("=") for kv in r.stdout.strip().splitlines()[-1].split())
    assert stats["size"] == "64x64" and stats["steps"] == "4" and float(stats["denoise_s"]) > 0
    assert "denoise" in r.stderr  # the progress bar over steps
    with Image.open(out) as im:
        assert im.size == (64, 64) and im.mode == "RGB"
        pixels = np.asarray(im)
    assert pixels.std() > 0  # not a blank image
    root = RUN_SH.parents[2]
    assert (root / "weights" / "hunyuan-image-tiny" / "config.json").is_file()


@pytest.mark.parametrize("args, needle", [
    (("--image-size", "65x64"), "multiples of 16"),
    (("--image-size", "16"), "at least 32"),
    (("--image-size", "big"), "--image-size"),
    (("--infer-steps", "0"), "--infer-steps"),
    (("--weights", "/no/such/dir"), "/no/such/dir"),
    (("--cfg-parallel", "--guidance", "1"), "--cfg-parallel"),
    (("--ep", "2", "--tp", "4"), "ep=2"),
    (("--cfg-parallel", "--ep", "2"), "needs --tp 2"),
    (("--config", "/no/such.yaml"), "/no/such.yaml"),
])
def test_bad_arguments_give_one_line_and_exit_2(args, needle, capsys):
    with pytest.raises(SystemExit) as e:  # in-process: the same main() run.sh executes
        generate_hunyuan_image.main(list(args))
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


def test_presets(tmp_path):
    configs = RUN_SH.parent / "configs"
    a3 = generate_hunyuan_image.parse_args(["--config", str(configs / "atlas-a3.yaml")])
    assert (a3.layout.world_size, a3.cfg_axis, a3.tp, a3.ep, a3.dtype, a3.size, a3.infer_steps) == \
        (16, "dp", 8, 8, "bf16", (1024, 1024), 50)
    a2 = generate_hunyuan_image.parse_args(["--config", str(configs / "atlas-a2.yaml"), "--infer-steps", "3"])
    assert (a2.layout.world_size, a2.cfg_parallel, a2.infer_steps) == (8, False, 3)  # the flag wins
    tiny = generate_hunyuan_image.parse_args([])
    assert (tiny.layout.world_size, tiny.size, tiny.infer_steps, tiny.dtype) == (1, (64, 64), 4, "fp32")
    bad = tmp_path / "bad.yaml"
    bad.write_text("dtype: fp32\nsteps: 3\n")
    with pytest.raises(SystemExit) as e:
        generate_hunyuan_image.parse_args(["--config", str(bad)])
    assert e.value.code == 2


def test_bad_checkpoint_through_run_sh(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    r = run("--weights", tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "model.safetensors" in r.stderr, r.stderr


@pytest.mark.slow
def test_ep_run_under_torchrun_matches_one_rank(default_run, tmp_path):
    (first, one), two = default_run, tmp_path / "ep2.png"
    assert first.returncode == 0
    r = run("--ep", "2", "--output", two, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "ranks=2" in r.stdout and r.stdout.count("wrote ") == 1  # rank 0 writes, once
    a, b = (np.asarray(Image.open(p)).astype(int) for p in (one, two))
    assert np.abs(a - b).max() <= 1  # fp32 sums in another order: at most one level of rounding
