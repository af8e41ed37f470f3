"""Quantized execution (DeepSeek-V4 W8A8 / W4A8): per-token int8 activations, int8 or int4 weights, int32 sums.

    dynamic_quant(x)                                   -> (x_q int8 [..., K], scale fp32 [...])
    quant_linear(x, weight, weight_scale, bias=None)   -> [..., N] in x.dtype          (W8A8)
    grouped_quant_matmul(x, weight, weight_scale, tokens_per_expert, group_size=None)
                                                       -> [M, N] in x.dtype  (W8A8 experts, or W4A8 per group)

The arithmetic, exactly (these functions are the ground truth and the CPU path at once):
- dynamic_quant, per row of x (in fp32): scale = max(amax(|x|) / 127, FLT_MIN), x_q = round(x / scale) with
  torch.round (round half to even), as int8. |x_q| <= 127 needs no clamp: scale >= amax / 127 up to one fp32
  rounding, so |x / scale| <= 127 * (1 + 2^-22) < 127.5. A zero row (or one below 127 * FLT_MIN) gets scale
  FLT_MIN: never 0, so nothing divides by 0 and (x_q, scale) stay consistent; a zero row quantizes to 0.
  NaN / inf inputs are undefined. (npu_dynamic_quant documents `round` without its tie rule or zero rows.)
- W8A8 (quant_linear, grouped_quant_matmul without group_size): acc = x_q @ w_q.T summed exactly in int32
  (`int8_matmul`), then y = (float(acc) * weight_scale[n]) * x_scale[m] (+ bias[n]) in fp32, rounded once to
  x.dtype. float(acc) is exact while |acc| <= 2^24 (always for K <= 1040: 1040 * 127^2 < 2^24).
- W4A8 (group_size given): the weight holds int4 values -8..7 packed two per byte along K (int8 storage
  [E, N, K/2], low nibble = even k), scales [E, N, K/group_size]. Per group g: acc_g = sum over the group of
  x_q * w (exact integers), y = sum_g acc_g * weight_scale[e, n, g] in fp32 (summation order unspecified),
  times x_scale[m], rounded to x.dtype.

CPU kernel: `torch._int_mm` (oneDNN's s8s8s32 GEMM), reading the weight as stored, [N, K] int8, through its
transposed view. Measured on the 2-core AVX512-BF16 / AVX512_VNNI VM (microseconds, min over 3-4 runs of many
calls; x bf16 [M, K], weight N x K; "W8A8" = dynamic_quant + int8 GEMM + dequant to bf16, as `quant_linear` runs):

    M    N x K        bf16      bf16 oneDNN  _int_mm  qlinear  W8A8 via  W8A8 via  weight-only
                      F.linear  packed       kernel   kernel   _int_mm   qlinear   _weight_int8pack_mm
    1    1024x1024      64         23          6.9      24        29        41        14
    1    1024x512       38         17          5.1      19        25        36         9.1
    1    512x1024       40         16          5.2      20        25        36         8.6
    1    16384x1024    828        192         74       111       124       138       186
    16   1024x1024     103         46         36        36        78        72        95
    16   1024x512       57         29         20        26        54        55        54
    16   512x1024       58         28         29        26        64        59        49
    16   16384x1024   1554        566        456       316       533       387      1502
    512  1024x1024    1079        990        538       518       737       760      2921
    512  16384x1024  18116      16522       9606     ~17000    11918      9970     48976

(dynamic_quant alone: 9 / 16 / ~110 at M = 1 / 16 / 512.) `_int_mm` is the fastest int8 kernel at M = 1 (end to
end 1.1-1.4x faster than oneDNN's quantized linear, `onednn.qlinear_pointwise` on a `qlinear_prepack`ed weight)
and ties it elsewhere except 16384x1024 at M = 16 / 512, where qlinear (weight scale fused) is 27 / 16 % faster. qlinear
also needs uint8 activations (x_q + 128, zero point 128: with int8 activations it falls to a reference kernel,
250 ms for 16x1024x1024) and a packed copy held in place of the weight; `_int_mm` needs no packing at all, the
int8 checkpoint tensor is used as loaded, so there is nothing to pack once, no second copy and nothing to go
stale. A contiguous [K, N] copy of the weight is slower (M = 1, 16384x1024: 385 vs 74). `_weight_int8pack_mm` is
weight-only (bf16 activations, not W8A8): faster than W8A8 at M = 1 on the small shapes, 2.8x slower at M = 16
on 16384x1024 and 3-4x slower at M = 512.
The table reads weights from cache. In a decode step they come from memory; cycling through 120 distinct 1024 x
1024 weights (sixth session, same VM, x bf16, us per GEMM kernel alone): M = 1: bf16 packed 44, `_int_mm` 25-29,
qlinear (prepacked, uint8 x) 38; M = 3: 49 / 59 / 39; M = 16: 75 / 85 / 54. There qlinear, whose prepacking does
the VNNI reorder and the int8 compensation once, is 1.3-1.6x `_int_mm` from M = 3, and `_int_mm` 1.4x qlinear at
M = 1. `_int_mm` stays: it wins at batch 1 (every GEMM of the step has M = 1), it needs no packed copy, and at batch
16 the weight GEMMs are ~11 of ~37 ms a step (bench_quant.py), so qlinear would give at most ~1.1x there.
Against bf16, W8A8 pays ~10-30 us of quantize / dequantize per call: it loses to the oneDNN-packed bf16 GEMM on
the small decode shapes, wins on 16384x1024 (M = 1: 124 vs 192) and at prefill (737 vs 990, 11918 vs 16522).
Without VNNI (ONEDNN_MAX_CPU_ISA=AVX2 or AVX512_CORE: AVX2-only or pre-Cascade-Lake x86) oneDNN's int8 GEMMs
(`_int_mm` and qlinear alike) multiply through vpmaddubsw, whose int16 pair sums saturate: full-range int8 gives
wrong sums (off by up to 1e5 at K = 1024). `int8_matmul` therefore checks `_int_mm` once against exact sums on
saturating inputs (`cpu_int8_kernel()`) and, where it fails, or off CPU, sums in fp32 instead: products and
partial sums of K <= 1024 int8 values are integers below 2^24, exact in fp32. Under the AVX2 simulation
(ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2, where bf16 is not packed either) that W8A8 path costs, for
the four shapes above: M = 1: 138 / 94 / 80 / 1859 us against bf16 F.linear's 40 / 24 / 21 / 646; M = 16:
384 / 217 / 204 / 5374 against 599 / 345 / 298 / 10081; M = 512 (1024x1024, 16384x1024): 5163 / 89276 against
19065 / 306893. W4A8 needs int32 sums per group, which one GEMM over K does not give: `int4_group_matmul` sums
the low and high nibbles apart and puts several groups through one `_int_mm` as a block-diagonal activation; at
prefill sizes it unpacks the expert's int4 weight and runs `_int_mm` per group (exact fp32 batched sums without
`_int_mm`). Before int4_group_matmul, with the unpack and a GEMM per group at every size: That costs: 8 experts,
1024x1024, groups of 128, bf16 x: M = 16: W4A8 2271 us, W8A8 287, bf16 grouped_matmul 389; M = 128:
2761 / 490 / 595 (the unpack is ~170 us per expert and call).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from common.custom_op import direct_register_custom_op

INT8_MAX = 127
FLT_MIN = torch.finfo(torch.float32).tiny  # the smallest normal fp32: the scale of a zero row
_FP32_EXACT_K = 1024  # K per fp32 chunk: 1024 * 127 * 127 < 2^24, every partial sum exact
_FP32_EXACT_GROUP = 16384  # int4 x int8 groups: 16384 * 8 * 127 < 2^24
_FP32_ROWS = 512  # weight rows converted to fp32 at a time (2 MB at K = 1024)
_BLOCK_ROWS = 128  # int4_group_matmul: rows of a block-diagonal activation, M * groups per GEMM


def dynamic_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8: x [..., K] -> (x_q int8 [..., K], scale fp32 [...]), x ~ x_q * scale[..., None].

    scale = max(amax(|x|) / 127, FLT_MIN) per row (fp32), x_q = round_half_even(x / scale); see the module doc.
    """
    x32 = x.float()  # x itself when fp32: not modified below
    scale = x32.abs().amax(-1, keepdim=True).div_(INT8_MAX).clamp_min_(FLT_MIN)  # [..., 1]
    return torch.div(x32, scale).round_().to(torch.int8), scale.squeeze(-1)


@functools.cache
def cpu_int8_kernel() -> str:
    """"_int_mm" where torch._int_mm gives exact int32 sums on this CPU (checked once, on inputs that saturate
    vpmaddubsw's int16 pair sums), else "fp32" (the exact fp32 summation of `int8_matmul`)."""
    if not hasattr(torch, "_int_mm"):
        return "fp32"
    g = torch.Generator().manual_seed(0)
    for m, k, n in ((1, 256, 32), (16, 256, 64), (64, 320, 48)):
        a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
        b = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        a[0], b[0], b[1] = 127, 127, -127  # (a + 128) * b pairs of 2 * 255 * 127 > 32767: where int16 saturates
        try:
            if not torch.equal(torch._int_mm(a, b.T), _int8_matmul_fp32(a, b)):
                return "fp32"
        except RuntimeError:
            return "fp32"
    return "_int_mm"


def _int_mm_exact_on(t: torch.Tensor) -> bool:
    """Whether torch._int_mm sums exactly for operands on t's device (CPU where cpu_int8_kernel() found it so)."""
    return t.device.type == "cpu" and cpu_int8_kernel() == "_int_mm"


def _int8_matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b.T exactly, summed in fp32 chunks of K <= 1024 (exact integers), the chunks added in int32. The weight
    is converted 512 rows at a time: a 2 MB fp32 block is reused by the allocator, where converting all of a
    16384 x 1024 weight at once page-faults a fresh 64 MB per call (34 vs 1.7 ms at M = 1 under AVX2)."""
    (m, k), n = a.shape, b.shape[0]
    out = torch.zeros(m, n, dtype=torch.int32, device=a.device)
    chunks = [(a[:, i:i + _FP32_EXACT_K].float(), slice(i, i + _FP32_EXACT_K)) for i in range(0, k, _FP32_EXACT_K)]
    for j in range(0, n, _FP32_ROWS):
        for a_chunk, cols in chunks:
            out[:, j:j + _FP32_ROWS] += F.linear(a_chunk, b[j:j + _FP32_ROWS, cols].float()).to(torch.int32)
    return out


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] int8 @ b [N, K] int8 (the nn.Linear layout) .T -> [M, N] int32, exact (no overflow for K < 133k).

    CPU: torch._int_mm on the transposed view of b (no copy, no packing) where `cpu_int8_kernel()` says it is
    exact; otherwise, and on other devices, exact fp32 sums (see the module doc)."""
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"int8_matmul takes int8 operands, got {a.dtype} and {b.dtype}")
    if torch.compiler.is_compiling() and a.device.type == "cpu":  # the kernel is picked by running ops (at the
        return torch.ops.npu_cookbook.int8_matmul(a, b)  # first call), which a trace cannot: one opaque op
    return _int8_matmul(a, b)


def _int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if _int_mm_exact_on(a):
        return torch._int_mm(a, b.T)
    return _int8_matmul_fp32(a, b)


direct_register_custom_op("int8_matmul", _int8_matmul,
                          lambda a, b: a.new_empty(a.shape[0], b.shape[0], dtype=torch.int32))


def dequant(acc, weight_scale, x_scale, bias, dtype) -> torch.Tensor:
    """(float(acc [M, N]) * weight_scale [N]) * x_scale [M] (+ bias [N]), in fp32, rounded once to dtype."""
    y = acc.float().mul_(weight_scale.float()).mul_(x_scale[:, None])
    if bias is not None:
        y.add_(bias.float())
    return y.to(dtype)


def quant_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """W8A8 linear: x [..., K] float, weight int8 [N, K] (per-channel symmetric), weight_scale fp32 [N],
    bias [N] or None -> [..., N] in x.dtype: dynamic_quant(x), exact int32 x_q @ weight.T, dequant (module doc)."""
    n, k = weight.shape
    if weight.dtype != torch.int8 or weight_scale.shape != (n,) or x.shape[-1] != k:
        raise ValueError(f"quant_linear: x [..., {k}], int8 weight [N, K], weight_scale [N]; got x {tuple(x.shape)}"
                         f", weight {weight.dtype} {tuple(weight.shape)}, weight_scale {tuple(weight_scale.shape)}")
    x_q, x_scale = dynamic_quant(x.reshape(-1, k))  # [M, K], [M]
    out = dequant(int8_matmul(x_q, weight), weight_scale, x_scale, bias, x.dtype)  # [M, N]
    return out.view(*x.shape[:-1], n)


def pack_int4(w: torch.Tensor) -> torch.Tensor:
    """int4 values -8..7 held as int8 [..., K] (K even) -> int8 [..., K/2], two per byte, low nibble = even k."""
    if w.dtype != torch.int8 or w.shape[-1] % 2 or bool(((w < -8) | (w > 7)).any()):
        raise ValueError("pack_int4 takes int8 values in -8..7 with an even last dim")
    return (w[..., 1::2] * 16) | (w[..., 0::2] & 15)  # hi * 16 in -128..112 has zero low bits: | adds lo


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: int8 [..., K/2] -> int8 [..., K] of values -8..7."""
    lo = ((packed & 15) ^ 8) - 8  # sign-extend the low nibble: 0..7 stay, 8..15 -> -8..-1
    hi = packed >> 4  # arithmetic shift: the high nibble, signed
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def int8_group_matmul(a: torch.Tensor, b: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-group sums: a [M, K] int8 and b [N, K] int8 (int4 values or any int8) -> int32 [G, M, N], G = K/group_size,
    [g] = a[:, group g] @ b[:, group g].T exactly: torch._int_mm per group on CPU where `cpu_int8_kernel()` allows,
    else a batched fp32 matmul (each sum below 2^24 for int4 x int8)."""
    (m, k), n = a.shape, b.shape[0]
    if k % group_size or group_size > _FP32_EXACT_GROUP:
        raise ValueError(f"group_size {group_size} must divide K = {k} and be at most {_FP32_EXACT_GROUP}")
    if b.numel() and not -8 <= int(b.min()) <= int(b.max()) <= 7:
        raise ValueError("int8_group_matmul sums exactly in fp32 for int4 weights (-8..7) only")
    groups = k // group_size
    if _int_mm_exact_on(a) and groups:  # 3-4x the fp32 bmm below
        return torch.stack([torch._int_mm(a[:, g:g + group_size], b[:, g:g + group_size].T)
                            for g in range(0, k, group_size)])
    a3 = a.float().view(m, groups, group_size).transpose(0, 1)  # [G, M, gs]
    b3 = b.float().view(n, groups, group_size).permute(1, 2, 0)  # [G, gs, N]
    return torch.bmm(a3, b3).to(torch.int32)


def int4_group_matmul(a: torch.Tensor, packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """int8_group_matmul of an int4 weight as pack_int4 stores it: a [M, K] int8, packed [N, K/2] -> int32 [G, M, N].

    CPU with `_int_mm`: no interleaved unpack. The low nibbles are the even k's weights, `(p << 4) >> 4` sign-extends
    them (int8 shifts are arithmetic), the high nibbles `p >> 4` the odd k's: two [N, K/2] int8 tensors, summed
    against a's even and odd columns. A GEMM of a few rows costs about what one of 100 rows does (the weight is read
    either way), so `c` groups go through one _int_mm as a block-diagonal activation [c*M, c*gs/2] (row (g, m) holds
    token m's columns of group g, zeros elsewhere) against the weight's c groups: c = 128 // M. From M = 65 (c = 1:
    two GEMMs per group) the interleaved unpack and one GEMM per group (int8_group_matmul) are faster and run
    instead. Measured (2-core AVX512_VNNI VM, 1024 x 1024, groups of 32, per expert and call, noisy): M = 1: 411-580
    us unpack + a GEMM per group, 154-290 us this; M = 3: 443-562 / 264; M = 16: 493-834 / 433-609."""
    (m, k), n = a.shape, packed.shape[0]
    if packed.dtype != torch.int8 or 2 * packed.shape[1] != k or k % group_size or group_size % 2:
        raise ValueError(f"int4_group_matmul: a [M, K], packed int8 [N, K/2], an even group_size dividing K; got "
                         f"{tuple(a.shape)}, {packed.dtype} {tuple(packed.shape)}, {group_size}")
    per_gemm = _BLOCK_ROWS // max(m, 1)  # groups per GEMM
    if not (_int_mm_exact_on(a) and m and per_gemm > 1):
        return int8_group_matmul(a, unpack_int4(packed), group_size)
    groups, half = k // group_size, group_size // 2
    out = torch.empty(groups, m, n, dtype=torch.int32)
    for parity, w in enumerate(((packed << 4) >> 4, packed >> 4)):  # [N, K/2]: even k's, odd k's
        x = a[:, parity::2].contiguous()  # [M, K/2]
        for g0 in range(0, groups, per_gemm):
            c = min(per_gemm, groups - g0)
            cols = slice(g0 * half, (g0 + c) * half)
            xs = x[:, cols].reshape(m, c, half).transpose(0, 1)  # [c, M, gs/2]
            if c > 1:
                block = torch.zeros(c, m, c, half, dtype=torch.int8)
                block[torch.arange(c), :, torch.arange(c)] = xs  # row (g, m): token m, group g's columns only
                xs = block
            acc = torch._int_mm(xs.reshape(c * m, c * half), w[:, cols].T).view(c, m, n)
            if parity:
                out[g0:g0 + c] += acc
            else:
                out[g0:g0 + c] = acc
    return out


def grouped_w8a8(x_q, x_scale, weight, weight_scale, tokens_per_expert, dtype) -> torch.Tensor:
    """The W8A8 expert matmul on quantized rows: x_q int8 [M, K] sorted by expert, x_scale [M], weight int8
    [E, N, K], weight_scale [E, N] -> [M, N] in dtype; per expert, exactly quant_linear's arithmetic (the int32
    sums of all experts into one buffer, then one dequant with each row's expert scales)."""
    m, n = x_q.shape[0], weight.shape[1]
    acc = torch.empty(m, n, dtype=torch.int32, device=x_q.device)
    ends = tokens_per_expert.cumsum(0).tolist()
    fast = _int_mm_exact_on(x_q)
    for e, (start, end) in enumerate(zip([0] + ends, ends)):
        if end > start:
            if fast:
                torch._int_mm(x_q[start:end], weight[e].T, out=acc[start:end])
            else:
                acc[start:end] = int8_matmul(x_q[start:end], weight[e])
    rows = weight_scale.repeat_interleave(tokens_per_expert.to(weight_scale.device), dim=0)  # [M, N]
    return dequant(acc, rows, x_scale, None, dtype)


def grouped_quant_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    group_size: int | None = None,
) -> torch.Tensor:
    """Quantized expert matmuls, like grouped_matmul: x [M, K] float sorted by expert, tokens_per_expert [E] counts
    -> [M, N] in x.dtype; activations dynamic_quant'ed per token.
    - group_size None or 0 (W8A8): weight int8 [E, N, K], weight_scale [E, N] (per channel).
    - group_size int (W4A8): weight int4 packed by pack_int4, int8 [E, N, K/2]; weight_scale [E, N, K/group_size].
    The split by expert is read on the host: in a compiled CPU step one opaque op, as grouped_matmul's loop.
    """
    if torch.compiler.is_compiling() and x.device.type == "cpu":
        return torch.ops.npu_cookbook.grouped_quant_matmul(x, weight, weight_scale, tokens_per_expert, group_size or 0)
    return _grouped_quant_matmul(x, weight, weight_scale, tokens_per_expert, group_size or 0)


def _grouped_quant_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          tokens_per_expert: torch.Tensor, group_size: int) -> torch.Tensor:
    m, k = x.shape
    e, n = weight.shape[:2]
    w4 = bool(group_size)  # 0: W8A8
    want_w = (e, n, k // 2) if w4 else (e, n, k)
    want_s = (e, n, k // group_size) if w4 else (e, n)
    shapes = (weight.shape, weight_scale.shape, len(tokens_per_expert))
    if weight.dtype != torch.int8 or shapes != (want_w, want_s, e):
        raise ValueError(f"grouped_quant_matmul: weight int8 {want_w}, weight_scale {want_s}, tokens_per_expert [{e}] "
                         f"for x [{m}, {k}] and group_size {group_size}; got {weight.dtype} {tuple(weight.shape)}, "
                         f"{tuple(weight_scale.shape)}, [{len(tokens_per_expert)}]")
    x_q, x_scale = dynamic_quant(x)  # [M, K], [M]
    if not w4:
        return grouped_w8a8(x_q, x_scale, weight, weight_scale, tokens_per_expert, x.dtype)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    ends = tokens_per_expert.cumsum(0).tolist()
    for i, (start, end) in enumerate(zip([0] + ends, ends)):
        if end > start:
            acc = int4_group_matmul(x_q[start:end], weight[i], group_size)  # [G, m_e, N] int32
            y = (acc.float() * weight_scale[i].float().T[:, None, :]).sum(0)  # [m_e, N] fp32
            out[start:end] = y.mul_(x_scale[start:end, None]).to(x.dtype)
    return out


direct_register_custom_op("grouped_quant_matmul", _grouped_quant_matmul,
                          lambda x, weight, weight_scale, tokens_per_expert, group_size:
                          x.new_empty(x.shape[0], weight.shape[1]))
