"""`bash recipes/magihuman/run.sh` as a user runs it: a subprocess, a real MP4 opened with PyAV; CLI errors."""
import subprocess
from pathlib import Path

import pytest

import generate_magihuman
from common.diffusion.media import probe_mp4

RUN_SH = Path(__file__).resolve().parents[3] / "recipes" / "magihuman" / "run.sh"


def audio_matches(decoded: float, seconds: float) -> bool:
    """AAC pads to whole 1024-sample frames plus one priming frame: decoded is up to 2048 samples longer."""
    return seconds - 1e-3 <= decoded <= seconds + 2048 / 44100 + 1e-3


def run(*args, timeout=240):
    return subprocess.run(["bash", str(RUN_SH), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def test_default_run_writes_an_mp4_with_audio():
    r = run()
    assert r.returncode == 0, r.stderr
    out = Path(r.stdout.split("wrote ", 1)[1].split(" (")[0])
    assert out.is_file() and out.parent.name == "magihuman"
    info = probe_mp4(out)
    A = round(25 * 0.4) + 1  # 11 audio latents -> T = 3 latent frames -> 9 frames
    assert (info["frames"], info["width"], info["height"], info["fps"]) == (9, 64, 64, 25.0)
    assert info["audio_rate"] == 44100 and audio_matches(info["audio_seconds"], A * 2048 / 51200)
    stages = dict(kv.split("=") for kv in r.stdout.split("stages: ", 1)[1].splitlines()[0].split())
    assert {"text", "denoise", "vae_decode", "audio_decode"} <= set(stages)
    assert all(float(v.rstrip("s")) >= 0 for v in stages.values())
    assert "mode=distill" in r.stdout and r.stderr.strip() == ""


def test_image_offload_and_size_options(tmp_path, capsys):
    from PIL import Image

    Image.new("RGB", (40, 30), (200, 30, 30)).save(tmp_path / "first.png")
    out = tmp_path / "clip.mp4"
    args = ["--image", tmp_path / "first.png", "--offload", "--seconds", "0.2", "--size", "96x64", "--seed", "5",
            "--out", out]
    assert generate_magihuman.main([str(a) for a in args]) == 0  # in-process: the same main() run.sh executes
    info = probe_mp4(out)
    assert (info["frames"], info["width"], info["height"]) == (5, 96, 64) and "offload=1" in capsys.readouterr().out
    assert audio_matches(info["audio_seconds"], 6 * 2048 / 51200)


@pytest.mark.parametrize("args, needle", [
    (("--mode", "turbo"), "--mode"),
    (("--size", "10x10"), "--size"),
    (("--size", "big"), "--size"),
    (("--seconds", "-1"), "--seconds"),
    (("--weights", "/no/such/dir"), "/no/such/dir"),
    (("--image", "/no/such.png"), "/no/such.png"),
])
def test_bad_arguments_give_one_line_and_exit_2(args, needle, capsys):
    with pytest.raises(SystemExit) as e:  # in-process: the same main() run.sh executes
        generate_magihuman.main(list(args))
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and needle in err


def test_incomplete_weights_and_unreadable_image(tmp_path, capsys):
    (tmp_path / "w" / "base").mkdir(parents=True)
    with pytest.raises(SystemExit) as e:
        generate_magihuman.main(["--weights", str(tmp_path / "w")])
    assert e.value.code == 2 and "missing distill" in capsys.readouterr().err
    (tmp_path / "not.png").write_text("text")
    with pytest.raises(SystemExit) as e:
        generate_magihuman.main(["--image", str(tmp_path / "not.png")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "not a readable image" in err


def test_corrupt_dit_folder_is_one_line_exit_2(tiny_weights, tmp_path, capsys):
    weights = tmp_path / "w"
    weights.mkdir()
    for part in generate_magihuman.PARTS:
        (weights / part).symlink_to(tiny_weights / part)
    (weights / "distill").unlink()
    (weights / "distill").mkdir()
    (weights / "distill" / "config.json").write_text("{}")
    assert generate_magihuman.main(["--weights", str(weights), "--seconds", "0.2", "--size", "64x64",
                                    "--out", str(tmp_path / "x.mp4")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no model.safetensors" in err


def test_bad_argument_through_run_sh():
    r = run("--mode", "turbo")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--mode" in r.stderr


def test_cli_modes_are_the_pipelines():
    import pipeline_magihuman

    assert generate_magihuman.MODES == pipeline_magihuman.MODES
