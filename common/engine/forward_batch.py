"""The inputs of one model forward, built explicitly by the model runner (no module-global state).

Packed, token-major: T = the new tokens of all B scheduled sequences, in order. Cache groups are named by
the model (see common.kv_cache.CacheGroupSpec); every group is a token-block table of `block_size` tokens.

`max_seqlen_q` / `max_seqlen_k` (flash-attn's names) are host ints known when the batch is built: the longest new
chunk and the longest kv length. Ops size their padded widths from them instead of reading tensors, so a step
has no host sync and, in a padded decode batch (graph mode: `pad_to`, `table_width`, `max_seqlen_k` fixed per
bucket), no shape that depends on the requests. Padding sequences have as many tokens as the longest real one
(a graph step's are uniform: 1, or 1 + the MTP drafts verified; ids 0, positions from 0) and an empty block table,
so their every slot is a row of the null block 0: they write nowhere a real sequence reads, and real rows never
see them.

State groups (CacheGroupSpec kind "state", named in `state_groups`): the group's block table is [B, 1 + W] int32,
each sequence's read slot of its per-request state, then W write slots: column 1 + i takes the state after the
sequence's token q_len - W + i (W = 1: the final state; W = 1 + num_speculative_tokens under speculative decoding,
a state per draft a verify step may accept; 0: not kept), and it has no slot mapping. Read slot 0 (the null slot)
means a zero initial state: a sequence's first step, and every padding sequence, which writes only slot 0.

Multimodal rows (ModelContract.encoder): `mm_embeds` [M, D] are written over the token embeddings of rows `mm_rows`
[M] before the first layer; a text-only batch has neither.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    seq_ids: torch.Tensor  # [T] int64, which of the B sequences each token belongs to
    cu_seqlens_q: torch.Tensor  # [B+1] int32, bounds of each sequence's new tokens
    seq_lens: torch.Tensor  # [B] int32, kv length of each sequence after this step
    block_size: int
    block_tables: dict[str, torch.Tensor]  # group -> [B, max_blocks] int32, null block 0 where absent (a state
    #   group: [B, 1 + W], the read slot and the write slots)
    slot_mapping: dict[str, torch.Tensor]  # paged group -> [T] int64, cache row of each new token
    max_seqlen_q: int = 0  # host: the longest sequence's new tokens (1: a decode batch)
    max_seqlen_k: int = 0  # host: the longest kv length (a padded decode batch: the bound it was built for)
    uniform_across_ranks: bool = False  # host: every rank forwards this batch's shape this step (graph mode pads
    #   all data-parallel ranks to one bucket), so collectives exchange no sizes and the expert dispatch no splits
    mm_rows: torch.Tensor | None = None  # [M] int64: rows whose token embedding the model replaces by mm_embeds
    mm_embeds: torch.Tensor | None = None  # [M, D]: the encoder's embeddings of those rows (images); None: text only

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @classmethod
    def build(cls, new_tokens: list[list[int]], num_computed: list[int], block_tables: list[dict[str, list[int]]],
              block_size: int, device=None, pad_to: int | None = None, table_width: int | None = None,
              max_seqlen_k: int | None = None, state_groups: tuple[str, ...] = ()) -> "ForwardBatch":
        """new_tokens[b]: the tokens computed this step for sequence b, which already has num_computed[b] in cache.
        state_groups: the groups whose block_tables[b] entry is [read slot, *write slots] (see the module
        docstring).
        pad_to: append padding sequences up to this many, a graph-mode bucket that every rank of the step pads to
        (so the batch is uniform_across_ranks); table_width: block-table columns (default: the widest table);
        max_seqlen_k: the kv-length bound ops pad to (default: the longest kv length)."""
        if pad_to is not None and pad_to > len(new_tokens):
            n, q = pad_to - len(new_tokens), max(map(len, new_tokens), default=1)  # as many tokens as the others
            first = block_tables[0] if block_tables else {}
            new_tokens, num_computed = [*new_tokens, *[[0] * q] * n], [*num_computed, *[0] * n]
            block_tables = [*block_tables, *[{g: [0] * len(t) if g in state_groups else [] for g, t in first.items()}]
                            * n]
        q_lens = [len(t) for t in new_tokens]
        kv_lens = [c + n for c, n in zip(num_computed, q_lens)]
        if table_width is not None and any(len(t[g]) > table_width for t in block_tables for g in t):
            raise ValueError(f"a block table is wider than table_width {table_width}")
        if max_seqlen_k is not None and max(kv_lens, default=0) > max_seqlen_k:
            raise ValueError(f"a sequence holds {max(kv_lens)} tokens, past max_seqlen_k {max_seqlen_k}")
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(num_computed, q_lens)])  # [T]
        seq_ids = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))  # [T]
        cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(q_lens).cumsum(0)
        tables, slots = {}, {}
        for group in block_tables[0] if block_tables else ():
            if group in state_groups:  # [B, 1 + W]; padding sequences read and write the null slot
                tables[group] = torch.tensor([t[group] for t in block_tables], dtype=torch.int32, device=device)
                continue
            rows = [t[group] for t in block_tables]
            table = torch.zeros(len(rows), table_width or max(map(len, rows), default=0) or 1, dtype=torch.int32)
            for b, row in enumerate(rows):
                table[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
            tables[group] = table.to(device)
            blocks = table[seq_ids, positions // block_size].long()  # [T]
            slots[group] = (blocks * block_size + positions % block_size).to(device)
        return cls(
            input_ids=torch.tensor([t for ts in new_tokens for t in ts], dtype=torch.long, device=device),
            positions=positions.to(device), seq_ids=seq_ids.to(device), cu_seqlens_q=cu.to(device),
            seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
            block_size=block_size, block_tables=tables, slot_mapping=slots, max_seqlen_q=max(q_lens, default=0),
            max_seqlen_k=max_seqlen_k if max_seqlen_k is not None else max(kv_lens, default=0),
            uniform_across_ranks=pad_to is not None,
        )

    def copy_(self, other: "ForwardBatch") -> "ForwardBatch":
        """Fill this batch's tensors in place from another built for the same bucket (graph replay reads fixed
        buffers); its host fields and every shape must be this one's. Returns self."""
        host = ("block_size", "max_seqlen_q", "max_seqlen_k", "uniform_across_ranks")
        pairs = [(getattr(self, f), getattr(other, f)) for f in ("input_ids", "positions", "seq_ids",
                                                                 "cu_seqlens_q", "seq_lens")]
        same = all(getattr(self, f) == getattr(other, f) for f in host)
        if same and self.block_tables.keys() == other.block_tables.keys() \
                and self.slot_mapping.keys() == other.slot_mapping.keys():
            pairs += [(self.block_tables[g], other.block_tables[g]) for g in self.block_tables]
            pairs += [(self.slot_mapping[g], other.slot_mapping[g]) for g in self.slot_mapping]
        else:
            same = False
        if not same or any(mine.shape != theirs.shape for mine, theirs in pairs):
            raise ValueError("copy_: the batches differ in a host field, a cache group or a shape (another bucket?)")
        for mine, theirs in pairs:
            mine.copy_(theirs)
        return self

    @classmethod
    def empty(cls, groups: list[str], block_size: int, device=None, state_groups: tuple[str, ...] = ()
              ) -> "ForwardBatch":
        """No tokens: what a data-parallel rank with nothing to run forwards, so that the collectives of the
        other ranks' step (expert dispatch, vocabulary-parallel gathers) meet it."""
        none = torch.zeros(0, dtype=torch.long, device=device)
        return cls(input_ids=none, positions=none, seq_ids=none,
                   cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=device),
                   seq_lens=torch.zeros(0, dtype=torch.int32, device=device), block_size=block_size,
                   block_tables={g: torch.zeros(0, 2 if g in state_groups else 1, dtype=torch.int32, device=device)
                                 for g in groups},
                   slot_mapping={g: none for g in groups if g not in state_groups})

    @classmethod
    def prefill(cls, prompts: list[list[int]], groups: list[str], block_size: int, device=None,
                state_groups: tuple[str, ...] = ()):
        """Whole prompts in one step over contiguous fresh blocks (block 0 stays null); a state group's prompt b
        starts from a zero state and writes slot b + 1. Returns (batch, blocks needed per group) for tests and
        one-shot forwards."""
        tables, next_block = [], 1
        for b, p in enumerate(prompts):
            n = -(-len(p) // block_size)
            tables.append({g: [0, b + 1] if g in state_groups else list(range(next_block, next_block + n))
                           for g in groups})
            next_block += n
        return cls.build(prompts, [0] * len(prompts), tables, block_size, device, state_groups=state_groups), \
            max(next_block, len(prompts) + 1)
