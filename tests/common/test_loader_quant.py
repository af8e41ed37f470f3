"""Dequantization against references written here from the format definitions (bit fields decoded by hand)."""
import pytest
import torch

from common.loader import dequant_fp8_block, dequant_mxfp4, quantize_fp8_block, quantize_mxfp4


def e4m3fn_value(byte: int) -> float:
    """float8_e4m3fn: sign bit 7, exponent bits 6-3 (bias 7), mantissa bits 2-0; S.1111.111 is NaN, no infinities."""
    sign, exp, man = byte >> 7, (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return float("nan")
    value = man / 8 * 2.0 ** -6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
    return -value if sign else value


def e2m1_value(code: int) -> float:
    """e2m1: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is subnormal (0 or 0.5)."""
    sign, exp, man = code >> 3, (code >> 1) & 0x3, code & 0x1
    value = man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1)
    return -value if sign else value


def e8m0_value(byte: int) -> float:
    return 2.0 ** (byte - 127)


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return torch.tensor([e8m0_value(b) for b in scale.view(torch.uint8).flatten().tolist()]).view(scale.shape)
    return scale.float()


def ref_dequant_fp8_block(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor([e4m3fn_value(b) for b in range(256)])
    out = lut[w.view(torch.uint8).long()]
    s = scale_values(scale)
    n, k = w.shape
    for bi in range(0, n, 128):
        for bj in range(0, k, 128):
            out[bi:bi + 128, bj:bj + 128] *= s[bi // 128, bj // 128]
    return out


def ref_dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale_values(scale).tolist()
    rows = []
    for i, row in enumerate(packed.view(torch.uint8).tolist()):
        values = []
        for byte in row:
            values += [e2m1_value(byte & 0xF), e2m1_value(byte >> 4)]  # element 2j = low nibble of byte j
        rows.append([v * s[i][j // 32] for j, v in enumerate(values)])
    return torch.tensor(rows)


def random_fp8(n: int, k: int, gen) -> torch.Tensor:
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # NaN codes -> 1.0
    return codes.view(torch.float8_e4m3fn)


SCALE_DTYPES = [torch.float32, torch.bfloat16] + ([torch.float8_e8m0fnu] if hasattr(torch, "float8_e8m0fnu") else [])


def test_e2m1_magnitudes_match_the_published_table():
    assert [e2m1_value(c) for c in range(8)] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert [e2m1_value(c | 8) for c in range(8)] == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


@pytest.mark.parametrize("shape", [(128, 256), (200, 300), (1, 129), (257, 5)])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_fp8_block_matches_reference(shape, scale_dtype, dtype):
    gen = torch.Generator().manual_seed(0)
    w = random_fp8(*shape, gen)
    scale = torch.exp2(torch.randint(-8, 8, (-(-shape[0] // 128), -(-shape[1] // 128)), generator=gen).float())
    if scale_dtype in (torch.float32, torch.bfloat16):
        scale = scale * 1.375  # not a power of two
    scale = scale.to(scale_dtype)
    out = dequant_fp8_block(w, scale, dtype)
    assert out.dtype == dtype and out.shape == shape
    assert torch.equal(out, ref_dequant_fp8_block(w, scale).to(dtype))


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_mxfp4_matches_reference_for_every_code(scale_dtype, dtype):
    gen = torch.Generator().manual_seed(0)
    packed = torch.arange(256, dtype=torch.uint8)[torch.randperm(256, generator=gen)].view(4, 64).view(torch.int8)
    scale = torch.exp2(torch.randint(-6, 6, (4, 128 // 32), generator=gen).float()).to(scale_dtype)
    out = dequant_mxfp4(packed, scale, dtype)
    assert out.dtype == dtype and out.shape == (4, 128)
    assert torch.equal(out, ref_dequant_mxfp4(packed, scale).to(dtype))
    codes = set(packed.view(torch.uint8).flatten().bitwise_and(0xF).tolist())
    assert codes == set(range(16))


def test_dequant_rejects_wrong_scale_shapes():
    with pytest.raises(ValueError, match="block scale"):
        dequant_fp8_block(torch.zeros(200, 300).to(torch.float8_e4m3fn), torch.ones(1, 3))
    with pytest.raises(ValueError, match="scale"):
        dequant_mxfp4(torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 1))


@pytest.mark.parametrize("shape", [(128, 128), (200, 300), (3, 700)])
def test_fp8_round_trip_within_e4m3_error(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.05
    w[:64, :64] *= 1000  # blocks with very different ranges
    q, scale = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    s = scale.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    err = (dequant_fp8_block(q, scale) - w).abs()
    assert (err <= w.abs() * 2**-4 + s * 2**-10).all()  # 3 mantissa bits; half the subnormal step
    assert (q.float().abs().amax() == 448).item()  # a block's amax maps to the top of the range


def test_mxfp4_round_trip_is_nearest_e2m1_with_minimal_power_of_two_scale():
    w = torch.randn(6, 128, generator=torch.Generator().manual_seed(2))
    w[0, :32] = 0  # an all-zero group
    packed, scale = quantize_mxfp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (6, 64) and scale.shape == (6, 4)
    s = scale_values(scale)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two
    amax = w.abs().unflatten(-1, (4, 32)).amax(-1)
    assert ((amax / s <= 6) & ((amax / s > 3) | (amax == 0))).all()
    x = (w.unflatten(-1, (4, 32)) / s[..., None]).flatten(-2)  # [6, 128] in units of the scale
    q = (dequant_mxfp4(packed, scale).unflatten(-1, (4, 32)) / s[..., None]).flatten(-2)
    grid = torch.tensor([e2m1_value(c) for c in range(16)])
    nearest = (x[..., None] - grid).abs().amin(-1)
    assert torch.allclose((x - q).abs(), nearest)


def test_mxfp4_exact_values_round_trip_exactly_and_pack_low_nibble_first():
    grid = torch.tensor([e2m1_value(c) for c in range(16)])
    w = (grid.repeat(2) * 0.25).view(1, 32)  # amax 6 * 0.25 -> scale 0.25
    packed, scale = quantize_mxfp4(w)
    assert torch.equal(dequant_mxfp4(packed, scale), w)
    assert packed.view(torch.uint8)[0, :8].tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]


def test_mxfp4_rounds_ties_to_even():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75])
    w = torch.cat([ties, torch.full((24,), 6.0)]).view(1, 32)  # amax 6 -> scale 1
    packed, scale = quantize_mxfp4(w)
    assert dequant_mxfp4(packed, scale)[0, :8].tolist() == [0, 1, 1, 2, 2, 4, 4, -1]
