"""Model arguments of the MLA family (DeepSeek-V3 / R1, DeepSeek-V3.2, Kimi-K2), read from the HF config.json.

`model_type` deepseek_v3 and kimi_k2 (the same architecture and tensor names), deepseek_v32 (V3 plus DeepSeek
Sparse Attention: a lightning indexer per layer keeping the top `index_topk` keys of each query). RoPE
parameters come as the publisher's `rope_scaling` + `rope_theta` or as transformers' `rope_parameters`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "kimi_k2")
SPARSE_MODEL_TYPES = ("deepseek_v32",)
QUANT_METHOD = "npu-cookbook"  # convert_checkpoint.py's quantization_config.quant_method


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass
class ModelArgs:
    model_type: str = "deepseek_v3"
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432  # the dense MLP of the first first_k_dense_replace layers
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int | None = None  # MLA: as many as the query heads (None: so)
    q_lora_rank: int | None = 1536  # None: one q_proj, no low-rank query
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    first_k_dense_replace: int = 3
    mlp_layer_types: list[str] = field(default_factory=list)  # "dense" | "sparse" per layer (V3.2's name)
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    hidden_act: str = "silu"
    max_position_embeddings: int = 163840
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # YaRN: factor, original_max_position_embeddings, beta_*, mscale(_all_dim)
    rope_interleave: bool = True
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    tie_word_embeddings: bool = False
    fp8_block: list[int] | None = None  # the publisher's FP8 block (weight_block_size), dequantized on load
    quant_format: str | None = None  # "w8a8": a checkpoint convert_checkpoint.py wrote; None: float weights

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not one of {MODEL_TYPES}")
        H = self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = H
        if self.num_key_value_heads != H:
            raise ValueError(f"num_key_value_heads {self.num_key_value_heads} must equal num_attention_heads {H} "
                             "(MLA expands one latent per query head)")
        n = self.num_hidden_layers
        if not self.mlp_layer_types:
            k = min(self.first_k_dense_replace, n)
            self.mlp_layer_types = ["dense"] * k + ["sparse"] * (n - k)
        if len(self.mlp_layer_types) != n:
            raise ValueError(f"mlp_layer_types has {len(self.mlp_layer_types)} entries, num_hidden_layers is {n}")
        if bad := set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ValueError(f"unknown mlp_layer_types {sorted(bad)}: expected 'dense' or 'sparse'")
        for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "hidden_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank must be >= 1 or null, got {self.q_lora_rank}")
        if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even and >= 2, got {self.qk_rope_head_dim}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r}: only silu (SwiGLU) is supported")
        if self.attention_bias:
            raise ValueError("attention_bias is not supported (no published MLA checkpoint has it)")
        if self.scoring_func != "sigmoid" or self.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise ValueError(f"scoring_func {self.scoring_func!r} / topk_method {self.topk_method!r}: expected "
                             "sigmoid scores with noaux_tc (bias-corrected, group-limited) selection")
        E, G = self.n_routed_experts, self.n_group
        if G < 1 or E % G:
            raise ValueError(f"n_group {G} must divide n_routed_experts {E}")
        if not 1 <= self.topk_group <= G:
            raise ValueError(f"topk_group {self.topk_group} must be in [1, n_group {G}]")
        reachable = self.topk_group * (E // G)  # experts in the groups a token keeps
        if not 1 <= self.num_experts_per_tok <= reachable:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, {reachable}] "
                             f"(topk_group {self.topk_group} groups of {E // G} experts)")
        if G > 1 and E // G < 2:
            raise ValueError("group-limited routing scores each group by its top-2 experts: groups need >= 2 experts")
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.sparse:
            if self.q_lora_rank is None:
                raise ValueError("deepseek_v32's indexer reads the low-rank query: q_lora_rank must be set")
            if self.index_topk < 1 or self.index_n_heads < 1:
                raise ValueError("index_topk and index_n_heads must be >= 1")
            if not self.qk_rope_head_dim <= self.index_head_dim:
                raise ValueError(f"index_head_dim {self.index_head_dim} must hold qk_rope_head_dim "
                                 f"{self.qk_rope_head_dim}")
        if self.quant_format not in (None, "w8a8"):
            raise ValueError(f"quant_format {self.quant_format!r}: expected w8a8 or none")
        if self.fp8_block is not None and list(self.fp8_block) != [128, 128]:
            raise ValueError(f"fp8 weight_block_size {self.fp8_block}: only 128 x 128 blocks load")
        if self.rope_scaling is not None:
            for key in ("factor", "original_max_position_embeddings"):
                if key not in self.rope_scaling:
                    raise ValueError(f"rope_scaling (yarn) needs {key!r}")

    @property
    def sparse(self) -> bool:
        """DeepSeek Sparse Attention: a lightning indexer picks each query's keys."""
        return self.model_type in SPARSE_MODEL_TYPES

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    @property
    def rope_attention_factor(self) -> float:
        """What YaRN multiplies cos / sin by: attention_factor, else mscale(factor, mscale) / mscale(factor,
        mscale_all_dim) when both are given, else mscale(factor); 1 without YaRN."""
        y = self.rope_scaling
        if not y:
            return 1.0
        if y.get("attention_factor") is not None:
            return float(y["attention_factor"])
        factor = self.yarn_factor
        if y.get("mscale") and y.get("mscale_all_dim"):
            return yarn_mscale(factor, y["mscale"]) / yarn_mscale(factor, y["mscale_all_dim"])
        return yarn_mscale(factor)

    @property
    def yarn_factor(self) -> float:
        y = self.rope_scaling or {}
        if y.get("factor") is None:
            return self.max_position_embeddings / y["original_max_position_embeddings"]
        return float(y["factor"])

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN with mscale_all_dim."""
        scale = self.qk_head_dim ** -0.5
        y = self.rope_scaling
        if y and y.get("mscale_all_dim"):
            scale *= yarn_mscale(self.yarn_factor, y["mscale_all_dim"]) ** 2
        return scale

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        """From a config.json dict. ValueError on what the model cannot run."""
        cfg = dict(cfg)
        rope = cfg.get("rope_parameters") or {}
        if rope:
            cfg.setdefault("rope_theta", rope.get("rope_theta", cls.rope_theta))
        scaling = cfg.get("rope_scaling") or rope
        kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        if kind not in ("default", "yarn"):
            raise ValueError(f"rope type {kind!r}: expected yarn or none")
        cfg["rope_scaling"] = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type", "rope_type")} \
            if kind == "yarn" else None
        if "num_mtp_layers" in cfg:
            cfg.setdefault("num_nextn_predict_layers", cfg["num_mtp_layers"])
        quant = cfg.get("quantization_config") or {}
        if quant.get("quant_method") == QUANT_METHOD:  # convert_checkpoint.py's integer weights
            cfg["quant_format"] = quant.get("format")
        elif quant:
            if quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
                raise ValueError(f"quantization_config {quant}: only the publisher's fp8 e4m3 block format loads")
            cfg["fp8_block"] = list(quant.get("weight_block_size") or [128, 128])
        for key, none_means in _NONE_MEANS.items():
            if key in cfg and cfg[key] is None:
                cfg[key] = none_means
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in cfg.items() if k in names})


def cache_bytes_per_token(args: ModelArgs, dtype_bytes: int = 2) -> dict[str, int]:
    """KV-cache bytes one token takes over all num_hidden_layers layers: "latent" (what the model caches: the
    normalised latent + the rope key, one row, plus V3.2's indexer key), "expanded" (per-head K [qk_head_dim] and V
    [v_head_dim] of every head, as plain multi-head attention would cache them) and their ratio ("ratio_x100")."""
    latent = args.kv_lora_rank + args.qk_rope_head_dim + (args.index_head_dim if args.sparse else 0)
    expanded = args.num_attention_heads * (args.qk_head_dim + args.v_head_dim)
    n = args.num_hidden_layers * dtype_bytes
    return {"latent": latent * n, "expanded": expanded * n, "ratio_x100": round(100 * expanded / latent)}


# transformers' DeepseekV3Config lets these be null: what null means there
_NONE_MEANS = {"n_group": 1, "topk_group": 1, "first_k_dense_replace": 0, "norm_topk_prob": False,
               "rope_interleave": True, "mlp_layer_types": [], "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
