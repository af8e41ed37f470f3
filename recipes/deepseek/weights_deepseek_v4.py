"""Checkpoint names -> DeepseekV4 parameters, for the publisher's layout and the transformers layout.

The model uses the publisher's names, so that layout maps almost one to one; per-expert w1/w3/w2 tensors
stack into `experts.w13` [E, 2I, D] and `experts.w2` [E, D, I], and shared-expert w1/w3 pack into `w13`.

MoE offload (load_model's `offload`): each MoE layer's resident experts (the placement's choice) are read into
its N slots, dequantized as the other weights are; the others are never dequantized: every layer's experts go
to the host backend in MXFP4 as stored (common.offload.MXFP4Experts), held there once. Over moe_ep ranks each
rank does this for its own shard of E/P experts (numbered from 0 in its tables and host backend).
"""
from __future__ import annotations

import contextlib
import re

import torch

from common import backend
from common.loader import Checkpoint, CheckpointError, load_weights
from common.offload import (DynamicPlacement, ExpertOffload, FrequencyPlacement, KTKernelHostExperts,
                            MoEOffloadConfig, MXFP4Experts, ResidentExperts, TorchHostExperts, dequant_expert)
from config_deepseek_v4 import ModelArgs
from modeling_deepseek_v4 import DeepseekV4

try:  # the vision tower's names; a text-only copy of the recipe drops the vision files: then no tensor is the tower's
    from modeling_deepseek_vision import vision_rename
except ModuleNotFoundError:
    def vision_rename(name: str) -> None:
        return None

MTP = r"^(model\.)?mtp\."  # the MTP blocks: loaded with load_model(mtp=True), for speculative decoding
MTP_BIAS_VL = r"^(model\.)?mtp\.\d+\.ffn\.gate\.bias_vl$"  # the drafts route image tokens as text: not read
VISION = "vision_model."  # where the vision tower, aligner and span vectors sit in DeepseekV4

# transformers name (without "model.") -> publisher name; applied in order, each at most once
_FROM_TRANSFORMERS = [
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"(compressor)\.kv_norm\.", r"\1.norm."),
    (r"\.attn\.norm\.", ".attn.kv_norm."),  # what transformers' save_pretrained writes back for kv_norm
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.kv_proj\.", ".wkv."),
    (r"compressor\.gate_proj\.", "compressor.wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.experts\.gate_up_proj(_scale)?$", r".experts.w13\1"),
    (r"\.experts\.down_proj(_scale)?$", r".experts.w2\1"),
]
_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight(_scale)?$")
_SHARED = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.shared_experts)\.(w[13])\.weight(_scale)?$")


STACKED = (".experts.w13", ".experts.w2", ".experts.w13_scale", ".experts.w2_scale")
PACKED = STACKED + ("shared_experts.w13.weight", "shared_experts.w13.weight_scale")  # filled slice by slice


def transformers_to_publisher(name: str) -> str:
    name = name.removeprefix("model.")
    for pattern, repl in _FROM_TRANSFORMERS:
        name = re.sub(pattern, repl, name, count=1)
    return name


def rename(name: str, transformers_layout: bool, experts: tuple[int, int, int] | None = None):
    """Checkpoint tensor name -> (parameter name, shard id[, the part of the tensor to read]); None: another rank's.
    experts = (this rank's index, the number of ranks, experts per rank) of the expert-parallel group; None: all."""
    if transformers_layout:
        name = transformers_to_publisher(name)
    if vision_rename(name) is not None:
        return VISION + name, None
    if m := _EXPERT.match(name):
        stacked, part = ("w2", None) if m[3] == "w2" else ("w13", 0 if m[3] == "w1" else 1)
        local = int(m[2]) - (0 if experts is None else experts[0] * experts[2])
        if experts is not None and not 0 <= local < experts[2]:
            return None  # another rank's expert: never read
        return f"{m[1]}.{stacked}{m[4] or ''}", (local, part)  # its int8 scale (a quantized checkpoint) alike
    if experts is not None and experts[1] > 1 and name.endswith(STACKED):
        return name, None, (0, experts[0], experts[1])  # transformers' stacked [E, ...]: this rank's experts
    if m := _SHARED.match(name):
        return f"{m[1]}.w13.weight{m[3] or ''}", 0 if m[2] == "w1" else 1
    return name, None


def _packed_loader(param: torch.Tensor, tensor: torch.Tensor, shard) -> None:
    """Fill one slice of a stacked / packed parameter. shard: None (whole), part, or (expert, part)."""
    target = param.data
    if isinstance(shard, tuple):
        expert, shard = shard
        target = target[expert]
    if shard is not None:
        half = target.shape[0] // 2
        target = target[shard * half : (shard + 1) * half]
    if target.shape != tensor.shape:
        raise ValueError(f"shape {tuple(tensor.shape)} does not fit slice {shard} of shape {tuple(target.shape)}")
    target.copy_(tensor)


@contextlib.contextmanager
def torch_default_dtype(dtype: torch.dtype):
    """torch's default dtype set to `dtype` inside the block (the model's float tensors are created in it)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def expert_layer(prefix: str, args: ModelArgs) -> int:
    """"layers.3.ffn.experts" -> 3; "mtp.0.ffn.experts" -> L + 0 (the MTP blocks' layer indices)."""
    kind, index = prefix.split(".")[:2]
    return int(index) + (args.num_hidden_layers if kind == "mtp" else 0)


def expert_prefix(layer: int, args: ModelArgs) -> str:
    L = args.num_hidden_layers
    return f"layers.{layer}.ffn.experts" if layer < L else f"mtp.{layer - L}.ffn.experts"


def offload_rename(name: str, args: ModelArgs, resident: ResidentExperts, first: int = 0):
    """As `rename` (publisher layout), an offloaded layer's routed expert going to its resident slot; None (never
    read) for an expert that is not resident, or not in this rank's shard (experts first..first+E/P-1)."""
    if (m := _EXPERT.match(name)) and expert_layer(m[1], args) in resident.slot_of:
        local = int(m[2]) - first
        if not 0 <= local < resident.num_experts:
            return None
        slot = int(resident.slot_of[expert_layer(m[1], args)][local])
        if slot < 0:
            return None
        stacked, part = ("w2", None) if m[3] == "w2" else ("w13", 0 if m[3] == "w1" else 1)
        return f"{m[1]}.{stacked}", (slot, part)
    return rename(name, False)


def check_mxfp4_experts(ckpt: Checkpoint, args: ModelArgs, layers) -> None:
    """CheckpointError unless every offloaded layer's routed experts are stored in MXFP4 (publisher's names)."""
    for layer in layers:
        name = f"{expert_prefix(layer, args)}.0.w1.weight"
        if name not in ckpt:
            raise CheckpointError(f"{ckpt.path}: MoE offload reads the publisher's per-expert tensors; no {name!r}")
        if ckpt.dtype(name) not in (torch.int8, torch.uint8) or name.removesuffix("weight") + "scale" not in ckpt:
            raise CheckpointError(f"{ckpt.path}: MoE offload needs the routed experts in MXFP4 (int8 + e8m0 scale), "
                                  f"{name} is {ckpt.dtype(name)}")


def build_host_experts(ckpt: Checkpoint, args: ModelArgs, layers, backend_name: str, max_tokens: int = 256,
                       shard: tuple[int, int] | None = None):
    """Every offloaded layer's experts in MXFP4 on the host backend (all E of them: any may leave the device).
    shard (first, E/P): an expert-parallel rank's experts only, which take one dispatched row (one expert) each."""
    first, E = shard or (0, args.n_routed_experts)
    stored = ((layer, MXFP4Experts.from_checkpoint(ckpt, expert_prefix(layer, args), E, first)) for layer in layers)
    if backend_name == "kt":  # one layer read at a time, copied into kt-kernel's buffers, then dropped
        k = 1 if shard else args.num_experts_per_tok
        return KTKernelHostExperts(stored, k, args.swiglu_limit, max_tokens=max_tokens)
    return TorchHostExperts(dict(stored), args.swiglu_limit)


def shard_placement(placement, first: int, num: int):
    """An expert-parallel rank's view of a placement: a frequency placement's counts cut to experts
    first..first+num-1 (renumbered from 0); the prefix placement is the same on every shard."""
    if isinstance(placement, FrequencyPlacement):
        return FrequencyPlacement(placement.num_slots, {l: c[first:first + num] for l, c in placement.counts.items()})
    if isinstance(placement, DynamicPlacement):
        raise ValueError("dynamic placement runs on one process (moe_ep 1): a rank's prefills end for its own "
                         "requests while its experts serve every rank's tokens; use prefix or frequency")
    return placement


def expert_fetcher(host, ckpt: Checkpoint, args: ModelArgs):
    """(layer, expert) -> float (w13 [2I, D], w2 [D, I]) for a newly resident expert (one process: dynamic
    placement): from the torch backend's compact copy; kt-kernel's repacked copy cannot be read back, so from the
    checkpoint's MXFP4 (one expert)."""
    if isinstance(host, TorchHostExperts):
        def fetch(layer: int, e: int):
            x = host.experts[layer]
            return dequant_expert(x.w13[e], x.w13_scale[e]), dequant_expert(x.w2[e], x.w2_scale[e])
        return fetch

    def fetch(layer: int, e: int):
        base = f"{expert_prefix(layer, args)}.{e}"
        w1, w3, w2 = (ckpt.get(f"{base}.{w}.weight", torch.float32) for w in ("w1", "w3", "w2"))
        return torch.cat([w1, w3]), w2
    return fetch


def prefix_for_unrecorded(placement, mtp_layers, num_experts: int):
    """A frequency placement (or a dynamic one starting from it) whose routing counts lack the MTP blocks' layers
    (recorded without speculative decoding) places their experts 0..N-1, as the prefix placement does."""
    freq = placement.start if isinstance(placement, DynamicPlacement) else placement
    if not isinstance(freq, FrequencyPlacement) or not (missing := [l for l in mtp_layers if l not in freq.counts]):
        return placement
    prefix_order = torch.arange(num_experts, 0, -1)  # counts falling with the id: top N = 0..N-1
    freq = FrequencyPlacement(freq.num_slots, {**freq.counts, **dict.fromkeys(missing, prefix_order)})
    return DynamicPlacement(placement.num_slots, freq) if isinstance(placement, DynamicPlacement) else freq


def mark_packed(model: DeepseekV4) -> None:
    """Stacked / packed parameters are filled slice by slice (their `weight_loader`)."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith(PACKED):
            tensor.weight_loader = _packed_loader


def load_into(model: DeepseekV4, ckpt: Checkpoint, dtype: torch.dtype, mtp: bool = False) -> None:
    """Fill a built DeepseekV4 (every routed expert resident) from a checkpoint: either layout, FP8 / MXFP4
    dequantized to `dtype`, only the slices this rank holds read; the `mtp.*` tensors only with mtp. What
    load_model does once it has built the model, and what a model another framework builds (vLLM's) reads."""
    mark_packed(model)
    layout = any(n.startswith("model.") for n in ckpt.names())
    moe = model.layers[0].ffn
    experts = (moe.ep_rank, moe.ep_size, moe.experts.w13.shape[0])
    load_weights(model, ckpt, lambda n: rename(n, layout, experts), dtype=dtype, ignore=mtp_ignored(mtp))


def mtp_ignored(mtp: bool) -> tuple[str, ...]:
    """Checkpoint names not read: the MTP blocks without mtp; with it their bias_vl (the drafts route image tokens
    as text)."""
    return (MTP_BIAS_VL,) if mtp else (MTP,)


def load_model(path, dtype: torch.dtype = torch.bfloat16, device="cpu", parallel=None, mtp: bool = False,
               offload: MoEOffloadConfig | None = None, max_tokens: int = 256) -> DeepseekV4:
    """Build DeepseekV4 from a checkpoint folder (either layout, FP8 / MXFP4 dequantized on load). With a
    common.parallel.Parallel, this rank's slice of the model, reading only the parts of the tensors it holds.
    mtp: also its MTP blocks (`mtp.<i>.*`, num_nextn_predict_layers of them; CheckpointError if the checkpoint
    has none); without it the `mtp.*` tensors are not read. offload: MoE offload (the publisher's layout with
    MXFP4 experts; over moe_ep ranks, each rank its shard's): `model.offload` holds the resident tables and the host
    experts; max_tokens: the most rows one host-kernel call takes (kt-kernel's buffers; longer batches are split)."""
    ckpt = Checkpoint(path)
    args = ModelArgs.from_config(ckpt.config)
    if mtp and not args.num_nextn_predict_layers:
        raise CheckpointError(f"{path}: num_nextn_predict_layers is 0 in config.json: the checkpoint has no MTP layer")
    slots = offload.resident_experts if offload is not None else None
    with torch_default_dtype(dtype), torch.device(device):
        model = DeepseekV4(args, parallel, mtp=mtp, offload_slots=slots)
    if offload is None:
        load_into(model, ckpt, dtype, mtp)
    else:
        mark_packed(model)
        if any(n.startswith("model.") for n in ckpt.names()):
            raise CheckpointError(f"{path}: MoE offload reads the publisher's layout (per-expert MXFP4 tensors), "
                                  "not the transformers layout")
        moes = model.moe_layers()
        check_mxfp4_experts(ckpt, args, moes)
        moe = model.layers[0].ffn
        E_local = args.n_routed_experts // moe.ep_size
        first = moe.ep_rank * E_local
        try:
            placement = offload.make_placement()
            if moe.ep_size > 1:
                placement = shard_placement(placement, first, E_local)
            placement = prefix_for_unrecorded(placement, range(args.num_hidden_layers, len(moes)), E_local)
            resident = ResidentExperts(placement, moes, E_local, device=device)
        except ValueError as e:
            raise ValueError(f"moe_offload placement: {e}") from None
        load_weights(model, ckpt, lambda n: offload_rename(n, args, resident, first), dtype=dtype,
                     ignore=mtp_ignored(mtp))
        host = build_host_experts(ckpt, args, moes, offload.host_backend, max_tokens,
                                  (first, E_local) if moe.ep_size > 1 else None)
        model.offload = ExpertOffload(resident, host, {layer: moe.experts for layer, moe in moes.items()},
                                      expert_fetcher(host, ckpt, args), dynamic_layers=range(args.num_hidden_layers))
        for moe in moes.values():
            moe.offload = model.offload
    model.checkpoint_reads = dict(ckpt.reads)  # what this rank read of the checkpoint: {stored name: bytes}
    return model.eval()


def model_bytes(args: ModelArgs, dtype: torch.dtype, mtp: bool = False, offload_slots: int | None = None) -> dict:
    """{"device": the model's parameter and buffer bytes in `dtype` (built on the meta device: exact),
    "host": the host experts' MXFP4 bytes (offload; 0 without)}."""
    with torch_default_dtype(dtype), torch.device("meta"):
        model = DeepseekV4(args, mtp=mtp, offload_slots=offload_slots)
    device = sum(t.nbytes for t in model.state_dict().values())
    host = 0
    if offload_slots is not None:
        D, I = args.hidden_size, args.moe_intermediate_size
        per_expert = 3 * D * I // 2 + 3 * D * I // 32  # e2m1 nibbles + one e8m0 scale per 32
        host = len(model.moe_layers()) * args.n_routed_experts * per_expert
    return {"device": device, "host": host}


def check_fits(args: ModelArgs, dtype: torch.dtype, device="cpu", mtp: bool = False,
               offload_slots: int | None = None, available: tuple[int, int] | None = None) -> None:
    """ValueError, with the arithmetic, when the weights cannot fit before anything is loaded: on a CPU device
    everything is host memory; else the device part against the device's free memory and the host experts
    against the host's. available: (device free, host free) bytes (default: what backend.memory_info says)."""
    need = model_bytes(args, dtype, mtp, offload_slots)
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    on_cpu = torch.device(device).type == "cpu"
    if available is None:
        host_free = backend.host_memory_available()
        available = (host_free if on_cpu else backend.memory_info()[0], host_free)
    dev_free, host_free = available
    what = "all routed experts resident" if offload_slots is None else f"{offload_slots} resident experts a layer"
    if on_cpu and need["device"] + need["host"] > host_free:
        hint = "" if offload_slots is not None else (
            f"; with --offload-experts N the device part shrinks to "
            f"{gib(model_bytes(args, dtype, mtp, 1)['device'])} (N = 1) and the host holds the experts in MXFP4, "
            f"{gib(model_bytes(args, dtype, mtp, 1)['host'])}")
        raise ValueError(f"the weights need {gib(need['device'])} in {backend.dtype_name(dtype)} ({what})"
                         + (f" + {gib(need['host'])} of MXFP4 host experts" if need["host"] else "")
                         + f", and {gib(host_free)} of host memory is free{hint}")
    if not on_cpu and need["device"] > dev_free:
        raise ValueError(f"the weights need {gib(need['device'])} of device memory in {backend.dtype_name(dtype)} "
                         f"({what}), and {gib(dev_free)} is free: lower --offload-experts or use more devices")
    if not on_cpu and need["host"] > host_free:
        raise ValueError(f"the host experts need {gib(need['host'])} of host memory (MXFP4), and {gib(host_free)} "
                         "is free")
