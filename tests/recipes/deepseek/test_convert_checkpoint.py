"""convert_checkpoint.py: the published FP8 + MXFP4 tiny checkpoint (with an MTP layer) and a bf16 one in transformers
naming -> W8A8 / W4A8: every name maps, dtypes and shapes, quantized weights within the rounding bound of the
float ones, the rest equal to the source, config and tokenizer, CLI errors, and streaming (one tensor at a time)."""
import json
import os
import re
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from common.loader import Checkpoint, save_checkpoint
from common.loader.quant import (dequantize_int, pack_int4, quantize_int4_per_group, quantize_int8_per_channel,
                                 unpack_int4)
from convert_checkpoint import convert, main
from tiny_deepseek_v4 import write_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "recipes" / "deepseek" / "tools" / "convert_checkpoint.py"
PUBLISHED_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                 "weight_block_size": [128, 128]}  # the published V4 config's entry


def _copy_tokenizer(src: Path, dst: Path):
    for f in src.glob("tokenizer*"):
        (dst / f.name).write_bytes(f.read_bytes())


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """The tiny checkpoint as published (FP8 + MXFP4), plus an MTP block `mtp.0.*` (layer 1's stored tensors, scales
    included, and the MTP projections / norms) and the published FP8 quantization_config."""
    root = tmp_path_factory.mktemp("dsv4conv")
    tiny = write_tiny_checkpoint(root / "tiny", seed=3)
    state = {}
    for f in sorted(tiny.glob("*.safetensors")):
        state |= load_file(f)
    for name in [n for n in state if n.startswith("layers.1.")]:
        state["mtp.0." + name.removeprefix("layers.1.")] = state[name]
    g = torch.Generator().manual_seed(0)
    for name in ("e_proj", "h_proj"):
        state[f"mtp.0.{name}.weight"] = (torch.randn(64, 64, generator=g) / 8).to(torch.bfloat16)
    for name in ("enorm", "hnorm", "norm"):
        state[f"mtp.0.{name}.weight"] = 1 + 0.1 * torch.randn(64, generator=g)
    config = {**json.loads((tiny / "config.json").read_text()), "num_nextn_predict_layers": 1,
              "quantization_config": PUBLISHED_FP8}
    path = save_checkpoint(root / "published", state, config, max_shard_bytes=256 * 1024)
    _copy_tokenizer(tiny, path)
    return path


@pytest.fixture(scope="module")
def transformers_bf16(tmp_path_factory):
    """A bf16 tiny checkpoint under transformers' names (stacked experts.gate_up_proj / down_proj)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from weights_deepseek_v4 import load_model, rename

    root = tmp_path_factory.mktemp("dsv4conv_hf")
    tiny = write_tiny_checkpoint(root / "tiny", seed=4, quantized="bf16")
    params = load_model(tiny, torch.bfloat16).state_dict()
    config = json.loads((tiny / "config.json").read_text())
    cfg = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype", "qk_rope_head_dim")}
    tensors = {}
    for hf_name in DeepseekV4ForCausalLM(DeepseekV4Config(**cfg)).state_dict():
        ours, shard = rename(hf_name, True)
        tensors[hf_name] = params[ours] if shard is None else params[ours].chunk(2)[shard]
    path = save_checkpoint(root / "hf", tensors, config, max_shard_bytes=256 * 1024)
    _copy_tokenizer(tiny, path)
    return path


def _stored_names(path: Path) -> set[str]:
    names = set()
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            names |= set(h.keys())
    return names


def _convert(src, dst, quant, group_size=None, **kw):
    return convert(src, dst, quant, group_size, progress=False, **kw)


def check_conversion(src: Path, dst: Path, quant: str, group_size: int | None) -> dict[str, str]:
    """Every check on one conversion; returns {source name: "int8" | "int4" | "kept"}."""
    s, d = Checkpoint(src), Checkpoint(dst)
    qc = d.config["quantization_config"]
    int8 = [re.compile(p) for p in qc["weights"]["int8"]]
    int4 = [re.compile(p) for p in qc["weights"].get("int4", [])]
    kinds, expected = {}, set()
    for name in s.names():
        is8, is4 = any(p.search(name) for p in int8), any(p.search(name) for p in int4)
        assert not (is8 and is4), name
        expected.add(name)
        if not (is8 or is4):
            kinds[name] = "kept"
            if s.dtype(name) == torch.float8_e4m3fn:  # dequantized, in bf16
                assert d.dtype(name) == torch.bfloat16, name
                assert torch.equal(d.get(name), s.get(name, torch.bfloat16)), name
            else:
                assert d.dtype(name) == s.dtype(name), name
                assert torch.equal(d.get(name), s.get(name)), name
            continue
        kinds[name] = "int8" if is8 else "int4"
        expected.add(name + "_scale")
        w = s.get(name, torch.float32)                                       # [..., N, K]
        q, scale = d.get(name), d.get(name + "_scale")
        assert q.dtype == torch.int8 and scale.dtype == torch.float32, name
        if is8:
            assert q.shape == w.shape and scale.shape == w.shape[:-1], name
            assert torch.allclose(scale, w.abs().amax(-1) / 127, rtol=1e-6, atol=0), name
            err = (w - dequantize_int(q, scale)).abs() / scale.unsqueeze(-1)  # |w - s q| / s
            assert torch.equal(dequantize_int(q, scale), q.float() * scale.unsqueeze(-1)), name
        else:
            k = w.shape[-1]
            assert q.shape == (*w.shape[:-1], k // 2) and scale.shape == (*w.shape[:-1], k // group_size), name
            groups = w.unflatten(-1, (-1, group_size))                        # [..., K/G, G]
            assert torch.allclose(scale, groups.abs().amax(-1) / 7, rtol=1e-6, atol=0), name
            values = unpack_int4(q)
            assert values.min() >= -8 and values.max() <= 7, name
            err = (groups - dequantize_int(q, scale, group_size).unflatten(-1, (-1, group_size))).abs() \
                / scale.unsqueeze(-1)
        assert err.max() <= 0.5 + 1e-5, (name, err.max())
    assert _stored_names(dst) == expected  # no FP8 / MXFP4 scale companions (`.scale`, `_scale_inv`) among them
    return kinds


def test_integer_formats():
    """The byte layout: int4 low nibble first, two's complement nibbles; scales as documented; shape checks."""
    q = torch.tensor([[1, -1, -8, 7]], dtype=torch.int8)
    assert pack_int4(q).view(torch.uint8).tolist() == [[0xF1, 0x78]]
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    w = torch.tensor([[0.7, -1.4, 0.0, 0.35], [0.0, 0.0, 0.0, 0.0]])
    packed, scale = quantize_int4_per_group(w, 2)                  # groups [0.7, -1.4], [0, 0.35]
    assert torch.allclose(scale, torch.tensor([[0.2, 0.05], [1.0, 1.0]]))
    assert unpack_int4(packed).tolist() == [[4, -7, 0, 7], [0, 0, 0, 0]]   # 0.7 / 0.2 = 3.5 -> 4 (ties to even)
    assert torch.allclose(dequantize_int(packed, scale, 2), torch.tensor([[0.8, -1.4, 0, 0.35], [0, 0, 0, 0]]))
    q8, scale8 = quantize_int8_per_channel(w)
    assert q8.tolist()[0] == [64, -127, 0, 32] and scale8.tolist() == pytest.approx([1.4 / 127, 1.0])
    with pytest.raises(ValueError, match="needs a per-channel scale"):
        dequantize_int(q8, scale)
    with pytest.raises(ValueError, match="do not split K = 4"):
        quantize_int4_per_group(w, 3)


@pytest.mark.parametrize("quant,group_size", [("w8a8", None), ("w4a8", 32), ("w4a8", 16)])
def test_published_checkpoint(published, tmp_path, quant, group_size):
    _convert(published, tmp_path / "out", quant, None if group_size == 32 else group_size)
    kinds = check_conversion(published, tmp_path / "out", quant, group_size)
    routed = "int8" if quant == "w8a8" else "int4"
    for prefix in ("layers.1.", "layers.3.", "mtp.0."):  # the MTP block is quantized like a decoder layer
        assert kinds[prefix + "attn.wq_b.weight"] == kinds[prefix + "attn.wo_b.weight"] == "int8"
        assert kinds[prefix + "attn.indexer.wq_b.weight"] == "int8"
        assert kinds[prefix + "ffn.shared_experts.w2.weight"] == "int8"
        assert kinds[prefix + "ffn.experts.7.w1.weight"] == kinds[prefix + "ffn.experts.7.w2.weight"] == routed
        for kept in ("attn.wq_a", "attn.wkv", "attn.wo_a", "attn.indexer.weights_proj", "attn.compressor.wkv",
                     "ffn.gate", "attn_norm"):
            assert kinds[prefix + kept + ".weight"] == "kept"
    assert kinds["embed.weight"] == kinds["head.weight"] == kinds["mtp.0.e_proj.weight"] == "kept"
    assert kinds["layers.0.ffn.gate.tid2eid"] == kinds["hc_head_fn"] == "kept"
    blocks, routed_count = 4 + 1, (4 + 1) * 8 * 3  # 4 layers + MTP; 8 experts x w1 / w2 / w3
    int8_count = blocks * 2 + 3 + blocks * 3 + (routed_count if quant == "w8a8" else 0)  # wq_b + wo_b, 3 indexers
    assert sum(k == "int8" for k in kinds.values()) == int8_count
    assert sum(k == "int4" for k in kinds.values()) == (routed_count if quant == "w4a8" else 0)


@pytest.mark.parametrize("quant", ["w8a8", "w4a8"])
def test_transformers_bf16_checkpoint(transformers_bf16, tmp_path, quant):
    _convert(transformers_bf16, tmp_path / "out", quant)
    kinds = check_conversion(transformers_bf16, tmp_path / "out", quant, 32)
    layer = "model.layers.1."
    assert kinds[layer + "self_attn.q_b_proj.weight"] == kinds[layer + "self_attn.o_b_proj.weight"] == "int8"
    assert kinds[layer + "self_attn.compressor.indexer.q_b_proj.weight"] == "int8"
    assert kinds[layer + "mlp.shared_experts.up_proj.weight"] == "int8"
    assert kinds[layer + "self_attn.q_a_proj.weight"] == kinds["lm_head.weight"] == "kept"
    d = Checkpoint(tmp_path / "out")
    if quant == "w4a8":  # stacked [E, N, K] experts: packed along K, scales per group
        assert d.shape(layer + "mlp.experts.gate_up_proj") == (8, 64, 32)
        assert d.shape(layer + "mlp.experts.gate_up_proj_scale") == (8, 64, 2)
        assert d.shape(layer + "mlp.experts.down_proj_scale") == (8, 64, 1)
    else:
        assert d.shape(layer + "mlp.experts.down_proj_scale") == (8, 64)
    assert d.config["quantization_config"]["weights"]["int8"][0] == r"\.self_attn\.q_b_proj\.weight$"


def test_config_and_tokenizer(published, tmp_path):
    _convert(published, tmp_path / "out", "w4a8")
    src = json.loads((published / "config.json").read_text())
    out = json.loads((tmp_path / "out/config.json").read_text())
    qc = out.pop("quantization_config")
    assert out == {k: v for k, v in src.items() if k != "quantization_config"}  # the FP8 entry is gone
    assert qc["quant_method"] == "npu-cookbook" and qc["format"] == "w4a8" and qc["group_size"] == 32
    assert qc["activations"] == "int8, per token, dynamic"
    assert qc["weights"] == {"int8": [r"\.attn\.wq_b\.weight$", r"\.attn\.wo_b\.weight$",
                                      r"\.attn\.indexer\.wq_b\.weight$", r"\.ffn\.shared_experts\.w[123]\.weight$"],
                             "int4": [r"\.ffn\.experts\.\d+\.w[123]\.weight$"]}
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / f).read_bytes() == (published / f).read_bytes()
    _convert(published, tmp_path / "w8", "w8a8")
    qc = json.loads((tmp_path / "w8/config.json").read_text())["quantization_config"]
    assert qc["group_size"] is None and "int4" not in qc["weights"] and len(qc["weights"]["int8"]) == 5


def test_streaming_holds_one_tensor_and_caps_shards(published, tmp_path, monkeypatch):
    """At every read, the source tensors still alive (the ones copied as stored, waiting in the shard being filled)
    fit in one shard; no dequantized weight outlives its quantization; every shard is within the cap."""
    cap = 64 * 1024
    alive, at_read = {}, []
    get = Checkpoint.get

    def tracked(self, name, dtype=None, shard=None):
        at_read.append(sum(alive.values()))
        t = get(self, name, dtype, shard)
        key = object()
        alive[key] = t.numel() * t.element_size()
        weakref.finalize(t, alive.pop, key, None)
        return t

    monkeypatch.setattr(Checkpoint, "get", tracked)
    _convert(published, tmp_path / "out", "w8a8", max_shard_bytes=cap)
    monkeypatch.undo()
    source_bytes = sum(f.stat().st_size for f in published.glob("*.safetensors"))
    assert len(at_read) == len(Checkpoint(published).names()) and source_bytes > 10 * cap
    assert max(at_read) <= cap
    index = json.loads((tmp_path / "out/model.safetensors.index.json").read_text())
    shards = sorted((tmp_path / "out").glob("model-*.safetensors"))
    assert len(shards) > 5 and all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", f.name)
                                   for f in shards)
    assert set(index["weight_map"].values()) == {f.name for f in shards}
    assert not list((tmp_path / "out").glob("*.partial"))
    total = 0
    for f in shards:
        with safe_open(f, "pt") as h:
            sizes = {n: h.get_slice(n).get_shape() for n in h.keys()}
            nbytes = sum(h.get_tensor(n).nbytes for n in h.keys())
        assert nbytes <= cap or len({n.removesuffix("_scale") for n in sizes}) == 1, f.name
        total += nbytes
    assert index["metadata"]["total_size"] == total


RSS_SCRIPT = """
import json, re, sys
from pathlib import Path
from convert_checkpoint import convert

def status(key):  # this process's own (ru_maxrss would carry the parent's peak over fork + exec)
    return int(re.search(rf"{key}:\\s+(\\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024

Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak RSS) to the RSS now
before = status("VmRSS")
convert(sys.argv[1], sys.argv[2], "w8a8", max_shard_bytes=4 * 2**20, progress=False)
print(json.dumps({"before": before, "peak": status("VmHWM")}))
"""


def test_peak_memory_stays_near_one_tensor(tmp_path):
    """64 MiB of bf16 experts (2 MiB each, 4 MiB dequantized; 32 MiB once int8): the converter's peak RSS, in a
    process of its own, grows by a few tensors plus one 4 MiB shard (about 22 MiB), less than the outputs alone."""
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i // 8}.ffn.experts.{i % 8}.w1.weight": torch.randn(1024, 1024, generator=g).to(torch.bfloat16)
             for i in range(32)}
    save_checkpoint(tmp_path / "src", state, {"hidden_size": 1024, "moe_intermediate_size": 1024},
                    max_shard_bytes=16 * 2**20)
    del state
    # a fixed mmap threshold: glibc returns every freed tensor to the system, so RSS follows the live tensors
    # (with its adaptive threshold, freed heap memory stays resident: a plateau of 25-70 MiB here, not growing)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'recipes' / 'deepseek' / 'tools'}:{ROOT / 'recipes' / 'deepseek'}:{ROOT}", "MALLOC_MMAP_THRESHOLD_": "65536"}
    r = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path / "src"), str(tmp_path / "out")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    mem = json.loads(r.stdout.splitlines()[-1])
    growth = (mem["peak"] - mem["before"]) / 2**20
    assert growth < 32, f"peak RSS grew {growth:.1f} MiB converting a 64 MiB checkpoint"
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) >= 8


def _cli_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.split("\r")[-1]  # after a progress bar cleared midway
    assert e.value.code == 2 and err.count("\n") == 1 and err.endswith("\n"), err
    return err


def test_cli_errors(published, tmp_path, capsys):
    out = str(tmp_path / "out")
    missing = str(tmp_path / "nowhere")
    assert "nowhere: no such checkpoint folder" in _cli_error(capsys, ["--quant", "w8a8", missing, out])
    assert "invalid choice: 'w3a8'" in _cli_error(capsys, ["--quant", "w3a8", str(published), out])
    assert "does not divide moe_intermediate_size = 32" in _cli_error(
        capsys, ["--quant", "w4a8", "--group-size", "64", str(published), out])
    assert "must be a positive" in _cli_error(capsys, ["--quant", "w4a8", "--group-size", "0", str(published), out])
    assert "applies to w4a8" in _cli_error(capsys, ["--quant", "w8a8", "--group-size", "32", str(published), out])
    assert not Path(out).exists()  # nothing written on a bad argument
    Path(out).mkdir()
    (Path(out) / "x").write_text("x")
    assert "exists and is not an empty folder" in _cli_error(capsys, ["--quant", "w8a8", str(published), out])


def test_corrupt_source_midway_leaves_nothing(published, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in published.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    last = sorted(broken.glob("model-*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[:-7])  # truncated download: found when its first tensor is read
    assert last.name in _cli_error(capsys, ["--quant", "w8a8", str(broken), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_command_line(published, tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--quant", "w4a8", str(published), str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"wrote {tmp_path / 'out'} (w4a8)"
    assert "tensor" in r.stderr  # the progress bar
    assert Checkpoint(tmp_path / "out").dtype("layers.1.ffn.experts.0.w1.weight") == torch.int8
