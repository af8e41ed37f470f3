"""A test's MTP proposer: the real proposer's forwards (its KV writes included), its drafts replaced by a reference
run's tokens, the last draft of every third call corrupted, so that verification accepts 0..k drafts."""
from common.engine.spec_decode import MTPProposer


class OracleProposer(MTPProposer):
    def __init__(self, base: MTPProposer, reference: dict[tuple[int, ...], list[int]], vocab_size: int):
        """reference: prompt ids -> the plain run's output tokens."""
        super().__init__(base.mtp, base.groups, base.device, base.k, base.block_size, base.max_model_len)
        self.reference, self.vocab, self.calls = reference, vocab_size, 0

    def propose(self, scheduled, streams, offsets, block_tables):
        real = super().propose(scheduled, streams, offsets, block_tables)
        out = {}
        for s in scheduled:
            req = s.request
            if req.request_id in real:
                self.calls += 1
                n = len(req.output_token_ids)
                drafts = self.reference[tuple(req.prompt_token_ids)][n: n + len(real[req.request_id])]
                if drafts and self.calls % 3 == 0:
                    drafts[-1] = (drafts[-1] + 1) % self.vocab
                out[req.request_id] = drafts
        return out
