"""Model arguments of Ling-3.0-Flash (inclusionAI; transformers model_type `bailing_hybrid`), read from config.json.

A hybrid of Kimi Delta Attention (KDA, linear attention with a per-request recurrent state) and multi-head latent
attention (MLA, DeepSeek-V3's latent cache): in every group of `layer_group_size` layers the last one is MLA, the
others KDA. MLP: dense SwiGLU for the first `first_k_dense_replace` layers, then a sigmoid-routed MoE with a shared
expert. One multi-token-prediction layer is stored after the main ones (`model.layers.{num_hidden_layers}`).

Keys come under the publisher's names or transformers' (`num_experts` / `num_local_experts`, `num_experts_per_token`,
`num_expert_group`, `num_shared_experts`, `moe_renormalize`, `model_max_length`, `num_mtp_layers`); the facts and
their sources are in /work/shared/specs/ling-3.0-flash.md. `from_config` raises ValueError, naming the key, for
what this recipe does not implement (the unsafe softplus gate, low-rank KDA projections, an element-wise MLA gate,
a low-rank query, YaRN, ...).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MODEL_TYPE = "bailing_hybrid"
MLA, KDA = "full_attention", "linear_attention"  # transformers' layer_types names

# The published config as the spec gives it (transformers 5.24 defaults + the keys only vLLM reads), for sizing
# (cache_bytes, weights_ling.model_bytes) without the checkpoint at hand.
PUBLISHED = dict(
    model_type=MODEL_TYPE, vocab_size=157184, hidden_size=2560, intermediate_size=6144, moe_intermediate_size=768,
    moe_shared_expert_intermediate_size=768, num_hidden_layers=42, num_attention_heads=32, num_key_value_heads=32,
    head_dim=128, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    num_experts=512, num_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=2,
    norm_topk_prob=True, routed_scaling_factor=2.5, score_function="sigmoid", moe_router_enable_expert_bias=True,
    hidden_act="silu", max_position_embeddings=262144, rms_norm_eps=1e-6, rope_theta=6e6, rope_interleave=True,
    partial_rotary_factor=0.5, layer_group_size=6, short_conv_kernel_size=4, kda_safe_gate=True,
    kda_lower_bound=-5.0, no_kda_lora=True, gated_attention_proj_granularity_type="head_wise",
    num_nextn_predict_layers=1, pad_token_id=156892, eos_token_id=156895, bos_token_id=None,
    tie_word_embeddings=False,
)

# transformers' attribute_map: its name -> ours (the publisher's)
_ALIASES = {"num_local_experts": "num_experts", "num_experts_per_token": "num_experts_per_tok",
            "num_expert_group": "n_group", "num_shared_experts": "n_shared_experts",
            "num_experts": "n_routed_experts", "moe_renormalize": "norm_topk_prob",
            "model_max_length": "max_position_embeddings", "num_mtp_layers": "num_nextn_predict_layers"}


@dataclass
class ModelArgs:
    model_type: str = MODEL_TYPE
    vocab_size: int = 157184
    hidden_size: int = 2560
    intermediate_size: int = 6144  # the dense MLP of the first first_k_dense_replace layers
    moe_intermediate_size: int = 768
    moe_shared_expert_intermediate_size: int | None = None  # None: moe_intermediate_size * n_shared_experts
    num_hidden_layers: int = 42
    num_attention_heads: int = 32  # the MLA heads and the KDA heads alike
    num_key_value_heads: int | None = None  # MLA: as many as the query heads (None: so)
    head_dim: int = 128  # KDA's per-head q / k / v width (dk = dv)
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 6e6
    rope_interleave: bool = True
    gated_attention_proj_granularity_type: str = "head_wise"
    attention_bias: bool = False
    # KDA
    layer_group_size: int = 6
    layer_types: list[str] = field(default_factory=list)  # derived from layer_group_size
    short_conv_kernel_size: int = 4
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    no_kda_lora: bool = True
    # MLP / MoE
    n_routed_experts: int = 512
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    first_k_dense_replace: int = 2
    mlp_layer_types: list[str] = field(default_factory=list)  # "dense" | "sparse" per layer
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    score_function: str = "sigmoid"
    moe_router_enable_expert_bias: bool = True
    expert_swiglu_limit_list: list[float] | None = None  # per layer, routed experts; 0 / absent: no clamp
    share_expert_swiglu_limit_list: list[float] | None = None  # per layer, shared expert
    hidden_act: str = "silu"
    # the rest
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 1
    pad_token_id: int | None = 156892
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 156895
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.model_type != MODEL_TYPE:
            raise ValueError(f"model_type {self.model_type!r}: expected {MODEL_TYPE!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "head_dim", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
                     "n_routed_experts", "layer_group_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        H, n = self.num_attention_heads, self.num_hidden_layers
        if self.num_key_value_heads is None:
            self.num_key_value_heads = H
        if self.num_key_value_heads != H:
            raise ValueError(f"num_key_value_heads {self.num_key_value_heads} must equal num_attention_heads {H} "
                             "(MLA expands one latent per query head)")
        if self.q_lora_rank is not None:
            raise ValueError(f"q_lora_rank {self.q_lora_rank}: Ling's MLA has one q_proj (q_lora_rank null)")
        if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even and >= 2, got {self.qk_rope_head_dim}")
        if not self.rope_interleave:
            raise ValueError("rope_interleave false: only DeepSeek's interleaved rope pairs are implemented")
        if self.gated_attention_proj_granularity_type != "head_wise":
            raise ValueError(f"gated_attention_proj_granularity_type {self.gated_attention_proj_granularity_type!r}:"
                             " only the head-wise MLA output gate is implemented")
        if self.attention_bias:
            raise ValueError("attention_bias is not supported (Ling's projections have no bias)")
        # the layer pattern: layer i is MLA iff (i + 1) % layer_group_size == 0
        if n % self.layer_group_size:
            raise ValueError(f"layer_group_size {self.layer_group_size} must divide num_hidden_layers {n} (vLLM and "
                             "transformers disagree on the layers past the last whole group)")
        pattern = [MLA if (i + 1) % self.layer_group_size == 0 else KDA for i in range(n)]
        if self.layer_types and list(self.layer_types) != pattern:
            raise ValueError(f"layer_types {self.layer_types} is not the pattern of layer_group_size "
                             f"{self.layer_group_size} (layer i is MLA iff (i + 1) % layer_group_size == 0)")
        self.layer_types = pattern
        if not self.kda_safe_gate:
            raise ValueError("kda_safe_gate false: only the safe gate lower_bound * sigmoid(exp(A_log) * (f + "
                             "dt_bias)) is implemented, not Kimi's softplus gate")
        if not self.no_kda_lora:
            raise ValueError("no_kda_lora false: only full-rank KDA f_proj / g_proj are implemented")
        if not self.kda_lower_bound < 0:
            raise ValueError(f"kda_lower_bound must be negative, got {self.kda_lower_bound}")
        if self.short_conv_kernel_size < 2:
            raise ValueError(f"short_conv_kernel_size must be >= 2, got {self.short_conv_kernel_size}")
        # MLP
        if not self.mlp_layer_types:
            k = min(self.first_k_dense_replace, n)
            self.mlp_layer_types = ["dense"] * k + ["sparse"] * (n - k)
        if len(self.mlp_layer_types) != n or set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types {self.mlp_layer_types}: expected {n} entries, 'dense' or 'sparse'")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r}: only silu (SwiGLU) is supported")
        if self.score_function != "sigmoid":
            raise ValueError(f"score_function {self.score_function!r}: only sigmoid router scores are implemented")
        if not self.moe_router_enable_expert_bias:
            raise ValueError("moe_router_enable_expert_bias false: the router's expert_bias is expected")
        E, G = self.n_routed_experts, self.n_group
        if G < 1 or E % G:
            raise ValueError(f"n_group {G} must divide n_routed_experts {E}")
        if not 1 <= self.topk_group <= G:
            raise ValueError(f"topk_group {self.topk_group} must be in [1, n_group {G}]")
        if G > 1 and E // G < 2:
            raise ValueError("group-limited routing scores each group by its top-2 experts: groups need >= 2 experts")
        if not 1 <= self.num_experts_per_tok <= self.topk_group * (E // G):
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, "
                             f"{self.topk_group * (E // G)}] (topk_group {self.topk_group} groups of {E // G})")
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.moe_shared_expert_intermediate_size is None:
            self.moe_shared_expert_intermediate_size = self.moe_intermediate_size * self.n_shared_experts
        for key in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
            limits = getattr(self, key)
            if limits is None:
                continue
            if len(limits) not in (n, n + self.num_nextn_predict_layers) or any(x is None or x < 0 for x in limits):
                raise ValueError(f"{key}: expected {n} (or {n + self.num_nextn_predict_layers} with the MTP layers) "
                                 f"limits >= 0 (0: no clamp), got {limits}")
            if any(limits[i] for i in range(n) if self.mlp_layer_types[i] == "dense"):
                raise ValueError(f"{key} sets a limit on a dense MLP layer: only MoE layers are clamped")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings true: Ling's lm_head is its own tensor")
        if self.num_nextn_predict_layers < 0:
            raise ValueError(f"num_nextn_predict_layers must be >= 0, got {self.num_nextn_predict_layers}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """MLA's qk_head_dim^-0.5 (no YaRN mscale)."""
        return self.qk_head_dim ** -0.5

    @property
    def kda_width(self) -> int:
        """C = heads x head_dim: the width of KDA's q, k, v, f and g projections."""
        return self.num_attention_heads * self.head_dim

    @property
    def mla_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == MLA]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == KDA]

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def swiglu_limits(self, layer: int) -> tuple[float | None, float | None]:
        """(routed, shared) SwiGLU clamp of layer `layer` (None: none); the MTP layers past the lists get none."""
        def pick(limits):
            return (limits[layer] or None) if limits is not None and layer < len(limits) else None
        return pick(self.expert_swiglu_limit_list), pick(self.share_expert_swiglu_limit_list)

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        """From a config.json dict (the publisher's or transformers' names). ValueError on what the model cannot run,
        naming the key."""
        cfg = dict(cfg)
        for theirs, ours in _ALIASES.items():
            if theirs in cfg:
                cfg.setdefault(ours, cfg[theirs])
        if cfg.get("linear_head_dim") is not None:  # transformers' saved config: head_dim there is the rope width
            cfg["head_dim"] = cfg["linear_head_dim"]
        for key in ("linear_num_heads", "linear_conv_kernel_dim"):
            want = {"linear_num_heads": "num_attention_heads", "linear_conv_kernel_dim": "short_conv_kernel_size"}
            if cfg.get(key) is not None and cfg[key] != cfg.get(want[key], cfg[key]):
                raise ValueError(f"{key} {cfg[key]} differs from {want[key]} {cfg.get(want[key])}")
        rope = cfg.get("rope_parameters") or {}
        if rope:
            cfg.setdefault("rope_theta", rope.get("rope_theta", cls.rope_theta))
        for key, scaling in (("rope_parameters", rope), ("rope_scaling", cfg.get("rope_scaling") or {})):
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind != "default":
                raise ValueError(f"{key}: rope type {kind!r}: only the default rope (no YaRN) is implemented")
        # partial_rotary_factor is ignored, as vLLM does: the rotary width is already the qk_rope_head_dim dims
        if cfg.get("mlp_layer_types") is None:
            cfg.pop("mlp_layer_types", None)
        if cfg.get("layer_types") is None:
            cfg.pop("layer_types", None)
        if cfg.get("moe_shared_expert_intermediate_size") is None:
            cfg.pop("moe_shared_expert_intermediate_size", None)
        if cfg.get("quantization_config"):
            raise ValueError(f"quantization_config {cfg['quantization_config']}: only float checkpoints load here")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in cfg.items() if k in names})


def cache_bytes(args: ModelArgs, dtype_bytes: int = 2, mtp: bool = False) -> dict[str, int]:
    """What the caches cost (for the deployment plan): "mla_per_token", the latent rows of one token over every MLA
    layer ((kv_lora_rank + qk_rope_head_dim) x dtype_bytes each; the MTP layer's too with mtp); per request,
    whatever its length, "kda_conv_per_request" (the last K-1 pre-conv q / k / v inputs, 3 x heads x head_dim
    values a row, in the model dtype) and "kda_recurrent_per_request" (one fp32 [head_dim x head_dim] state per
    head) over every KDA layer, and their sum "kda_per_request". Published config: 8,064 B / token (9,216 with
    the MTP layer) and 75,980,800 B per request (spec, "State per request")."""
    n_mla = len(args.mla_layers) + (args.num_nextn_predict_layers if mtp else 0)
    n_kda = len(args.kda_layers)
    conv = (args.short_conv_kernel_size - 1) * 3 * args.kda_width * dtype_bytes * n_kda
    recurrent = args.num_attention_heads * args.head_dim ** 2 * 4 * n_kda
    return {"mla_per_token": (args.kv_lora_rank + args.qk_rope_head_dim) * dtype_bytes * n_mla,
            "kda_conv_per_request": conv, "kda_recurrent_per_request": recurrent,
            "kda_per_request": conv + recurrent}
