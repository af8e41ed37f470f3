"""Media writers: what is written decodes back to the frames, size, rate and audio length asked for."""
import math

import numpy as np
import pytest
import torch
from PIL import Image

from common.diffusion.media import probe_mp4, to_uint8, write_mp4, write_png


def test_to_uint8_maps_range_and_moves_channels():
    x = torch.tensor([-1.0, 0.0, 1.0, 2.0]).view(1, 1, 4).expand(3, 1, 4)  # [3, H=1, W=4]
    out = to_uint8(x)
    assert out.shape == (1, 4, 3) and out.dtype == np.uint8
    assert out[0, :, 0].tolist() == [0, 128, 255, 255]


def test_png_round_trip(tmp_path):
    img = torch.rand(3, 20, 30) * 2 - 1
    path = write_png(tmp_path / "a" / "img.png", img[None])
    back = np.asarray(Image.open(path))
    assert back.shape == (20, 30, 3)
    assert np.array_equal(back, to_uint8(img))


def test_mp4_video_and_audio(tmp_path):
    video = torch.rand(3, 9, 32, 48) * 2 - 1
    t = torch.arange(16000) / 16000
    audio = 0.5 * torch.sin(2 * math.pi * 440 * t)[None]  # [1, 16000]: one second, mono
    info = probe_mp4(write_mp4(tmp_path / "v.mp4", video, fps=25, audio=audio, sample_rate=16000))
    assert (info["frames"], info["height"], info["width"], info["fps"]) == (9, 32, 48, 25.0)
    assert info["audio_rate"] == 16000
    assert abs(info["audio_seconds"] - 1.0) < 0.1  # AAC adds encoder priming / padding of < 2 frames of 1024


def test_mp4_without_audio_and_rejects_bad_shapes(tmp_path):
    info = probe_mp4(write_mp4(tmp_path / "v.mp4", torch.zeros(3, 4, 16, 16), fps=24))
    assert info["frames"] == 4 and info["audio_seconds"] is None and info["fps"] == 24.0
    with pytest.raises(ValueError, match="3 channels"):
        write_mp4(tmp_path / "w.mp4", torch.zeros(4, 4, 16, 16))
    with pytest.raises(ValueError, match="mono or stereo"):
        write_mp4(tmp_path / "w.mp4", torch.zeros(3, 4, 16, 16), audio=torch.zeros(3, 100))
