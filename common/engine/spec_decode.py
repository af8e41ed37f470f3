"""MTP speculative decoding: drafts from the model's multi-token-prediction blocks, verified by the main model.

A decode step of a request with drafts d_1..d_k runs its last token and the drafts through the main model in one
forward (positions t..t+k, causal, as a prefill chunk), and the rows give the target tokens y_0..y_k; drafts are
accepted while d_{i+1} == y_i, and the accepted ones plus one more target token (y_a) are committed: greedy output
is exactly what one token per step gives. Rejected drafts leave their KV (window, compressor state, compressed
entries) in the cache at positions past the committed ones; nothing reads a position before a later step has
rewritten it (every read is causal, by position; an entry is rewritten whenever its last position is computed
again), and the prefix cache registers blocks of committed tokens only (`ScheduledRequest.num_computed_after`).

Drafts (this module): after the step, the MTP block runs over every position the step committed, fed the main
model's residual streams there and the embedding of the token that follows (so its own sliding-window KV covers
the sequence); its last row proposes d'_1 for the token after the committed ones, and k - 1 more MTP steps, each
fed the previous MTP streams and draft, chain d'_2..d'_k (their KV at lookahead positions the scheduler
allocated, rewritten once committed). Drafts are the MTP's argmax (a one-hot draft distribution): greedy requests
accept a draft when it is the row's argmax; sampled requests by the speculative-sampling rule (Sampler.verify),
which keeps every committed token distributed as plain sampling would. Over ranks: TP peers draft alike
(the same logits), data-parallel ranks run the same number of MTP forwards (`lockstep`).
"""
from __future__ import annotations

import torch

from .forward_batch import ForwardBatch
from .model_contract import MTPDraftModel
from .scheduler import ScheduledRequest


class MTPProposer:
    def __init__(self, mtp: MTPDraftModel, groups: list[str], device: torch.device, num_speculative_tokens: int,
                 block_size: int, max_model_len: int, lockstep: bool = False, state_groups: tuple[str, ...] = ()):
        """mtp: the model's MTP halves and layers (its ModelContract.mtp); groups: its cache groups, state_groups
        those of kind "state" (an MTP layer of a hybrid model reads none: its batches carry their null tables).
        lockstep: data-parallel ranks whose MTP forwards meet in collectives (expert dispatch, vocabulary-
        parallel embedding and head): every call then runs exactly k MTP forwards, empty where a rank has nothing
        to draft, as an idle rank's main forward does."""
        self.mtp, self.k, self.lockstep = mtp, num_speculative_tokens, lockstep
        self.block_size, self.max_model_len = block_size, max_model_len
        self.groups, self.device, self.state_groups = groups, device, state_groups

    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledRequest], streams: torch.Tensor | None, offsets: list[int],
                block_tables: list[dict[str, list[int]]]) -> dict[str, list[int]]:
        """After a step is committed: request id -> its next drafts, for the requests that sampled.
        streams [T, n, D]: the step's main-model residual streams; offsets[i]: scheduled[i]'s first row.
        An idle data-parallel rank calls it with nothing (scheduled [], streams None)."""
        mtp = self.mtp
        picked = [i for i, s in enumerate(scheduled) if not s.request.finished]
        if not picked and not self.lockstep:
            return {}
        starts = [scheduled[i].start for i in picked]
        counts = [scheduled[i].num_computed_after - scheduled[i].start for i in picked]  # committed this step
        nexts = [scheduled[i].request.all_token_ids[st + 1: st + n + 1] for i, st, n in zip(picked, starts, counts)]
        tables = [block_tables[i] for i in picked]
        if picked:
            rows = torch.cat([torch.arange(offsets[i], offsets[i] + n) for i, n in zip(picked, counts)])
            x = streams[rows.to(streams.device)]  # [T', n, D]
        batch = self._batch(nexts, starts, tables)
        if not picked:
            x = mtp.empty_streams()  # [0, n, D]
        x = mtp.draft_streams(0, x, batch.input_ids, batch)  # [T', n, D]
        drafting = [j for j, i in enumerate(picked) if scheduled[i].sample]
        if not drafting and not self.lockstep:  # prefill chunks only: their MTP KV is written, nothing to propose
            return {}
        last = batch.cu_seqlens_q[1:].long() - 1  # [B']
        x, positions = x[last[drafting]], [starts[j] + counts[j] for j in drafting]  # streams, next position
        drafts = {j: [] for j in drafting}
        token = mtp.draft_logits(0, x).argmax(-1)  # [B'']
        for step in range(self.k):
            for j, t in zip(drafting, token.tolist()):
                drafts[j].append(t)
            live = [n for n, p in enumerate(positions) if p < self.max_model_len]  # where the chain may write
            if step == self.k - 1 or not (live or self.lockstep):
                break
            layer = (step + 1) % mtp.num_draft_layers
            drafting, x, token = [drafting[n] for n in live], x[live], token[live]
            positions = [positions[n] for n in live]
            batch = self._batch([[t] for t in token.tolist()], positions, [tables[j] for j in drafting])
            x = mtp.draft_streams(layer, x, batch.input_ids, batch)  # [B'', n, D]
            token = mtp.draft_logits(layer, x).argmax(-1)  # [B'']
            positions = [p + 1 for p in positions]
        return {scheduled[picked[j]].request.request_id: d for j, d in drafts.items()}

    def _batch(self, tokens: list[list[int]], starts: list[int], tables) -> ForwardBatch:
        if not tokens:
            return ForwardBatch.empty(self.groups, self.block_size, self.device, self.state_groups)
        tables = [{g: [0] * len(t[g]) if g in self.state_groups else t[g] for g in t} for t in tables]  # no writes
        return ForwardBatch.build(tokens, starts, tables, self.block_size, self.device,
                                  state_groups=self.state_groups)
