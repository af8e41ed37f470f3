"""Token masks that keep a grammar-constrained output well-formed UTF-8.

xgrammar reads a token's bytes as UTF-8, but (0.2.9) takes an encoded surrogate (ED A0..BF xx: U+D800..DFFF, which
RFC 3629 forbids in UTF-8) as one character: under {"type": "string", "maxLength": 8} it lets a sample write
'trueab' + ED A0 80 + 'ሙ', eight characters to the matcher, which every decoder reads as ten (a U+FFFD per byte of
the surrogate), so the text fails the schema. The structured-output manager ANDs each constrained row's grammar
bitmask with the mask of the tokens whose bytes continue the output well-formed (Unicode Table 3-7).

What may come next depends only on a Utf8State: how many continuation bytes the output's last character still
needs, and the range of the first of them (E0: A0..BF, ED: 80..9F, F0: 90..BF, F4: 80..8F, otherwise 80..BF). There
are eight states; a state's mask is built at its first use (one pass over the vocabulary's bytes).
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Utf8State(NamedTuple):
    need: int = 0  # continuation bytes the last character still needs (0: it is complete)
    lo: int = 0x80  # the range of the next one
    hi: int = 0xBF


COMPLETE = Utf8State()
_CONT = (0x80, 0xBF)
# a lead byte: the continuation bytes it needs and the range of the first (Unicode Table 3-7)
_LEADS = {**{b: Utf8State(1, *_CONT) for b in range(0xC2, 0xE0)},
          0xE0: Utf8State(2, 0xA0, 0xBF),
          **{b: Utf8State(2, *_CONT) for b in [*range(0xE1, 0xED), 0xEE, 0xEF]},
          0xED: Utf8State(2, 0x80, 0x9F),
          0xF0: Utf8State(3, 0x90, 0xBF),
          **{b: Utf8State(3, *_CONT) for b in range(0xF1, 0xF4)},
          0xF4: Utf8State(3, 0x80, 0x8F)}


def advance(state: Utf8State, data: bytes) -> Utf8State | None:
    """The state after data; None when data does not continue well-formed UTF-8 from state."""
    for b in data:
        if state.need:
            if not state.lo <= b <= state.hi:
                return None
            state = Utf8State(state.need - 1, *_CONT)
        elif b >= 0x80:
            state = _LEADS.get(b)
            if state is None:  # a continuation byte with no character open, C0 / C1 (overlong), F5..FF
                return None
    return state


class Utf8Masks:
    def __init__(self, token_bytes: list[bytes], vocab_size: int):
        """token_bytes[i]: token i's bytes (xgrammar's TokenizerInfo.decoded_vocab); rows past it have none."""
        self.token_bytes, self.vocab_size = token_bytes, vocab_size
        self._masks: dict[Utf8State, torch.Tensor] = {}

    def after(self, state: Utf8State, token: int) -> Utf8State | None:
        """The state after a token; None when its bytes do not continue from state (the mask forbids it)."""
        return advance(state, self.token_bytes[token] if token < len(self.token_bytes) else b"")

    def mask(self, state: Utf8State) -> torch.Tensor:
        """int32 [ceil(V / 32)] in xgrammar's bitmask layout (bit 1: the token's bytes continue from state)."""
        if state not in self._masks:
            ok = [advance(state, b) is not None for b in self.token_bytes]
            ok += [True] * (self.vocab_size - len(ok))  # rows with no bytes: the grammar's mask decides
            self._masks[state] = pack_bitmask(torch.tensor(ok, dtype=torch.bool))
        return self._masks[state]


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """bool [V] -> int32 [ceil(V / 32)]: bit j of word w is token 32 w + j."""
    words = -(-allowed.numel() // 32)
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[:allowed.numel()] = allowed.to(torch.int64)
    packed = (bits.view(words, 32) << torch.arange(32)).sum(1)  # [words] int64 in [0, 2^32)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
