"""load_weights: publisher names renamed onto a transformers-style model, stacked experts, and every mismatch."""
import re

import pytest
import torch
from torch import nn

from common.loader import (Checkpoint, CheckpointError, dequant_fp8_block, dequant_mxfp4, load_weights,
                           quantize_fp8_block, quantize_mxfp4, save_checkpoint)

E, H, I, V = 4, 32, 8, 32  # experts, hidden, expert inter size, vocab


class Experts(nn.Module):
    """Routed experts stacked into one [E, I, H] parameter; the checkpoint holds one [I, H] tensor per expert."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(E, I, H))
        self.w1.weight_loader = self.load_expert

    @staticmethod
    def load_expert(param, tensor, expert_id):
        param[expert_id].copy_(tensor)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(H, H, bias=False)
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.zeros(H))
        self.experts = Experts()
        self.register_buffer("tid2eid", torch.zeros(V, 2, dtype=torch.long))
        self.register_buffer("rope_cache", torch.zeros(8), persistent=False)


class TinyModel(nn.Module):
    def __init__(self, tie=False):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, H)
        self.layers = nn.ModuleList([Layer()])
        self.lm_head = nn.Linear(H, V, bias=False)
        if tie:
            self.lm_head.weight = self.embed_tokens.weight
        self.lora = nn.Parameter(torch.zeros(3))
        self.lora.optional = True


RENAMES = [  # publisher name -> model parameter
    (r"embed\.weight", "embed_tokens.weight"),
    (r"head\.weight", "lm_head.weight"),
    (r"layers\.(\d+)\.attn\.wq\.weight", r"layers.\1.q_proj.weight"),
    (r"layers\.(\d+)\.attn_norm\.weight", r"layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn\.tid2eid", r"layers.\1.tid2eid"),
    (r"layers\.(\d+)\.attn\.(\w+)\.weight", r"layers.\1.\2.weight"),
]


def rename(name):
    if name.startswith("mtp."):
        return None
    if m := re.fullmatch(r"layers\.(\d+)\.ffn\.experts\.(\d+)\.w1\.weight", name):
        return f"layers.{m[1]}.experts.w1", int(m[2])
    for pattern, target in RENAMES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, target, name)
    return name


def publisher_tensors():
    gen = torch.Generator().manual_seed(0)
    wq, wq_scale = quantize_fp8_block(torch.randn(H, H, generator=gen))
    tensors = {
        "embed.weight": torch.randn(V, H, generator=gen),
        "head.weight": torch.randn(V, H, generator=gen),
        "layers.0.attn.wq.weight": wq, "layers.0.attn.wq.scale": wq_scale,
        "layers.0.attn_norm.weight": torch.rand(H, generator=gen).to(torch.bfloat16),
        "layers.0.ffn.tid2eid": torch.randint(0, E, (V, 2), generator=gen),
        "mtp.0.embed.weight": torch.randn(V, H, generator=gen),
    }
    for j in range(E):
        packed, scale = quantize_mxfp4(torch.randn(I, H, generator=gen))
        tensors[f"layers.0.ffn.experts.{j}.w1.weight"], tensors[f"layers.0.ffn.experts.{j}.w1.scale"] = packed, scale
    return tensors


def write(tmp_path, tensors, **kw):
    save_checkpoint(tmp_path, tensors, {"model_type": "tiny"}, **kw)
    return tmp_path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_renamed_quantized_checkpoint(tmp_path, dtype):
    t = publisher_tensors()
    model = TinyModel().to(dtype)
    loaded = load_weights(model, Checkpoint(write(tmp_path, t, max_shard_bytes=1024)), rename)
    assert sorted(loaded) == sorted(n for n in t if not n.startswith("mtp.") and not n.endswith(".scale"))
    layer = model.layers[0]
    assert torch.equal(model.embed_tokens.weight, t["embed.weight"].to(dtype))
    assert torch.equal(layer.q_proj.weight, dequant_fp8_block(t["layers.0.attn.wq.weight"],
                                                              t["layers.0.attn.wq.scale"]).to(dtype))
    assert torch.equal(layer.input_layernorm.weight, t["layers.0.attn_norm.weight"].to(dtype))
    assert torch.equal(layer.tid2eid, t["layers.0.ffn.tid2eid"])
    for j in range(E):
        expert = dequant_mxfp4(t[f"layers.0.ffn.experts.{j}.w1.weight"], t[f"layers.0.ffn.experts.{j}.w1.scale"])
        assert torch.equal(layer.experts.w1[j], expert.to(dtype))


def test_accepts_a_path_and_tied_weights(tmp_path):
    t = publisher_tensors()
    del t["head.weight"]
    model = TinyModel(tie=True)
    load_weights(model, write(tmp_path, t), rename)
    assert torch.equal(model.lm_head.weight, t["embed.weight"])


def test_missing_parameters_are_listed(tmp_path):
    t = publisher_tensors()
    del t["head.weight"], t["layers.0.ffn.tid2eid"]
    with pytest.raises(CheckpointError, match=r"2 missing:\n  layers\.0\.tid2eid\n  lm_head\.weight$") as e:
        load_weights(TinyModel(), write(tmp_path, t), rename)
    assert str(tmp_path) in str(e.value) and "lora" not in str(e.value) and "rope_cache" not in str(e.value)


def test_unexpected_tensors_are_listed_unless_ignored(tmp_path):
    t = publisher_tensors()
    t["layers.0.attn.wkv.weight"] = torch.zeros(H, H)
    path = write(tmp_path, t)
    with pytest.raises(CheckpointError, match=r"1 unexpected.*\n  .*model\.safetensors: layers\.0\.attn\.wkv\.weight "
                                              r"-> layers\.0\.wkv\.weight"):
        load_weights(TinyModel(), path, rename)
    load_weights(TinyModel(), path, rename, ignore=[r"\.wkv\."])


def test_mis_shaped_tensor_names_file_tensor_and_shapes(tmp_path):
    t = publisher_tensors()
    t["embed.weight"] = torch.zeros(V + 1, H)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'embed\.weight' -> embed_tokens\.weight: "
                                              r"shape \[33, 32\] does not match \[32, 32\]"):
        load_weights(TinyModel(), write(tmp_path, t), rename)


def test_weight_loader_errors_name_file_tensor_and_shard(tmp_path):
    t = publisher_tensors()
    t["layers.0.ffn.experts.2.w1.weight"], t["layers.0.ffn.experts.2.w1.scale"] = quantize_mxfp4(torch.ones(I, 2 * H))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'layers\.0\.ffn\.experts\.2\.w1\.weight' "
                                              r"-> layers\.0\.experts\.w1 \(shard 2\): RuntimeError"):
        load_weights(TinyModel(), write(tmp_path, t), rename)


def test_expert_param_is_filled_by_its_shards(tmp_path):
    t = {n: v for n, v in publisher_tensors().items() if ".experts." in n}
    model = TinyModel()
    with pytest.raises(CheckpointError) as e:
        load_weights(model, write(tmp_path, t), rename)
    assert "experts" not in str(e.value) and "embed_tokens.weight" in str(e.value)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_a_skipped_tensor_is_never_read(tmp_path):
    t = publisher_tensors()
    ckpt = Checkpoint(write(tmp_path, t, max_shard_bytes=1024))
    load_weights(TinyModel(), ckpt, rename)  # rename skips mtp.*
    assert set(ckpt.reads) == {n for n in t if not n.startswith("mtp.")}
    assert ckpt.bytes_read == sum(nbytes(v) for n, v in t.items() if not n.startswith("mtp."))


def rank_model(rank: int, world: int = 2) -> TinyModel:
    """One TP x EP rank: vocab-parallel embedding, column-parallel q_proj, row-parallel head, a row slice of a buffer,
    the norm replicated, and E / world experts of its own."""
    model = TinyModel()
    layer = model.layers[0]
    for module, attr, shape, shard in [(model.embed_tokens, "weight", (V // world, H), (0, rank, world)),
                                       (layer.q_proj, "weight", (H // world, H), (0, rank, world)),
                                       (model.lm_head, "weight", (V, H // world), (1, rank, world))]:
        setattr(module, attr, nn.Parameter(torch.zeros(shape)))
        getattr(module, attr).shard = shard
    layer.tid2eid = torch.zeros(V // world, 2, dtype=torch.long)
    layer.tid2eid.shard = (0, rank, world)
    layer.experts.w1 = nn.Parameter(torch.zeros(E // world, I, H))
    layer.experts.w1.weight_loader = layer.experts.load_expert
    return model


def ep_rename(rank: int, world: int = 2):
    """The rank's experts get local ids; the others are skipped."""
    def rank_rename(name):
        if m := re.fullmatch(r"layers\.(\d+)\.ffn\.experts\.(\d+)\.w1\.weight", name):
            local = int(m[2]) - rank * (E // world)
            return (f"layers.{m[1]}.experts.w1", local) if 0 <= local < E // world else None
        return rename(name)
    return rank_rename


def test_each_rank_loads_exactly_its_slices(tmp_path):
    t = publisher_tensors()
    path = write(tmp_path, t, max_shard_bytes=1024)
    whole = Checkpoint(path)
    for rank in range(2):
        model, ckpt = rank_model(rank), Checkpoint(path)
        loaded = load_weights(model, ckpt, ep_rename(rank))
        experts = [f"layers.0.ffn.experts.{j}.w1.weight" for j in range(rank * E // 2, (rank + 1) * E // 2)]
        assert sorted(loaded) == sorted(["embed.weight", "head.weight", "layers.0.attn.wq.weight",
                                         "layers.0.attn_norm.weight", "layers.0.ffn.tid2eid", *experts])
        layer = model.layers[0]
        assert torch.equal(model.embed_tokens.weight, whole.get("embed.weight").chunk(2)[rank])
        assert torch.equal(model.lm_head.weight, whole.get("head.weight").chunk(2, dim=1)[rank])
        assert torch.equal(layer.q_proj.weight, whole.get("layers.0.attn.wq.weight", torch.float32).chunk(2)[rank])
        assert torch.equal(layer.tid2eid, t["layers.0.ffn.tid2eid"].chunk(2)[rank])
        assert torch.equal(layer.input_layernorm.weight, t["layers.0.attn_norm.weight"].float())
        for local, name in enumerate(experts):
            assert torch.equal(layer.experts.w1[local], whole.get(name, torch.float32))
        # names: the loaded tensors and their scales only (no other rank's experts, no mtp); bytes: its halves
        scales = ["layers.0.attn.wq.scale", *(n.removesuffix("weight") + "scale" for n in experts)]
        assert set(ckpt.reads) == set(loaded) | set(scales)
        for name in ["embed.weight", "head.weight", "layers.0.attn.wq.weight", "layers.0.ffn.tid2eid"]:
            assert ckpt.reads[name] == nbytes(t[name]) // 2, name
        for name in ["layers.0.attn_norm.weight", "layers.0.attn.wq.scale", *experts, *scales[1:]]:
            assert ckpt.reads[name] == nbytes(t[name]), name  # replicated, a [1, 1] block scale, owned experts
        assert ckpt.bytes_read == sum(ckpt.reads.values())


def test_shape_check_sees_the_slice(tmp_path):
    model = TinyModel()
    model.layers[0].q_proj.weight.shard = (0, 1, 2)  # the parameter was left at full size
    with pytest.raises(CheckpointError, match=r"tensor 'layers\.0\.attn\.wq\.weight' -> layers\.0\.q_proj\.weight: "
                                              r"shape \[16, 32\] does not match \[32, 32\]"):
        load_weights(model, write(tmp_path, publisher_tensors()), rename)


def test_a_rename_can_give_the_part_to_read(tmp_path):
    """transformers' layout stacks the experts into one [E, I, H] tensor: a rank reads its E / 2 of them."""
    t = {n: v for n, v in publisher_tensors().items() if ".experts." not in n}
    t["layers.0.ffn.experts.w1"] = torch.randn(E, I, H, generator=torch.Generator().manual_seed(5))
    path = write(tmp_path, t)
    for rank in range(2):
        model, ckpt = TinyModel(), Checkpoint(path)
        model.layers[0].experts.w1 = nn.Parameter(torch.zeros(E // 2, I, H))

        def stacked_rename(name, rank=rank):
            return ("layers.0.experts.w1", None, (0, rank, 2)) if name == "layers.0.ffn.experts.w1" else rename(name)
        load_weights(model, ckpt, stacked_rename)
        assert torch.equal(model.layers[0].experts.w1, t["layers.0.ffn.experts.w1"].chunk(2)[rank])
        assert ckpt.reads["layers.0.ffn.experts.w1"] == nbytes(t["layers.0.ffn.experts.w1"]) // 2
