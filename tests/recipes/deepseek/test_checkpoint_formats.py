"""The publisher's quantized DeepSeek-V4 format (FP8 `.scale`, MXFP4 experts) and the transformers naming of
FP8 (`weight_scale_inv`) load into the same model; bad checkpoints give clear errors."""
import pytest
import torch

from common.loader import Checkpoint, CheckpointError, save_checkpoint
from tiny_deepseek_v4 import write_tiny_checkpoint
from weights_deepseek_v4 import load_model, rename


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("dsv4q") / "ckpt", seed=5, vision=False)  # V4-Flash's


def test_quantized_checkpoint_is_the_published_format(quantized):
    ckpt = Checkpoint(quantized)
    assert ckpt.dtype("layers.1.attn.wq_a.weight") == torch.float8_e4m3fn
    assert "layers.1.attn.wq_a.scale" not in ckpt.names()  # companion, hidden
    assert ckpt.dtype("layers.1.ffn.experts.3.w1.weight") == torch.int8  # two e2m1 values per byte
    assert ckpt.shape("layers.1.ffn.experts.3.w1.weight")[1] * 2 == ckpt.config["hidden_size"]


def test_fp8_in_transformers_naming_loads_the_same_model(quantized, tmp_path):
    """Re-save under transformers module names, FP8 linears kept as stored with `weight_scale_inv` scales.
    (The name mapping itself is checked against transformers by test_parity_transformers.)"""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    src = Checkpoint(quantized)
    reference = load_model(quantized, torch.float32)
    params = reference.state_dict()
    cfg = {k: v for k, v in src.config.items() if k not in ("architectures", "torch_dtype", "qk_rope_head_dim")}
    tensors = {}
    for hf_name in DeepseekV4ForCausalLM(DeepseekV4Config(**cfg)).state_dict():
        ours, shard = rename(hf_name, True)
        if shard is None and ours in src and src.dtype(ours) == torch.float8_e4m3fn:
            tensors[hf_name] = src.get(ours)
            tensors[hf_name.removesuffix("weight") + "weight_scale_inv"] = src.get(ours.removesuffix("weight") + "scale")
        elif shard is None:
            tensors[hf_name] = params[ours]
        else:  # shared expert gate / up halves of the packed w13
            tensors[hf_name] = params[ours].chunk(2)[shard]
    save_checkpoint(tmp_path, tensors, src.config)
    assert sum(n.endswith("weight_scale_inv") for n in tensors) >= 5
    model = load_model(tmp_path, torch.float32)
    for (name, a), b in zip(params.items(), model.state_dict().values()):
        assert torch.equal(a, b), name


def test_missing_and_corrupt_checkpoints_name_the_problem(quantized, tmp_path):
    with pytest.raises(CheckpointError, match="nowhere: no such checkpoint folder"):
        load_model(tmp_path / "nowhere")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in quantized.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    shard = sorted(broken.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-7])  # truncated download
    with pytest.raises(CheckpointError, match=shard.name):
        load_model(broken)
