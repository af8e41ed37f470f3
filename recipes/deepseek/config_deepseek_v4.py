"""DeepSeek-V4 model arguments, read straight from the checkpoint's config.json.

Accepts the transformers field names (`layer_types`, `mlp_layer_types`, `compress_rates`, nested
`rope_parameters`) and the older names the publisher's configs carry (`compress_ratios`, `num_hash_layers`,
`compress_rate_csa` / `compress_rate_hca`, `qk_rope_head_dim`, `rope_scaling`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")


@dataclass
class ModelArgs:
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    q_lora_rank: int = 1024
    qk_rope_head_dim: int = 64
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    compress_rope_scaling: dict | None = None  # YaRN parameters of the compressed branches, or None
    layer_types: list[str] = field(default_factory=list)
    compress_rates: dict[str, int] = field(default_factory=lambda: {CSA: 4, HCA: 128})
    mlp_layer_types: list[str] = field(default_factory=list)
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-6
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    tie_word_embeddings: bool = False
    quant_format: str | None = None  # "w8a8" | "w4a8": a checkpoint convert_checkpoint.py wrote; None: float weights
    quant_group_size: int | None = None  # w4a8: inputs per int4 scale
    vision_config: dict | None = None  # the vision tower's (Vision-Exp layout: modeling_deepseek_vision.VisionArgs)
    image_token_id: int | None = None  # the prompt's image placeholder `<｜deepseek_image｜>`

    def __post_init__(self):
        n = self.num_hidden_layers
        if not self.layer_types:
            self.layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        if not self.mlp_layer_types:
            self.mlp_layer_types = ["hash_moe"] * min(n, 3) + ["moe"] * max(n - 3, 0)
        for name in ("layer_types", "mlp_layer_types"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, num_hidden_layers is {n}")
        if bad := set(self.layer_types) - {SLIDING, CSA, HCA}:
            raise ValueError(f"unknown layer_types {sorted(bad)}")
        if bad := set(self.mlp_layer_types) - {"hash_moe", "moe"}:
            raise ValueError(f"unknown mlp_layer_types {sorted(bad)}")
        if self.scoring_func not in SCORE_FUNCS:
            raise ValueError(f"scoring_func {self.scoring_func!r} not in {SCORE_FUNCS}")
        if self.num_attention_heads % self.o_groups:
            raise ValueError("num_attention_heads must be divisible by o_groups")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ValueError("qk_rope_head_dim must be even and fit in head_dim and index_head_dim")
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError("num_experts_per_tok must be in [1, n_routed_experts]")
        if self.n_shared_experts not in (0, 1):
            raise ValueError("n_shared_experts must be 0 or 1")
        if self.sliding_window < 1 or any(r < 1 for r in self.compress_rates.values()):
            raise ValueError("sliding_window and compress rates must be >= 1")
        if self.quant_format not in (None, "w8a8", "w4a8"):
            raise ValueError(f"quant_format {self.quant_format!r}: expected w8a8, w4a8 or none")
        if (self.quant_format == "w4a8") != (self.quant_group_size is not None):
            raise ValueError("quant_group_size is set exactly for w4a8")
        if self.has_vision and not (isinstance(self.image_token_id, int) and 0 <= self.image_token_id < self.vocab_size):
            raise ValueError(f"a vision checkpoint needs image_token_id in [0, {self.vocab_size}), got "
                             f"{self.image_token_id!r}")

    @property
    def has_vision(self) -> bool:
        """A vision tower (upstream: vision_config with num_hidden_layers > 0): image inputs, `bias_vl` routing."""
        return int((self.vision_config or {}).get("num_hidden_layers", 0)) > 0

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def compress_rate(self, layer: int) -> int:
        """Tokens per compressed entry of a layer; 0 for sliding-window-only layers."""
        return self.compress_rates.get(self.layer_types[layer], 0)

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        cfg = dict(cfg)
        n = cfg.get("num_hidden_layers", cls.num_hidden_layers)
        if "compress_ratios" in cfg and not cfg.get("layer_types"):
            cfg["layer_types"] = [_RATIO_TO_TYPE[r] for r in cfg["compress_ratios"][:n]]
        if "num_hash_layers" in cfg and not cfg.get("mlp_layer_types"):
            k = cfg["num_hash_layers"]
            cfg["mlp_layer_types"] = ["hash_moe"] * min(n, k) + ["moe"] * max(n - k, 0)
        rates = dict(cfg.get("compress_rates") or {CSA: 4, HCA: 128})
        if "compress_rate_csa" in cfg:
            rates[CSA] = cfg["compress_rate_csa"]
        if "compress_rate_hca" in cfg:
            rates[HCA] = cfg["compress_rate_hca"]
        cfg["compress_rates"] = rates
        head_dim = cfg.get("head_dim", cls.head_dim)
        if "qk_rope_head_dim" not in cfg:
            cfg["qk_rope_head_dim"] = int(head_dim * (cfg.get("partial_rotary_factor") or 64 / 512))
        rope = cfg.get("rope_parameters") or {}
        if isinstance(rope.get("main"), dict):  # transformers' nested form
            cfg.setdefault("rope_theta", rope["main"].get("rope_theta", cls.rope_theta))
            comp = rope.get("compress") or {}
            cfg["compress_rope_theta"] = comp.get("rope_theta", cfg.get("compress_rope_theta", cls.compress_rope_theta))
            scaling = comp if comp.get("rope_type", comp.get("type")) == "yarn" else None
        else:
            scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", rope.get("type")) == "yarn" else None)
        cfg["compress_rope_scaling"] = dict(scaling) if scaling else None
        quant = cfg.get("quantization_config") or {}
        if quant.get("quant_method") == "npu-cookbook":  # convert_checkpoint.py's; the publisher's FP8 is dequantized
            cfg["quant_format"], cfg["quant_group_size"] = quant["format"], quant.get("group_size")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in cfg.items() if k in names})
