"""Block-quantized weight formats of published checkpoints: FP8 with 128x128 block scales, MXFP4 routed experts.

FP8 block: weight float8_e4m3fn [N, K], scale [ceil(N/128), ceil(K/128)] (fp32, bf16 or e8m0); w = fp8 * scale of its block.
MXFP4: int8 [N, K/2], two e2m1 codes per byte, low nibble first (sign bit 3, bits 0-2 index E2M1 magnitudes);
scale [N, K/32], one power of two per 32 consecutive inputs; w = fp4 * scale.
"""
import torch
import torch.nn.functional as F

from common.ops.reference.quant import pack_int4, unpack_int4  # the layout the int4 expert matmuls read

FP8_BLOCK = 128
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
MX_GROUP = 32
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5])
MX_SCALE_DTYPE = getattr(torch, "float8_e8m0fnu", torch.float32)
QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int8, torch.uint8)


def is_quantized(w: torch.Tensor) -> bool:
    return w.dtype in QUANTIZED_DTYPES


def dequantize(w: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """FP8 block or MXFP4, told apart by the weight's dtype and the scale's shape."""
    if w.dtype == torch.float8_e4m3fn:
        return dequant_fp8_block(w, scale, dtype)
    if w.dtype in (torch.int8, torch.uint8) and scale.shape[-1] * MX_GROUP == w.shape[-1] * 2:
        return dequant_mxfp4(w, scale, dtype)
    raise ValueError(f"no dequantization for a {w.dtype} {list(w.shape)} weight with a {list(scale.shape)} scale")


def dequant_fp8_block(w: torch.Tensor, scale: torch.Tensor, dtype=torch.float32, block: int = FP8_BLOCK,
                      offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """offset: where w[0, 0] lies in the block of scale[0, 0] (a slice of a larger weight, with its covering blocks)."""
    n, k = w.shape
    r0, c0 = offset
    nb, kb = -(-(r0 + n) // block), -(-(c0 + k) // block)
    if scale.shape != (nb, kb):
        raise ValueError(f"fp8 weight {[n, k]} needs a [{nb}, {kb}] block scale, got {list(scale.shape)}")
    out = w.float()                                                          # [N, K]
    cols = scale.float().repeat_interleave(block, dim=1)[:, c0:c0 + k]       # [Nb, K]
    for i in range(nb):                                                      # rows [128i - r0, 128(i+1) - r0)
        out[max(0, i * block - r0):(i + 1) * block - r0].mul_(cols[i])
    return out.to(dtype)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32, offset: int = 0) -> torch.Tensor:
    """offset: where packed[..., 0]'s first value lies in the group of scale[..., 0] (a slice of a larger weight)."""
    u = packed.view(torch.uint8)                                     # [..., K/2]
    codes = torch.stack([u & 0xF, u >> 4], dim=-1).flatten(-2)       # [..., K] low nibble first
    k = codes.shape[-1]
    need = [*codes.shape[:-1], -(-(offset + k) // MX_GROUP)]
    if list(scale.shape) != need:
        raise ValueError(f"mxfp4 weight {list(codes.shape)} needs a {need} scale, got {list(scale.shape)}")
    w = E2M1[codes.int()]                                            # [..., K]
    if offset or k % MX_GROUP:                                       # pad to whole groups, trimmed below
        w = F.pad(w, (offset, -(offset + k) % MX_GROUP))
    w = (w.unflatten(-1, (-1, MX_GROUP)) * scale.float().unsqueeze(-1)).flatten(-2)   # [..., K/32 * 32]
    return w[..., offset:offset + k].to(dtype)                       # [..., K]


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (float8_e4m3fn [N, K], fp32 scale [ceil(N/128), ceil(K/128)]), amax of a block maps to 448."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = F.pad(w.float().abs(), (0, kb * block - k, 0, nb * block - n))             # [Nb*128, Kb*128]
    amax = padded.view(nb, block, kb, block).amax(dim=(1, 3))                           # [Nb, Kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, 1.0)
    full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]     # [N, K]
    return (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> (int8 [..., K/2], power-of-two scale [..., K/32] as e8m0); nearest e2m1, ties to even."""
    if w.shape[-1] % MX_GROUP:
        raise ValueError(f"mxfp4 needs the last dim to be a multiple of {MX_GROUP}, got {list(w.shape)}")
    x = w.float().unflatten(-1, (-1, MX_GROUP))                                         # [..., K/32, 32]
    amax = x.abs().amax(-1, keepdim=True)                                               # [..., K/32, 1]
    scale = torch.where(amax > 0, torch.exp2(torch.log2(amax / 6).ceil().clamp(-127, 127)), 1.0)
    x = (x / scale).flatten(-2)                                                         # [..., K] within +-6
    lo = torch.bucketize(x.abs(), E2M1_MIDPOINTS)
    hi = torch.bucketize(x.abs(), E2M1_MIDPOINTS, right=True)                           # differs from lo on ties
    codes = (torch.where(lo % 2 == 0, lo, hi) | x.signbit().long() << 3).to(torch.uint8)   # [..., K]
    packed = codes[..., 0::2] | codes[..., 1::2] << 4                                   # [..., K/2]
    return packed.view(torch.int8), scale.squeeze(-1).to(MX_SCALE_DTYPE)


# Integer weights of the W8A8 / W4A8 checkpoints recipes/deepseek/tools/convert_checkpoint.py writes; symmetric,
# w = q * scale.
# int8 per channel: int8 [..., N, K], fp32 scale [..., N] (amax over K / 127).
# int4 per group: int8 [..., N, K/2], two int4 (-8..7) per byte along K, low nibble first; fp32 scale [..., N, K/G]
# (amax over the group / 7, so the quantizer writes -7..7; -8 is valid storage).
INT8_MAX, INT4_MIN, INT4_MAX = 127, -8, 7


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (int8 [..., N, K], fp32 scale [..., N]); an all-zero row gets scale 1."""
    x = w.float()
    amax = x.abs().amax(-1)                                                             # [..., N]
    scale = torch.where(amax > 0, amax / INT8_MAX, 1.0)
    q = torch.round(x / scale.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)  # [..., N, K]
    return q, scale


def quantize_int4_per_group(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> (packed int8 [..., K/2], fp32 scale [..., K/group_size]); group_size must divide K, K even."""
    k = w.shape[-1]
    if group_size < 1 or k % group_size or k % 2:
        raise ValueError(f"int4 groups of {group_size} do not split K = {k} (the group size must divide an even K)")
    x = w.float().unflatten(-1, (-1, group_size))                                       # [..., K/G, G]
    amax = x.abs().amax(-1)                                                             # [..., K/G]
    scale = torch.where(amax > 0, amax / INT4_MAX, 1.0)
    q = torch.round(x / scale.unsqueeze(-1)).clamp(INT4_MIN, INT4_MAX).to(torch.int8)  # [..., K/G, G]
    return pack_int4(q.flatten(-2)), scale


def dequantize_int(weight: torch.Tensor, scale: torch.Tensor, group_size: int | None = None,
                   dtype=torch.float32) -> torch.Tensor:
    """group_size None: int8 per channel (scale [..., N]); else packed int4 per group (scale [..., N, K/G]).
    Returns the float weight [..., N, K]."""
    if weight.dtype != torch.int8:
        raise ValueError(f"integer weight must be int8 storage, got {weight.dtype}")
    if group_size is None:
        if scale.shape != weight.shape[:-1]:
            raise ValueError(f"int8 weight {list(weight.shape)} needs a per-channel scale "
                             f"{list(weight.shape[:-1])}, got {list(scale.shape)}")
        return (weight.float() * scale.float().unsqueeze(-1)).to(dtype)
    q = unpack_int4(weight)                                                             # [..., K]
    k = q.shape[-1]
    need = [*q.shape[:-1], k // group_size] if group_size > 0 and k % group_size == 0 else None
    if need is None or list(scale.shape) != need:
        raise ValueError(f"int4 weight {list(q.shape)} (packed {list(weight.shape)}) in groups of {group_size} "
                         f"needs a {need} scale, got {list(scale.shape)}")
    w = q.float().unflatten(-1, (-1, group_size)) * scale.float().unsqueeze(-1)          # [..., K/G, G]
    return w.flatten(-2).to(dtype)
