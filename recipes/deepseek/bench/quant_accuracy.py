"""Accuracy of W8A8 and W4A8 against the float checkpoint they were converted from, in one run.

    python bench/quant_accuracy.py [--weights DIR] [--w8a8 DIR] [--w4a8 DIR] [--group-size 32] [--dtype auto|bf16|fp32]
                             [--prompts prompts.txt] [--new-tokens 64] [--threads 2]

DIR defaults to the bench checkpoint (written if absent, as bench.py does); W8A8 / W4A8 default to DIR-w8a8 and
DIR-w4a8 beside it, converted by convert_checkpoint.py when absent. All models run in --dtype (auto: the CPU's
default, bf16 where oneDNN runs it); the float model in that dtype is the reference ("bf16" below when it is bf16).
Three measurements over the prompts of --prompts (one per line, tokenized as they are) and --random-prompts
prompts of random token ids:
1. per-op output error: every quantized op fed the float model's own input at that op (forward hooks on the float
   model's modules: attention wq_b / wo_b, the indexer's wq_b, the shared expert's w13 / w2; the routed experts'
   w13 and w2 with every token of the prompts through every expert), relative Frobenius error
   ||y_quant - y_float|| / ||y_float||, per layer; the float op's own error against fp32 arithmetic on the same
   input is printed beside it (the rounding floor of the reference itself);
2. logits over every prompt position, whole prompts in one forward: KL(float || quant) mean and max per position,
   top-1 agreement; an fp32 model against the float one gives the floor where --dtype is not fp32;
3. greedy agreement length: --new-tokens greedy tokens from the engine per prompt and model, the length of the
   common prefix with the float model's (mean, min, how many agree over all of them); fp32 again as the floor.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoTokenizer

from bench_utils import BENCH, RECIPE, ensure_bench
from common import backend, ops
from common.engine import LLM, SamplingParams
from common.engine.model_runner import prefill_logits
from convert_checkpoint import convert
from modeling_deepseek_v4 import MoE, QuantLinear
from weights_deepseek_v4 import load_model

FORMATS = ("w8a8", "w4a8")
BLOCK = 128  # a multiple of every compress ratio of the bench checkpoint (4, 128)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want||_F / ||want||_F in fp32."""
    want = want.float()
    return ((got.float() - want).norm() / want.norm().clamp_min(1e-30)).item()


class OpErrors:
    """Forward hooks on the float model that feed each quantized op (of every quantized model) the float op's input
    and record the relative errors, per (op, layer): {"float": vs fp32, "w8a8": vs float, ...}."""

    def __init__(self, float_model, quantized: dict):
        self.errors: dict[tuple[str, int], dict[str, list[float]]] = {}
        self.handles = []
        some = next(iter(quantized.values()))
        for name, module in some.named_modules():
            if isinstance(module, QuantLinear):
                target = float_model.get_submodule(name)
                self.handles.append(target.register_forward_hook(self._linear_hook(name, quantized)))
            elif isinstance(module, MoE):
                target = float_model.get_submodule(name)
                self.handles.append(target.register_forward_pre_hook(self._experts_hook(name, quantized)))

    def _add(self, op: str, layer: int, kind: str, value: float) -> None:
        self.errors.setdefault((op, layer), {}).setdefault(kind, []).append(value)

    @staticmethod
    def _where(name: str) -> tuple[str, int]:
        parts = name.split(".")  # layers.<i>.<op path>
        return ".".join(parts[2:]), int(parts[1])

    def _linear_hook(self, name: str, quantized: dict):
        op, layer = self._where(name)

        def hook(module, inputs, out):
            x = inputs[0]  # [..., K]
            self._add(op, layer, "float", rel_err(out, F.linear(x.float(), module.weight.float())))
            for fmt, model in quantized.items():
                self._add(op, layer, fmt, rel_err(model.get_submodule(name)(x), out))
        return hook

    def _experts_hook(self, name: str, quantized: dict):
        _, layer = self._where(name + ".x")

        def hook(module, args):
            x = args[0]  # [T, D]: the MoE's input; every token through every expert of this rank
            experts = module.experts
            E, T = experts.w13.shape[0], x.shape[0]
            counts = torch.full((E,), T, dtype=torch.int64)
            xe = x.repeat(E, 1)  # [E*T, D], sorted by expert
            limit = module.args.swiglu_limit
            h = {"float": experts.matmul(xe, "w13", counts)}  # [E*T, 2I]
            act = ops.swiglu(h["float"], limit)  # [E*T, I]: the float model's input to w2, fed to every w2
            w2 = {"float": experts.matmul(act, "w2", counts)}
            for which, out, inp in (("w13", h["float"], xe), ("w2", w2["float"], act)):
                w = getattr(experts, which).float()  # [E, N, K]
                ref = torch.einsum("etk,enk->etn", inp.float().view(E, T, -1), w).reshape(E * T, -1)
                self._add(f"experts.{which}", layer, "float", rel_err(out, ref))
            for fmt, model in quantized.items():
                q = model.get_submodule(name).experts
                self._add("experts.w13", layer, fmt, rel_err(q.matmul(xe, "w13", counts), h["float"]))
                self._add("experts.w2", layer, fmt, rel_err(q.matmul(act, "w2", counts), w2["float"]))
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def table(self, formats) -> str:
        layers = sorted({layer for _, layer in self.errors})
        ops_ = list(dict.fromkeys(op for op, _ in self.errors))
        lines = [f"{'op':<26}{'vs':<7}" + "".join(f"{'L' + str(i):>8}" for i in layers) + f"{'mean':>8}"]
        for op in ops_:
            for kind in ("float", *formats):
                row = [sum(v) / len(v) * 100 if (v := self.errors.get((op, i), {}).get(kind)) else None
                       for i in layers]
                if all(r is None for r in row):
                    continue
                vals = [r for r in row if r is not None]
                cells = "".join(f"{r:>7.2f}%" if r is not None else f"{'-':>8}" for r in row)
                label = "fp32" if kind == "float" else kind
                lines.append(f"{op if kind == 'float' else '':<26}{label:<7}{cells}{sum(vals) / len(vals):>7.2f}%")
        return "\n".join(lines)


def kl_top1(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, float]:
    """(KL(want || got) mean, max per position, top-1 agreement) of log-probs [T, V]."""
    kl = F.kl_div(got, want, log_target=True, reduction="none").sum(-1)  # [T]
    return kl.mean().item(), kl.max().item(), (got.argmax(-1) == want.argmax(-1)).float().mean().item()


def greedy(path: Path, dtype: torch.dtype, prompts: list[list[int]], new: int) -> list[list[int]]:
    llm = LLM(load_model(path, dtype), AutoTokenizer.from_pretrained(path), block_size=BLOCK, max_num_seqs=16,
              max_num_batched_tokens=2048, enable_prefix_caching=False, kv_cache_memory_bytes=2**28)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), use_tqdm=False)
    return [o.token_ids for o in outs]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def ensure(path: Path, fmt: str, src: Path, group_size: int) -> Path:
    if not (path / "config.json").exists():
        print(f"converting {src} -> {path} ({fmt})", flush=True)
        convert(src, path, fmt, group_size if fmt == "w4a8" else None)
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", type=Path, default=BENCH, help="the float checkpoint (default: the bench one)")
    for fmt in FORMATS:
        p.add_argument(f"--{fmt}", type=Path, help=f"its {fmt} conversion (default: DIR-{fmt}, converted if absent)")
    p.add_argument("--group-size", type=int, default=32, help="W4A8 group size when converting here")
    p.add_argument("--dtype", choices=[backend.AUTO, *sorted(backend.DTYPES)], default=backend.AUTO)
    p.add_argument("--prompts", type=Path, default=RECIPE / "prompts.txt")
    p.add_argument("--random-prompts", type=int, default=4, help="and this many prompts of random token ids ...")
    p.add_argument("--random-len", type=int, default=600, help="... of this many tokens (past the window and the "
                   "compress ratios, so every attention kind reads compressed entries)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    start = time.perf_counter()
    torch.set_num_threads(a.threads)
    dtype, line = backend.resolve_dtype(a.dtype, None)
    print(f"{line}; {backend.cpu_description()}", flush=True)
    if a.weights == BENCH:
        ensure_bench()
    paths = {fmt: ensure(getattr(a, fmt) or a.weights.with_name(f"{a.weights.name}-{fmt}"), fmt, a.weights,
                         a.group_size) for fmt in FORMATS}
    tok = AutoTokenizer.from_pretrained(a.weights)
    lines = [s for s in a.prompts.read_text().splitlines() if s.strip()]
    g = torch.Generator().manual_seed(0)
    prompts = [tok.encode(s) for s in lines] + [torch.randint(10, len(tok), (a.random_len,), generator=g).tolist()
                                                 for _ in range(a.random_prompts)]
    name = backend.dtype_name(dtype)
    print(f"{len(lines)} prompts from {a.prompts.name} and {a.random_prompts} of {a.random_len} random tokens, "
          f"{sum(map(len, prompts))} tokens; float reference: "
          f"{a.weights.name} in {name}", flush=True)

    with tqdm(total=3 + 2 * len(FORMATS), desc="accuracy", unit="step") as bar:
        float_model = load_model(a.weights, dtype)
        quantized = {fmt: load_model(path, dtype) for fmt, path in paths.items()}
        bar.update()
        hooks = OpErrors(float_model, quantized)
        want = torch.log_softmax(prefill_logits(float_model, prompts, BLOCK).float(), -1)  # [T, V]; runs the hooks
        hooks.remove()
        bar.update()
        logits = {fmt: kl_top1(torch.log_softmax(prefill_logits(m, prompts, BLOCK).float(), -1), want)
                  for fmt, m in quantized.items()}
        if dtype != torch.float32:
            fp32 = load_model(a.weights, torch.float32)
            logits = {"fp32": kl_top1(want, torch.log_softmax(prefill_logits(fp32, prompts, BLOCK), -1))} | logits
            del fp32
        del float_model, quantized
        bar.update()
        tokens = {"float": greedy(a.weights, dtype, prompts, a.new_tokens)}
        bar.update()
        for fmt, path in paths.items():
            tokens[fmt] = greedy(path, dtype, prompts, a.new_tokens)
            bar.update(2)
        if dtype != torch.float32:
            tokens["fp32"] = greedy(a.weights, torch.float32, prompts, a.new_tokens)

    print(f"\n1. per-op relative output error (%), each quantized op on the {name} model's input at that op; the "
          f"'fp32' row: the {name} op against fp32 arithmetic on the same input")
    print(hooks.table(FORMATS))
    print(f"\n2. logits over {want.shape[0]} prompt positions against the {name} model")
    print(f"{'model':<8}{'KL mean':>10}{'KL max':>10}{'top-1':>8}")
    for fmt, (mean, mx, top1) in logits.items():
        print(f"{fmt:<8}{mean:>10.4f}{mx:>10.4f}{top1:>8.3f}" + ("  (the floor: fp32 vs the reference)"
                                                                  if fmt == "fp32" else ""))
    print(f"\n3. greedy agreement with the {name} model over {a.new_tokens} new tokens, {len(prompts)} prompts")
    for fmt in [k for k in tokens if k != "float"]:
        lengths = [common_prefix(t, r) for t, r in zip(tokens[fmt], tokens["float"])]
        full = sum(n == a.new_tokens for n in lengths)
        print(f"{fmt:<8}mean {sum(lengths) / len(lengths):.1f}, min {min(lengths)}, all {a.new_tokens} on "
              f"{full}/{len(lengths)} prompts" + ("  (the floor)" if fmt == "fp32" else ""))
    print(f"\nwall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
