"""`bash recipes/hunyuan-video/run.sh` as a user runs it: a subprocess, real files, a decodable MP4; torchrun for --sp."""
import subprocess
from pathlib import Path

import numpy as np
import pytest

from common.diffusion.media import probe_mp4

RUN_SH = Path(__file__).resolve().parents[3] / "recipes" / "hunyuan-video" / "run.sh"


def run(*args, timeout=300):
    return subprocess.run(["bash", str(RUN_SH), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def frames(path):
    import av

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]).astype(np.float32)


def test_default_run_writes_the_mp4():
    r = run()
    assert r.returncode == 0, r.stderr
    root = RUN_SH.parents[2]
    path = root / "outputs" / "hunyuan-video" / "video.mp4"
    assert f"wrote {path}" in r.stdout and "denoise" in r.stdout and "vae decode" in r.stdout
    info = probe_mp4(path)
    assert (info["frames"], info["height"], info["width"], info["fps"]) == (5, 64, 64, 24.0)
    assert (root / "weights" / "hunyuan-video-tiny" / "hunyuan-video-t2v-720p" / "transformers").is_dir()


@pytest.mark.parametrize("args, needle", [
    (("--weights", "/no/such/dir"), "/no/such/dir"),
    (("--config", "/no/such.yaml"), "/no/such.yaml"),
    (("--video-size", "40", "64"), "multiples of 16"),
    (("--video-length", "6"), "4k + 1"),
    (("--cache", "magic"), "--cache"),
    (("--sp", "0"), "--sp"),
    (("--sp", "4", "--ulysses-degree", "2"), "--ring-degree"),
    (("--ring-degree", "0"), "--ring-degree"),
    (("--cfg-parallel",), "true CFG"),
])
def test_bad_arguments_give_one_line_and_exit_2(args, needle):
    r = run(*args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_a_bad_preset_is_one_line(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("dtype: fp8\n")
    r = run("--config", preset)
    assert r.returncode == 2 and "dtype 'fp8'" in r.stderr and "Traceback" not in r.stderr


def test_a_folder_without_the_checkpoint_is_one_line(tmp_path):
    r = run("--weights", tmp_path)
    assert r.returncode == 2 and "transformers" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_sequence_and_cfg_parallel_runs_match_one_rank(tmp_path):
    """With true CFG: --ring-degree 2 (ring attention, patch-parallel VAE) and --cfg-parallel (cond / uncond on two
    ranks) under torchrun write the same video as one rank (fp32: in bf16 the ranks' different reduction orders
    show, about 2/255 per pixel on these random weights)."""
    args = ("--video-size", "32", "32", "--video-length", "5", "--infer-steps", "2", "--vae-tiling", "--dtype", "fp32",
            "--true-cfg-scale", "3", "--negative-prompt", "blurry")
    videos = {}
    for name, extra, stamp in [("one", (), "sp=1"), ("ring", ("--ring-degree", "2"), "sp=2 (ulysses 1 x ring 2)"),
                               ("cfg", ("--cfg-parallel",), "cfg=2")]:
        r = run(*args, *extra, "--output", tmp_path / f"{name}.mp4")
        assert r.returncode == 0, r.stderr
        assert stamp in r.stdout
        videos[name] = frames(tmp_path / f"{name}.mp4")
    assert videos["one"].shape == (5, 32, 32, 3)
    for name in ("ring", "cfg"):
        # The pipelines agree to ~3e-6 (fp32); one pixel whose 8-bit rounding flips can change the H.264 encoder's
        # choices around it, so compare the decoded videos on average: a real mismatch moves every pixel.
        assert videos[name].shape == videos["one"].shape
        assert np.abs(videos[name] - videos["one"]).mean() < 0.5, name


@pytest.mark.parametrize("preset, ranks", [("tiny-cpu.yaml", 1), ("atlas-a3-720p.yaml", 8),
                                           ("atlas-a3-720p-teacache.yaml", 8)])
def test_presets_parse_and_say_their_rank_count(preset, ranks, capsys):
    import generate_hunyuan_video

    with pytest.raises(SystemExit) as stop:
        generate_hunyuan_video.parse_args(["--config", str(RUN_SH.parent / "configs" / preset), "--world-size"])
    assert stop.value.code == 0 and capsys.readouterr().out.strip() == str(ranks)
