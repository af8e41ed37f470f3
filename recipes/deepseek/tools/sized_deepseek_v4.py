"""Write a random DeepSeek-V4-shaped checkpoint of a chosen size: MoE offload bigger than the machine's memory.

The tiny writer (tiny_deepseek_v4.py) at V4-Flash's dimensions (plan.FLASH_CONFIG: hidden 4096, 64 heads of 512,
experts of 2048, top-6, the same layer kinds in the same order), with the number of layers, routed experts per
layer and vocabulary chosen, in the publisher's storage (FP8 linears, MXFP4 routed experts, bf16 / fp32 elsewhere)
with the tiny tokenizer. Written one tensor at a time (memory: about one shard); the routed experts are drawn in
MXFP4 directly (random e2m1 codes, one power-of-two scale per 32 inputs, sized so a row's values have a standard
deviation near 1/sqrt(fan-in)), never as floats.

    python tools/sized_deepseek_v4.py OUT [--layers 4] [--experts 144] [--vocab 512] [--mtp-layers 0] [--dry-run]

It first prints the sizes: the weights in bf16 (an all-resident bf16 load), the MXFP4 experts (what the host
holds with --offload-experts), and the disk the checkpoint takes; it refuses when the disk has less free.
"""
from __future__ import annotations

import argparse
import math
import shutil
import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the recipe's modules (a tool runs from tools/)
from common.loader import save_checkpoint_lazily, write_tokenizer
from common.loader.quant import E2M1, MX_GROUP, MX_SCALE_DTYPE
from config_deepseek_v4 import ModelArgs
from modeling_deepseek_v4 import DeepseekV4
from plan import FLASH_CONFIG
from tiny_deepseek_v4 import (CHAT_TEMPLATE, REVISION_FILE, SPECIAL_TOKENS, format_corpus, publisher_names, quantize,
                              random_tensor)

_EXPERT_STACK = ("experts.w13", "experts.w2")
_E2M1_RMS = float(E2M1.square().mean().sqrt())  # a uniformly random e2m1 code's root mean square (2.93)


def sized_config(layers: int, experts: int, vocab: int = 512, mtp_layers: int = 0, top_k: int = 6) -> dict:
    """V4-Flash's config.json with `layers` layers (its first ones: sliding, sliding, CSA, HCA, ...; hash routing in
    the first min(3, layers - 1)), `experts` routed experts a layer, top_k of them a token, and `vocab` tokens."""
    if layers < 1 or experts < top_k or vocab < 1 or mtp_layers < 0:
        raise ValueError(f"need layers >= 1, experts >= top_k ({top_k}), vocab >= 1, mtp_layers >= 0; got "
                         f"{layers}, {experts}, {vocab}, {mtp_layers}")
    ratios = FLASH_CONFIG["compress_ratios"]
    return {**FLASH_CONFIG, "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            "num_hidden_layers": layers, "compress_ratios": [*ratios[:layers], 0], "n_routed_experts": experts,
            "num_experts_per_tok": top_k, "num_hash_layers": min(3, layers - 1), "vocab_size": vocab,
            "num_nextn_predict_layers": mtp_layers, "max_position_embeddings": 65536, "torch_dtype": "bfloat16"}


def _model_tensors(args: ModelArgs) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return DeepseekV4(args, mtp=True).state_dict()  # shapes and dtypes only


def _expert_names(name: str, t: torch.Tensor) -> dict[str, tuple[int, int]]:
    """A routed-expert stack -> {publisher name of each expert's w1 / w3 / w2: its float shape (N, K)}."""
    base, rows = name.rsplit(".", 1)[0], t.shape[1] // (2 if name.endswith("w13") else 1)
    parts = ("w1", "w3") if name.endswith("w13") else ("w2",)
    return {f"{base}.{e}.{w}.weight": (rows, t.shape[2]) for e in range(t.shape[0]) for w in parts}


def stored_tensors(config: dict) -> dict[str, tuple[str, tuple[int, int] | None, int]]:
    """Every tensor the checkpoint stores -> (the model tensor it comes from; for a routed expert's MXFP4 weight or
    scale, the expert's float shape (N, K), else None; its bytes)."""
    out = {}
    for name, t in _model_tensors(ModelArgs.from_config(config)).items():
        if name.endswith(_EXPERT_STACK):
            for weight, (n, k) in _expert_names(name, t).items():
                out[weight] = (name, (n, k), n * k // 2)  # two e2m1 codes a byte
                out[weight.removesuffix("weight") + "scale"] = (name, (n, k), n * k // MX_GROUP)  # one e8m0 a group
        else:
            for stored, q in quantize(publisher_names({name: torch.empty_like(t)})).items():  # meta: no data
                out[stored] = (name, None, q.numel() * q.element_size())
    return out


def checkpoint_sizes(config: dict) -> dict[str, int]:
    """{"disk": the safetensors bytes, "bf16": the weights in bf16 (every float as 2 bytes), "mxfp4_experts": the
    routed experts' MXFP4 bytes}."""
    tensors = _model_tensors(ModelArgs.from_config(config))
    stored = stored_tensors(config).values()
    return {"disk": sum(n for _, _, n in stored), "mxfp4_experts": sum(n for _, shape, n in stored if shape),
            "bf16": sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in tensors.values())}


def random_mxfp4(shape: tuple[int, int], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random [N, K] matrix in MXFP4: (int8 [N, K/2] random e2m1 codes, e8m0 [N, K/32] scales 2^s or 2^(s+1) with
    2^s * rms(code) <= 1/sqrt(K) < 2^(s+1) * rms(code))."""
    n, k = shape
    codes = torch.randint(-128, 128, (n, k // 2), dtype=torch.int8, generator=g)
    s = math.floor(-math.log2(_E2M1_RMS * math.sqrt(k)))
    exponent = torch.randint(s, s + 2, (n, k // MX_GROUP), generator=g) + 127  # e8m0: the biased exponent byte
    return codes, exponent.to(torch.uint8).view(MX_SCALE_DTYPE)


class _Maker:
    """make(name) for save_checkpoint_lazily: each model tensor drawn (from a generator seeded by the seed and its
    name, so the values do not depend on the order) when its first stored tensor is asked for; its siblings (an
    FP8 weight's scale, the other half of a packed weight) wait in `pending` until asked for."""

    def __init__(self, config: dict, seed: int):
        self.args, self.seed = ModelArgs.from_config(config), seed
        self.tensors, self.sources = _model_tensors(self.args), stored_tensors(config)
        self.pending: dict[str, torch.Tensor] = {}

    def _generator(self, name: str) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.pending:
            source, shape, _ = self.sources[name]
            if shape is not None:  # a routed expert's weight and scale, drawn in MXFP4
                weight = name.removesuffix("scale").removesuffix("weight")
                q, scale = random_mxfp4(shape, self._generator(weight))
                self.pending.update({weight + "weight": q, weight + "scale": scale})
            else:
                value = random_tensor(source, self.tensors[source], self._generator(source), self.args.n_routed_experts)
                self.pending.update(quantize(publisher_names({source: value})))
        return self.pending.pop(name)


def write_sized_checkpoint(path, config: dict, seed: int = 0, max_shard_bytes: int = 1 << 30) -> Path:
    """Write config.json, the safetensors shards (+ index) and the tokenizer into `path`; returns the path."""
    path = Path(path)
    make = _Maker(config, seed)
    sizes = {name: n for name, (_, _, n) in make.sources.items()}
    save_checkpoint_lazily(path, sizes, make, config, max_shard_bytes)
    write_tokenizer(path, vocab_size=config["vocab_size"], special_tokens=SPECIAL_TOKENS,
                    chat_template=CHAT_TEMPLATE, extra_corpus=format_corpus())
    (path / REVISION_FILE).unlink(missing_ok=True)  # not the tiny checkpoint
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=144, help="routed experts per layer (V4-Flash: 256)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--mtp-layers", type=int, default=0, help="MTP blocks (V4-Flash: 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="print the sizes, write nothing")
    a = p.parse_args(argv)
    try:
        config = sized_config(a.layers, a.experts, a.vocab, a.mtp_layers)
    except ValueError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    sizes = checkpoint_sizes(config)
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    print(f"{a.layers} layers x {a.experts} experts (V4-Flash dimensions), vocab {a.vocab}: bf16 weights "
          f"{gib(sizes['bf16'])}, MXFP4 routed experts {gib(sizes['mxfp4_experts'])}, disk {gib(sizes['disk'])}",
          flush=True)
    if a.dry_run:
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    if (free := shutil.disk_usage(a.out).free) < sizes["disk"]:
        p.exit(2, f"{p.prog}: error: {a.out} has {gib(free)} free, the checkpoint needs {gib(sizes['disk'])}\n")
    write_sized_checkpoint(a.out, config, seed=a.seed)
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
