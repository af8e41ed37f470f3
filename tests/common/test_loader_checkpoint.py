"""Checkpoint folders: single file and shards, lazy reads, dequantization on get, and every error case."""
import json
import re
from pathlib import Path

import pytest
import torch

from common.loader import (Checkpoint, CheckpointError, dequant_fp8_block, dequant_mxfp4, quantize_fp8_block,
                           quantize_mxfp4, save_checkpoint)

CONFIG = {"model_type": "tiny", "hidden_size": 16}


def tiny_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(32, 16, generator=gen),
        "layers.0.attn.wq.weight": torch.randn(16, 16, generator=gen).to(torch.bfloat16),
        "layers.0.norm.weight": torch.ones(16),
        "layers.1.attn.wq.weight": torch.randn(16, 16, generator=gen),
        "layers.1.tid2eid": torch.randint(0, 4, (32, 2), generator=gen),
        "head.weight": torch.randn(32, 16, generator=gen).t(),  # not contiguous
    }


def read_all(path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


def test_single_file_round_trip(tmp_path):
    tensors = tiny_tensors()
    save_checkpoint(tmp_path, tensors, CONFIG)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    ckpt = Checkpoint(tmp_path)
    assert ckpt.config == CONFIG
    assert sorted(ckpt.names()) == sorted(tensors)
    for name, t in tensors.items():
        assert ckpt.shape(name) == t.shape and ckpt.dtype(name) == t.dtype
        assert torch.equal(ckpt.get(name), t)
    assert ckpt.get("layers.0.attn.wq.weight", torch.float32).dtype == torch.float32


def test_sharded_round_trip_is_deterministic(tmp_path):
    tensors = tiny_tensors()
    save_checkpoint(tmp_path / "a", tensors, CONFIG, max_shard_bytes=2048)
    save_checkpoint(tmp_path / "b", tensors, CONFIG, max_shard_bytes=2048)
    assert read_all(tmp_path / "a") == read_all(tmp_path / "b")
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert sorted(index["weight_map"]) == sorted(tensors)
    assert not (tmp_path / "a" / "model.safetensors").exists()
    ckpt = Checkpoint(tmp_path / "a")
    assert sorted(ckpt.names()) == sorted(tensors)
    for name, t in tensors.items():
        assert torch.equal(ckpt.get(name), t)
    save_checkpoint(tmp_path / "a", tensors, CONFIG)  # rewriting unsharded leaves no stale shards
    assert sorted(f.name for f in (tmp_path / "a").iterdir()) == ["config.json", "model.safetensors"]


def test_reads_are_lazy_one_shard_at_a_time(tmp_path):
    save_checkpoint(tmp_path, tiny_tensors(), CONFIG, max_shard_bytes=2048)
    ckpt = Checkpoint(tmp_path)
    ckpt.names()
    assert ckpt._headers == {} and ckpt.reads == {}
    ckpt.get("layers.0.norm.weight")
    assert list(ckpt._headers) == [ckpt.file("layers.0.norm.weight")] and list(ckpt.reads) == ["layers.0.norm.weight"]


def test_a_read_keeps_no_mapping_open(tmp_path):
    """Each read maps its file for that tensor alone: once the tensor is gone, nothing of the file stays mapped
    (with one handle kept open per file, every page loading had read stayed resident beside the model)."""
    import gc
    save_checkpoint(tmp_path, tiny_tensors(), CONFIG, max_shard_bytes=2048)
    ckpt = Checkpoint(tmp_path)
    file = ckpt.file("layers.0.norm.weight")
    tensor = ckpt.get("layers.0.norm.weight")
    assert tensor.numel() > 0
    del tensor
    gc.collect()
    assert str(file) not in Path("/proc/self/maps").read_text()


def quantized_tensors():
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(3))
    fp8, fp8_scale = quantize_fp8_block(w)
    packed, mx_scale = quantize_mxfp4(w[:8, :256])
    return {
        "model.layers.0.q_proj.weight": fp8, "model.layers.0.q_proj.weight_scale_inv": fp8_scale,  # transformers
        "layers.0.attn.wq.weight": fp8, "layers.0.attn.wq.scale": fp8_scale.to(torch.bfloat16),    # publisher
        "layers.0.ffn.experts.0.w1.weight": packed, "layers.0.ffn.experts.0.w1.scale": mx_scale,   # MXFP4
        "layers.0.attn_norm.weight": torch.ones(300),
    }


def test_quantized_weights_are_dequantized_and_companions_hidden(tmp_path):
    tensors = quantized_tensors()
    save_checkpoint(tmp_path, tensors, CONFIG)
    ckpt = Checkpoint(tmp_path)
    assert sorted(ckpt.names()) == ["layers.0.attn.wq.weight", "layers.0.attn_norm.weight",
                                    "layers.0.ffn.experts.0.w1.weight", "model.layers.0.q_proj.weight"]
    for dtype in (torch.float32, torch.bfloat16):
        fp8 = dequant_fp8_block(tensors["layers.0.attn.wq.weight"], tensors["model.layers.0.q_proj.weight_scale_inv"])
        assert torch.equal(ckpt.get("model.layers.0.q_proj.weight", dtype), fp8.to(dtype))
        fp8_bf16_scale = dequant_fp8_block(tensors["layers.0.attn.wq.weight"], tensors["layers.0.attn.wq.scale"])
        assert torch.equal(ckpt.get("layers.0.attn.wq.weight", dtype), fp8_bf16_scale.to(dtype))
        mx = dequant_mxfp4(tensors["layers.0.ffn.experts.0.w1.weight"], tensors["layers.0.ffn.experts.0.w1.scale"])
        assert torch.equal(ckpt.get("layers.0.ffn.experts.0.w1.weight", dtype), mx.to(dtype))
    raw = ckpt.get("layers.0.ffn.experts.0.w1.weight")  # no dtype: as stored
    assert raw.dtype == torch.int8 and raw.shape == (8, 128)
    assert ckpt.shape("layers.0.ffn.experts.0.w1.weight") == (8, 128)
    assert ckpt.get("layers.0.attn.wq.scale").dtype == torch.bfloat16  # companions stay readable by name


def test_bad_scale_shape_names_file_and_tensor(tmp_path):
    tensors = quantized_tensors()
    tensors["layers.0.attn.wq.scale"] = torch.ones(1, 1)
    save_checkpoint(tmp_path, tensors, CONFIG)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*layers\.0\.attn\.wq\.weight.*block scale"):
        Checkpoint(tmp_path).get("layers.0.attn.wq.weight", torch.float32)


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="nowhere"):
        Checkpoint(tmp_path / "nowhere")
    save_checkpoint(tmp_path, tiny_tensors(), CONFIG)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json.*not valid JSON"):
        Checkpoint(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json.*missing"):
        Checkpoint(tmp_path)


def test_no_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        Checkpoint(tmp_path)


def test_unknown_tensor_names_folder_and_tensor(tmp_path):
    save_checkpoint(tmp_path, tiny_tensors(), CONFIG)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(tmp_path))}.*'embed\.weights'.*close: \['embed\.weight'"):
        Checkpoint(tmp_path).get("embed.weights")


def test_index_naming_a_missing_shard(tmp_path):
    save_checkpoint(tmp_path, tiny_tensors(), CONFIG, max_shard_bytes=2048)
    shard = tmp_path / "model-00002-of-00004.safetensors"
    held = Checkpoint(tmp_path).names()
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"index\.json.*model-00002-of-00004\.safetensors.*tensor '") as e:
        Checkpoint(tmp_path)
    assert any(repr(name) in str(e.value) for name in held)


def test_tensor_in_index_but_absent_from_its_file(tmp_path):
    save_checkpoint(tmp_path, tiny_tensors(), CONFIG, max_shard_bytes=2048)
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00004.safetensors"
    index_file.write_text(json.dumps(index))
    ckpt = Checkpoint(tmp_path)
    assert "ghost.weight" in ckpt.names()
    with pytest.raises(CheckpointError, match=r"model-00001-of-00004\.safetensors.*'ghost\.weight'.*absent"):
        ckpt.get("ghost.weight")


def test_truncated_single_file(tmp_path):
    save_checkpoint(tmp_path, tiny_tensors(), CONFIG)
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-3])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated.*tensor '.*ends at byte"):
        Checkpoint(tmp_path)


def test_truncated_shard_fails_before_any_read(tmp_path):
    save_checkpoint(tmp_path, tiny_tensors(), CONFIG, max_shard_bytes=2048)
    ckpt = Checkpoint(tmp_path)
    file = ckpt.file("embed.weight")
    file.write_bytes(file.read_bytes()[:-5])
    for call in (ckpt.get, ckpt.shape):
        with pytest.raises(CheckpointError, match=rf"{file.name}: truncated.*reading tensor 'embed\.weight'"):
            call("embed.weight")
    assert ckpt.reads == {}  # nothing was read
    file.write_bytes(file.read_bytes()[:4])  # not even a header length
    with pytest.raises(CheckpointError, match=rf"{file.name}: truncated.*reading tensor 'embed\.weight'"):
        Checkpoint(tmp_path).get("embed.weight")


@pytest.mark.parametrize("corrupt", ["json", "offsets", "length"])
def test_corrupt_header(tmp_path, corrupt):
    save_checkpoint(tmp_path, tiny_tensors(), CONFIG)
    file = tmp_path / "model.safetensors"
    data = bytearray(file.read_bytes())
    n = int.from_bytes(data[:8], "little")
    if corrupt == "json":
        data[8] = ord("[")
    elif corrupt == "offsets":  # same length, wrong numbers: "data_offsets":[0,X] -> [1,X]
        header = data[8:8 + n].decode()
        at = header.index('"data_offsets":[0,') + len('"data_offsets":[')
        data[8 + at] = ord("1")
    else:
        data[:8] = (10**9).to_bytes(8, "little")
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: (corrupt|truncated)"):
        Checkpoint(tmp_path)


def sharded_tensors():
    """Plain, FP8-block (ragged and aligned blocks, both scale layouts) and MXFP4 (2-D and stacked [E, N, K/2])."""
    gen = torch.Generator().manual_seed(4)
    fp8, fp8_scale = quantize_fp8_block(torch.randn(200, 300, generator=gen))      # ragged: scale [2, 3]
    fp8_aligned, fp8_aligned_scale = quantize_fp8_block(torch.randn(256, 512, generator=gen))
    mx, mx_scale = quantize_mxfp4(torch.randn(8, 256, generator=gen))               # [8, 128], scale [8, 8]
    mx_narrow, mx_narrow_scale = quantize_mxfp4(torch.randn(4, 64, generator=gen))  # parts of 16 columns at count 4
    stacked, stacked_scale = quantize_mxfp4(torch.randn(4, 8, 64, generator=gen))
    return {
        "embed.weight": torch.randn(32, 16, generator=gen).to(torch.bfloat16),
        "layers.0.ape": torch.randn(4, 8, 12, generator=gen),
        "layers.0.tid2eid": torch.randint(0, 8, (32, 4), generator=gen),
        "layers.0.attn.wq.weight": fp8, "layers.0.attn.wq.scale": fp8_scale.to(torch.bfloat16),
        "model.layers.0.o_proj.weight": fp8_aligned, "model.layers.0.o_proj.weight_scale_inv": fp8_aligned_scale,
        "layers.0.ffn.experts.0.w1.weight": mx, "layers.0.ffn.experts.0.w1.scale": mx_scale,
        "layers.0.ffn.experts.1.w2.weight": mx_narrow, "layers.0.ffn.experts.1.w2.scale": mx_narrow_scale,
        "layers.0.ffn.w13.weight": stacked, "layers.0.ffn.w13.scale": stacked_scale,
    }


@pytest.mark.parametrize("count", [1, 2, 4])
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16])
def test_shard_equals_the_sliced_tensor(tmp_path, count, dtype):
    save_checkpoint(tmp_path, sharded_tensors(), CONFIG, max_shard_bytes=64 * 1024)
    ckpt = Checkpoint(tmp_path)
    for name in ckpt.names():
        full = ckpt.get(name, dtype)  # dequantized with a float dtype, as stored without
        for dim in range(full.dim()):
            part = full.shape[dim] // count
            for index in range(count):
                got = ckpt.get(name, dtype, shard=(dim, index, count))
                assert got.dtype == full.dtype, (name, dim, index)
                assert torch.equal(got, full.narrow(dim, index * part, part)), (name, dim, index, count)
        assert torch.equal(ckpt.get(name, dtype, shard=(-1, count - 1, count)),
                           full.narrow(-1, full.shape[-1] - full.shape[-1] // count, full.shape[-1] // count))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_a_rank_reads_its_part_and_nothing_else(tmp_path):
    tensors = sharded_tensors()
    save_checkpoint(tmp_path, tensors, CONFIG, max_shard_bytes=64 * 1024)
    asked = {"embed.weight": 0, "layers.0.attn.wq.weight": 0, "model.layers.0.o_proj.weight": 1,
             "layers.0.ffn.experts.0.w1.weight": 1, "layers.0.ffn.experts.1.w2.weight": 0}  # name -> dim
    scales = {"layers.0.attn.wq.weight": "layers.0.attn.wq.scale",
              "model.layers.0.o_proj.weight": "model.layers.0.o_proj.weight_scale_inv",
              "layers.0.ffn.experts.0.w1.weight": "layers.0.ffn.experts.0.w1.scale",
              "layers.0.ffn.experts.1.w2.weight": "layers.0.ffn.experts.1.w2.scale"}
    for rank in range(2):
        ckpt = Checkpoint(tmp_path)
        for name, dim in asked.items():
            ckpt.get(name, torch.bfloat16, shard=(dim, rank, 2))
        assert set(ckpt.reads) == set(asked) | set(scales.values())  # names never asked are never read
        for name in asked:
            assert ckpt.reads[name] == nbytes(tensors[name]) // 2, name  # the data: exactly its half
        # scales: the covering blocks. wq [200, 300] on dim 0: rows [0, 100) in block row 0, [100, 200) in rows 0-1
        assert ckpt.reads["layers.0.attn.wq.scale"] == [1, 2][rank] * 3 * 2  # bf16 [2, 3] scale
        assert ckpt.reads["model.layers.0.o_proj.weight_scale_inv"] == 2 * 2 * 4  # 256 columns = 2 aligned blocks
        assert ckpt.reads["layers.0.ffn.experts.0.w1.scale"] == nbytes(tensors["layers.0.ffn.experts.0.w1.scale"]) // 2
        assert ckpt.reads["layers.0.ffn.experts.1.w2.scale"] == nbytes(tensors["layers.0.ffn.experts.1.w2.scale"]) // 2
        full = sum(nbytes(tensors[n]) for n in [*asked, *scales.values()])
        assert full // 2 <= ckpt.bytes_read <= full // 2 + 12
        assert ckpt.bytes_read == sum(ckpt.reads.values())
    ckpt = Checkpoint(tmp_path)
    assert ckpt.bytes_read == 0
    ckpt.get("layers.0.attn.wq.weight", torch.float32)  # a whole read counts too
    assert ckpt.reads == {n: nbytes(tensors[n]) for n in ["layers.0.attn.wq.weight", "layers.0.attn.wq.scale"]}


def test_fp8_part_not_aligned_to_blocks(tmp_path):
    tensors = sharded_tensors()
    save_checkpoint(tmp_path, tensors, CONFIG)
    ckpt = Checkpoint(tmp_path)
    w, scale = tensors["layers.0.attn.wq.weight"], tensors["layers.0.attn.wq.scale"]
    full = dequant_fp8_block(w, scale)
    part = ckpt.get("layers.0.attn.wq.weight", torch.float32, shard=(1, 1, 4))  # columns [75, 150): blocks 0 and 1
    assert torch.equal(part, full[:, 75:150])
    assert ckpt.reads == {"layers.0.attn.wq.weight": 200 * 75, "layers.0.attn.wq.scale": 2 * 2 * 2}


def test_shard_errors_name_tensor_dim_and_sizes(tmp_path):
    tensors = sharded_tensors()
    tensors["layers.0.bad.weight"], tensors["layers.0.bad.scale"] = tensors["layers.0.attn.wq.weight"], torch.ones(1, 3)
    save_checkpoint(tmp_path, tensors, CONFIG)
    ckpt = Checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'layers\.0\.attn\.wq\.weight' \[200, 300\]: "
                                              r"dim 0 of size 200 does not split into 3 equal parts"):
        ckpt.get("layers.0.attn.wq.weight", torch.float32, shard=(0, 0, 3))
    with pytest.raises(CheckpointError, match=r"'embed\.weight' \[32, 16\]: dim 1 of size 16 does not split into 5"):
        ckpt.get("embed.weight", shard=(1, 0, 5))
    with pytest.raises(CheckpointError, match=r"'layers\.0\.ffn\.experts\.0\.w1\.weight' \[8, 256\]: dim 1 of size 256 "
                                              r"does not split into 3"):
        ckpt.get("layers.0.ffn.experts.0.w1.weight", torch.float32, shard=(1, 0, 3))  # logical K, not packed K/2
    with pytest.raises(CheckpointError, match=r"'layers\.0\.ffn\.experts\.1\.w2\.weight' \[4, 64\]: shard \(1, 3, 64\) "
                                              r"splits dim 1 at odd columns \[3, 4\); MXFP4 packs two values per byte"):
        ckpt.get("layers.0.ffn.experts.1.w2.weight", torch.float32, shard=(1, 3, 64))
    for shard in [(2, 0, 2), (0, 2, 2), (-3, 0, 1)]:
        with pytest.raises(CheckpointError, match=rf"'embed\.weight' \[32, 16\]: no shard {re.escape(str(shard))}"):
            ckpt.get("embed.weight", shard=shard)
    with pytest.raises(CheckpointError, match=r"'layers\.0\.bad\.weight': fp8 weight \[200, 300\] needs a \[2, 3\] "
                                              r"block scale, got \[1, 3\]"):
        ckpt.get("layers.0.bad.weight", torch.float32, shard=(0, 0, 2))  # checked against the whole weight
    assert "layers.0.bad.weight" not in ckpt.reads and ckpt.bytes_read == 0
