"""Media writers for the diffusion recipes: PNG (Pillow) and MP4 (PyAV: H.264 video, optional AAC audio).

Pixel tensors come in the layout VAEs decode to, values in [-1, 1]:
    image  [3, H, W]            (or [1, 3, H, W])
    video  [3, T, H, W]         (or [1, 3, T, H, W])
    audio  [channels, samples]  (or [samples]), values in [-1, 1], float
H.264 in yuv420p needs even H and W: odd sizes are padded by one edge row / column (replicated).
"""
from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import torch


def to_uint8(pixels: torch.Tensor) -> np.ndarray:
    """[-1, 1] pixels [3, ..., H, W] -> uint8 array [..., H, W, 3] (channels last)."""
    if pixels.shape[0] != 3:
        raise ValueError(f"expected 3 channels first, got shape {tuple(pixels.shape)}")
    x = ((pixels.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.movedim(0, -1).cpu().numpy()


def _unbatch(x: torch.Tensor, ndim: int, what: str) -> torch.Tensor:
    if x.ndim == ndim + 1 and x.shape[0] == 1:
        x = x[0]
    if x.ndim != ndim:
        raise ValueError(f"{what}: expected {ndim} dims (or a batch of one), got shape {tuple(x.shape)}")
    return x


def write_png(path: str | Path, image: torch.Tensor) -> Path:
    """Write image [3, H, W] in [-1, 1] as a PNG; returns the path."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(to_uint8(_unbatch(image, 3, "write_png"))).save(path)
    return path


def write_mp4(path: str | Path, video: torch.Tensor, fps: float = 25, audio: torch.Tensor | None = None,
              sample_rate: int = 44100, crf: int = 18) -> Path:
    """Write video [3, T, H, W] in [-1, 1] as H.264 MP4 at `fps`, muxing `audio` [channels, samples] as AAC."""
    import av

    frames = to_uint8(_unbatch(video, 4, "write_mp4"))  # [T, H, W, 3]
    T, H, W, _ = frames.shape
    if H % 2 or W % 2:  # yuv420p subsamples chroma 2x2
        frames = np.pad(frames, ((0, 0), (0, H % 2), (0, W % 2), (0, 0)), mode="edge")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.options = {"crf": str(crf)}
        if audio is not None:
            audio = audio.detach().float().cpu().clamp(-1, 1)
            audio = audio[None] if audio.ndim == 1 else _unbatch(audio, 2, "write_mp4 audio")
            if audio.shape[0] not in (1, 2):
                raise ValueError(f"write_mp4: audio must be mono or stereo, got {audio.shape[0]} channels")
            a_stream = container.add_stream("aac", rate=sample_rate)
            a_stream.layout = "stereo" if audio.shape[0] == 2 else "mono"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if audio is not None:
            samples = audio.numpy().astype(np.float32)  # [channels, samples], planar float
            a_frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout=a_stream.layout.name)
            a_frame.sample_rate = sample_rate
            for packet in a_stream.encode(a_frame):
                container.mux(packet)
            for packet in a_stream.encode():
                container.mux(packet)
    return path


def probe_mp4(path: str | Path) -> dict:
    """Decode an MP4 and describe it: frames, height, width, fps, audio_seconds (None without audio), audio_rate."""
    import av

    info = {"frames": 0, "height": None, "width": None, "fps": None, "audio_seconds": None, "audio_rate": None}
    with av.open(str(path)) as container:
        video = container.streams.video[0]
        info["fps"] = float(video.average_rate) if video.average_rate else None
        for frame in container.decode(video=0):
            info["frames"] += 1
            info["height"], info["width"] = frame.height, frame.width
    with av.open(str(path)) as container:
        if container.streams.audio:
            rate, samples = container.streams.audio[0].rate, 0
            for frame in container.decode(audio=0):
                samples += frame.samples
            info["audio_seconds"], info["audio_rate"] = samples / rate, rate
    return info
