"""A test's MTP proposer: the real proposer's forwards (its KV writes included), its drafts replaced by a reference
run's tokens, the last draft of every third call corrupted, so that verification accepts 0..k drafts; and the
checks the MTP tests of every model family share."""
from common.engine.spec_decode import MTPProposer


class OracleProposer(MTPProposer):
    def __init__(self, base: MTPProposer, reference: dict[tuple[int, ...], list[int]], vocab_size: int):
        """reference: prompt ids -> the plain run's output tokens."""
        super().__init__(base.mtp, base.groups, base.device, base.k, base.block_size, base.max_model_len,
                         state_groups=base.state_groups)
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


def check_equal(outs, plain):
    """Greedy tokens equal, and every step's log-prob within 1e-4."""
    for got, want in zip(outs, plain, strict=True):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4


def check_graph_verify_steps(llm, prompts, plain, greedy, bucket: int):
    """An MTP engine in graph mode (`bucket` its one capture size) against plain decoding (`plain`: the outputs of
    `greedy`, greedy sampling params with log-probs, over `prompts`): with its own drafts over
    every prompt, then with the oracle's (accepted: one request padded to the bucket), the verify steps replayed as
    graphs and the pools full after."""
    graphs = llm.engine.runner.graphs
    assert graphs.query_len == 1 + llm.engine.proposer.k
    check_equal(llm.generate(prompts, greedy, use_tqdm=False), plain)
    reference = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    llm.engine.proposer = OracleProposer(llm.engine.proposer, reference, llm.engine.contract.vocab_size)
    before = graphs.replays[bucket]
    check_equal(llm.generate(prompts[:1], greedy, use_tqdm=False), plain[:1])
    assert 0 < before < graphs.replays[bucket]
    assert llm.engine.stats.num_accepted_tokens > 0 and llm.engine.kv_cache.all_blocks_free()
