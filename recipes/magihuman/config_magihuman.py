"""daVinci-MagiHuman DiT configuration: the publisher's defaults (15B), the tiny test config, and checks.

Per checkpoint folder the publisher ships base/, distill/, 540p_sr/, 1080p_sr/ with one architecture; what differs
is read from the folder name (`variant`): SR models use the v1 text RoPE coordinates, and the 1080p SR model local
attention in every layer but each fourth. config.json keys with the field names below override the defaults.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

VIDEO, AUDIO, TEXT = 0, 1, 2  # modality = expert index
VARIANTS = ("base", "distill", "540p_sr", "1080p_sr")


@dataclass(slots=True)
class MagiHumanConfig:
    num_layers: int = 40
    hidden_size: int = 5120
    head_dim: int = 128
    num_heads_q: int = 40
    num_heads_kv: int = 8
    video_in_channels: int = 192  # 48 latent channels x (1 x 2 x 2) patch
    audio_in_channels: int = 64
    text_in_channels: int = 3584  # T5Gemma 9B encoder width
    mm_layers: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 36, 37, 38, 39])  # 3 modality experts
    gelu7_layers: list[int] = field(default_factory=lambda: [0, 1, 2, 3])  # swiglu7 elsewhere
    gelu7_intermediate: int = 0  # 0: 4 * hidden
    swiglu_intermediate: int = 0  # 0: int(4 * hidden * 2 / 3) // 4 * 4
    attention_gating: bool = True  # per-head sigmoid gate on the attention output (g columns in linear_qkv)
    local_attn_layers: list[int] = field(default_factory=list)
    local_attn_frames: int = 11  # video queries of latent frame i see video frames [i - n, i + n]
    text_rope: str = "v2"  # v2: text unrotated (base, distill); v1: text t = 0..L-1 scaled into [0, 1] (SR)
    rope_theta: float = 10000.0
    eps: float = 1e-6
    latent_channels: int = 48
    patch_size: tuple[int, int, int] = (1, 2, 2)
    variant: str = "base"

    def __post_init__(self):
        self.patch_size = tuple(self.patch_size)
        if not self.gelu7_intermediate:
            self.gelu7_intermediate = 4 * self.hidden_size
        if not self.swiglu_intermediate:
            self.swiglu_intermediate = int(4 * self.hidden_size * 2 / 3) // 4 * 4
        assert self.variant in VARIANTS, f"variant {self.variant!r}: expected one of {VARIANTS}"
        assert self.text_rope in ("v1", "v2"), f"text_rope {self.text_rope!r}: expected v1 or v2"
        assert self.num_heads_q * self.head_dim == self.hidden_size, \
            f"{self.num_heads_q} heads x {self.head_dim} != hidden {self.hidden_size}"
        assert self.num_heads_q % self.num_heads_kv == 0, "q heads must be a multiple of kv heads (GQA)"
        assert self.head_dim % 8 == 0, f"head_dim {self.head_dim}: RoPE needs 3 axes x 2 x (head_dim / 8) bands"
        for name in ("mm_layers", "gelu7_layers", "local_attn_layers"):
            layers = getattr(self, name)
            assert all(0 <= i < self.num_layers for i in layers), f"{name} {layers} outside 0..{self.num_layers - 1}"
        pt, ph, pw = self.patch_size
        assert self.video_in_channels == self.latent_channels * pt * ph * pw, \
            f"video_in_channels {self.video_in_channels} != {self.latent_channels} x patch {self.patch_size}"
        assert self.local_attn_frames >= 0

    @property
    def qkv_size(self) -> int:  # [q | k | v | gate] columns of linear_qkv, per expert
        gate = self.num_heads_q if self.attention_gating else 0
        return (self.num_heads_q + 2 * self.num_heads_kv) * self.head_dim + gate

    @property
    def rope_bands(self) -> int:  # frequencies per axis (t, h, w): 16 for head_dim 128
        return self.head_dim // 8

    def num_experts(self, layer: int) -> int:
        return 3 if layer in self.mm_layers else 1

    @classmethod
    def for_variant(cls, variant: str, **overrides) -> MagiHumanConfig:
        """Defaults of a publisher folder: SR models take v1 text coordinates; 1080p SR adds local attention."""
        kw = {"variant": variant}
        if variant.endswith("_sr"):
            kw["text_rope"] = "v1"
        if variant == "1080p_sr":  # full attention only in layers 3, 7, .., 31
            n = overrides.get("num_layers", 40)
            kw["local_attn_layers"] = [i for i in range(n) if i not in range(3, 32, 4)]
        return cls(**(kw | overrides))

    @classmethod
    def from_folder(cls, path) -> MagiHumanConfig:
        path = Path(path)
        variant = path.name if path.name in VARIANTS else "base"
        known = {f.name for f in fields(cls)}
        raw = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
        overrides = {k: v for k, v in raw.items() if k in known}
        return cls.for_variant(overrides.pop("variant", variant), **overrides)

    def to_dict(self) -> dict:
        return asdict(self)


def tiny_config(variant: str = "base") -> MagiHumanConfig:
    """The spec's tiny faithful config: every structural feature at hidden 64 (2 RoPE bands per axis)."""
    cfg = MagiHumanConfig.for_variant(
        variant, num_layers=4, hidden_size=64, head_dim=16, num_heads_q=4, num_heads_kv=2, text_in_channels=32,
        mm_layers=[0, 3], gelu7_layers=[0], local_attn_frames=1)
    if variant == "1080p_sr":
        cfg.local_attn_layers = [1, 2]
    return cfg
