"""The sized writer (sized_deepseek_v4.py: a V4-shaped checkpoint of a chosen size, written a tensor at a time, the
routed experts drawn in MXFP4): the tiny writer's layout and storage, what it plans is what it writes, experts of the
intended scale; its checkpoint runs offloaded == all-resident; loading it offloaded raises RSS by about one compact
copy of the experts (the torch backend and kt-kernel); and V4-Flash's dimensions at the default size need more than
24 GiB in bf16 while the MXFP4 experts take under 8."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from common.engine.model_runner import prefill_logits
from common.loader import Checkpoint
from common.loader.quant import dequant_mxfp4
from common.offload import MoEOffloadConfig, kt_kernel_unavailable
from config_deepseek_v4 import ModelArgs
from sized_deepseek_v4 import checkpoint_sizes, main, sized_config, write_sized_checkpoint
from tiny_deepseek_v4 import TINY_CONFIG, write_tiny_checkpoint
from weights_deepseek_v4 import load_model, model_bytes

ROOT = Path(__file__).resolve().parents[3]
# experts dominate: 2 layers x 64 experts of 512 x 512 (1.5 MiB each in bf16, 0.4 MiB in MXFP4)
WIDE = {**TINY_CONFIG, "hidden_size": 512, "moe_intermediate_size": 512, "n_routed_experts": 64,
        "num_nextn_predict_layers": 0, "num_hidden_layers": 2, "layer_types": TINY_CONFIG["layer_types"][:2],
        "mlp_layer_types": TINY_CONFIG["mlp_layer_types"][:2]}


def stored(path) -> dict[str, tuple[torch.dtype, tuple]]:
    out = {}
    for f in Path(path).glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            out.update({n: (h.get_tensor(n).dtype, tuple(h.get_tensor(n).shape)) for n in h.keys()})
    return out


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return write_sized_checkpoint(tmp_path_factory.mktemp("wide") / "ckpt", WIDE, seed=2)


@pytest.fixture(scope="module")
def tiny_sized(tmp_path_factory):
    return write_sized_checkpoint(tmp_path_factory.mktemp("sized") / "ckpt", TINY_CONFIG, seed=1,
                                  max_shard_bytes=64 * 1024)


def test_the_tiny_writers_layout_and_what_it_planned(tiny_sized, tmp_path):
    tiny = write_tiny_checkpoint(tmp_path / "tiny", seed=1, vision=False)  # the sized writer writes V4-Flash's
    assert stored(tiny_sized) == stored(tiny)  # every name, dtype and shape as the tiny writer stores them
    index = json.loads((tiny_sized / "model.safetensors.index.json").read_text())
    on_disk = sum(f.stat().st_size for f in tiny_sized.glob("*.safetensors"))
    assert index["metadata"]["total_size"] == checkpoint_sizes(TINY_CONFIG)["disk"] < on_disk  # + headers
    assert len(set(index["weight_map"].values())) > 1  # written shard by shard
    ckpt = Checkpoint(tiny_sized)
    w = dequant_mxfp4(ckpt.get("layers.1.ffn.experts.5.w1.weight"), ckpt.get("layers.1.ffn.experts.5.w1.scale"))
    assert 0.5 < float(w.std()) * TINY_CONFIG["hidden_size"] ** 0.5 < 2  # std ~ 1/sqrt(fan-in)


def test_sized_checkpoint_runs_offloaded_equal_to_all_resident(tiny_sized):
    prompts = [[5, 9, 17, 33, 2, 7, 100], [3, 4, 5, 6]]
    want = prefill_logits(load_model(tiny_sized, torch.float32), prompts)
    model = load_model(tiny_sized, torch.float32, offload=MoEOffloadConfig(3))
    assert torch.allclose(prefill_logits(model, prompts), want, atol=1e-4, rtol=0)
    assert 0 < model.offload.hit_rate() < 1


RSS_SCRIPT = """
import json, re, sys
from pathlib import Path
import torch
from common.offload import MoEOffloadConfig, kt_kernel_unavailable
from weights_deepseek_v4 import load_model

def status(key):  # kB lines of /proc/self/status
    return int(re.search(rf"{key}:\\s+(\\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024

backend = sys.argv[2]
assert backend == "torch" or kt_kernel_unavailable() is None  # (loads kt-kernel's library before measuring)
before = status("RssAnon")
model = load_model(sys.argv[1], torch.bfloat16, offload=MoEOffloadConfig(4, host_backend=backend), max_tokens=8)
print(json.dumps({"growth": status("RssAnon") - before}))
"""


@pytest.mark.parametrize("backend", ["torch", pytest.param("kt", marks=pytest.mark.skipif(
    kt_kernel_unavailable() is not None, reason=f"kt-kernel: {kt_kernel_unavailable()}"))])
def test_loading_offloaded_raises_rss_by_one_compact_copy(wide, backend):
    """4 of 64 experts resident in bf16: the process's anonymous memory grows by the device part (attention, shared
    expert, router, the 4 slots) plus about one MXFP4 copy of every expert (kt-kernel repacks it into buffers of its
    own and the loader drops its copy), far below the all-resident bf16 load; printed for the bench log."""
    # a fixed mmap threshold: glibc returns every freed tensor to the system, so RSS follows the live tensors
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'recipes' / 'deepseek'}:{ROOT}", "MALLOC_MMAP_THRESHOLD_": "65536"}
    r = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(wide), backend], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    growth = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("{")))["growth"]
    args = ModelArgs.from_config(WIDE)
    need = model_bytes(args, torch.bfloat16, offload_slots=4)
    host, device = need["host"], need["device"]
    assert host > 2 * device and model_bytes(args, torch.bfloat16)["device"] > 2 * (host + device)
    slack = 0.35 if backend == "kt" else 0.1  # kt: its scales as bf16 (+6%) and its work buffers (1.28x measured)
    print(f"{backend}: load RSS +{growth / 2**20:.1f} MiB = device part {device / 2**20:.1f} MiB + "
          f"{(growth - device) / host:.2f} x the {host / 2**20:.1f} MiB of MXFP4 experts")
    assert 0.9 * host < growth - device < (1 + slack) * host, (growth / 2**20, device / 2**20, host / 2**20)


def test_the_default_flash_sized_checkpoint_exceeds_24_gib_in_bf16_and_its_experts_do_not():
    sizes = checkpoint_sizes(sized_config(4, 144))
    assert sizes["bf16"] > 24 * 2**30 > 3 * sizes["mxfp4_experts"]
    assert sizes["mxfp4_experts"] < sizes["disk"] < 8 * 2**30
    args = ModelArgs.from_config(sized_config(4, 144))
    assert args.hidden_size == 4096 and args.moe_intermediate_size == 2048 and args.num_experts_per_tok == 6
    assert [args.compress_rate(i) for i in range(4)] == [0, 0, 4, 128]


def test_cli_prints_the_sizes_and_refuses_bad_sizes(tmp_path, capsys):
    assert main([str(tmp_path / "x"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "4 layers x 144 experts" in out and "bf16 weights 28.05 GiB" in out and "disk 7.72 GiB" in out
    assert not (tmp_path / "x").exists()
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "x"), "--experts", "4"])
    assert e.value.code == 2 and "experts >= top_k" in capsys.readouterr().err
