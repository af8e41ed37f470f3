"""The state cache kind (CacheGroupSpec kind "state": a per-request recurrent state beside paged blocks): the block
manager's slot bookkeeping (fresh, in place, checkpoints at block boundaries, hits, eviction, waiting, freeing) and
the engine running a hybrid toy model (state_toy_model.py: paged attention + a recurrent layer) to the tokens a
full-recompute loop gives, through chunked prefill, prefix-cache hits on saved states, preemption and failed steps,
with no slot or block left held."""
import pytest
import torch

from common.engine import LLM, EngineConfig, SamplingParams
from common.engine.model_runner import blocks_that_fit, prefill_logits
from common.kv_cache import NULL_BLOCK, CacheGroupSpec, CacheTensorSpec, KVCacheManager, check_cache_specs
from contract_toy_model import GROUP, greedy_full_recompute
from state_toy_model import STATE, ToyStateLM
from test_contract_model import prompts, tokenizer

BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def manager(slots: int = 8, blocks: int = 32, prefix: bool = True) -> KVCacheManager:
    return KVCacheManager([CacheGroupSpec(GROUP, BS), CacheGroupSpec(STATE, BS, kind="state")],
                          {GROUP: blocks, STATE: slots}, prefix)


def step(kv: KVCacheManager, rid: str, ids: list[int], start: int, n: int, cached: int = 0) -> list[int]:
    """Allocate a step of n tokens from start, return its (read, write) slots, then mark it run."""
    assert kv.allocate(rid, ids, start, n, cached)
    read_write = kv.block_table(rid)[STATE]
    kv.cache_blocks(rid, ids, start + n)
    return read_write


def test_a_request_holds_one_slot_written_in_place_until_a_checkpoint():
    kv, ids = manager(prefix=False), list(range(30))
    read, write = step(kv, "a", ids, 0, 6)
    assert read == NULL_BLOCK and write != NULL_BLOCK  # a fresh sequence: zero state in, one slot out
    assert step(kv, "a", ids, 6, 1) == [write, write]  # decode: in place
    assert step(kv, "a", ids, 7, 1) == [write, write]  # no prefix caching: a boundary changes nothing
    assert kv.num_free_blocks(STATE) == 8 - 2
    kv.free("a")
    assert kv.all_blocks_free()


def test_checkpoints_at_block_boundaries_are_hit_by_a_later_request():
    kv, ids = manager(), prompts(0, (11,))[0]
    assert kv.align_chunk(0, 11, 11) == 8  # the prompt's last whole block ends a chunk: its state is kept
    _, first = step(kv, "a", ids, 0, 8)
    read, write = step(kv, "a", ids, 8, 3)
    assert read == first and write != first  # the checkpoint is never written again
    kv.free("a")
    other = ids[:8] + [1, 2, 3, 4, 5]
    assert kv.get_computed_tokens("b", other) == 8
    assert kv.allocate("b", other, 8, 5, 8)
    read, write = kv.block_table("b")[STATE]
    assert read == first and write not in (NULL_BLOCK, first)
    assert kv.stats.prefix_cache_hits == 8
    kv.free("b")
    assert kv.all_blocks_free()
    assert kv.get_computed_tokens("c", ids[:4] + [9] * 8) == 0  # paged blocks cached at 4, but no state there


def test_align_chunk_cuts_prefill_at_block_boundaries():
    kv = manager()
    assert [kv.align_chunk(0, n, 30) for n in (3, 4, 6, 9, 30)] == [3, 4, 4, 8, 28]
    assert kv.align_chunk(8, 7, 30) == 4 and kv.align_chunk(28, 2, 30) == 2 and kv.align_chunk(29, 1, 30) == 1
    assert manager(prefix=False).align_chunk(0, 9, 30) == 9


def test_a_request_without_a_slot_waits_and_nothing_changes():
    kv, ids = manager(slots=2), list(range(9))  # one usable slot
    step(kv, "a", ids, 0, 3)
    free = (kv.num_free_blocks(GROUP), kv.num_free_blocks(STATE))
    assert not kv.allocate("b", ids, 0, 3)
    assert (kv.num_free_blocks(GROUP), kv.num_free_blocks(STATE)) == free and kv.num_requests == 1


def test_a_step_that_never_ran_frees_both_its_slots():
    kv, ids = manager(), list(range(20))
    step(kv, "a", ids, 0, 8)  # ends on a boundary: a checkpoint, so the next step writes a fresh slot
    assert kv.allocate("a", ids, 8, 4)
    read, write = kv.block_table("a")[STATE]
    assert read != write and kv.num_free_blocks(STATE) == 8 - 1 - 2
    kv.free("a")  # a failed step, an abort or a preemption before the step ran
    assert kv.all_blocks_free()


def test_saved_states_are_evicted_like_blocks():
    kv = manager(slots=3)  # two usable slots
    a, b = prompts(1, (9, 9))
    step(kv, "a", a, 0, 8)
    step(kv, "a", a, 8, 1)
    kv.free("a")  # its checkpoint at 8 stays findable in the free queue
    assert kv.get_computed_tokens("x", a + [7]) == 8
    step(kv, "b", b, 0, 8)
    step(kv, "b", b, 8, 1)  # needs the second usable slot: takes a's checkpoint's
    kv.free("b")
    assert kv.get_computed_tokens("x", a + [7]) == 0 and kv.get_computed_tokens("x", b + [7]) == 8


def test_specs_and_sizing_of_state_groups():
    model = ToyStateLM()
    with pytest.raises(ValueError, match="sets rows"):
        check_cache_specs(model.cache_specs(BS), [CacheTensorSpec("x", STATE, 4)])
    with pytest.raises(ValueError, match="does not declare"):
        check_cache_specs(model.cache_specs(BS), [CacheTensorSpec("x", "nope", 4)])
    config = EngineConfig(block_size=BS, max_num_seqs=3, kv_cache_memory_bytes=1 << 16, max_model_len=64)
    assert blocks_that_fit(model, config)[STATE] == 3 * 3 + 1  # running, fresh after a checkpoint, saved
    config = EngineConfig(block_size=BS, max_num_seqs=3, kv_cache_memory_bytes=1 << 16, max_model_len=64,
                          enable_prefix_caching=False)
    assert blocks_that_fit(model, config) == {STATE: 3 + 1, GROUP: 3 * 64 // BS + 1}  # capped at max_num_seqs


def test_prefill_logits_of_a_state_model_equal_a_full_recompute():
    model = ToyStateLM().eval()
    ps = prompts(2, (7, 13, 1))
    torch.testing.assert_close(prefill_logits(model, ps, block_size=BS),
                               torch.cat([model.full_logits(p) for p in ps]), atol=1e-4, rtol=1e-4)  # fp32,
    #   packed vs one sequence: the GEMMs' reduction order differs by CPU kind (AVX2: 1.2e-5)
    assert model.state.dtype == torch.float32 and model.state.shape[1:] == (1, 1, 32)


@pytest.mark.parametrize("prefix", [True, False])
def test_engine_runs_a_hybrid_model_as_a_full_recompute_loop(prefix):
    """Chunked prefill (6 tokens a step) carries the state across chunks; a second round of prompts extending the
    first ones' sequences hits their saved states; outputs equal a full recompute either way."""
    model = ToyStateLM().eval()
    llm = LLM(model, tokenizer(), block_size=BS, max_num_seqs=3, max_num_batched_tokens=6,
              enable_prefix_caching=prefix, kv_cache_memory_bytes=1 << 20)
    first = prompts(3, (13, 2, 19))
    outs = llm.generate(first, GREEDY, use_tqdm=False)
    second = [p + o.token_ids + [5, 6] for p, o in zip(first, outs)]
    outs += llm.generate(second, GREEDY, use_tqdm=False)
    for prompt, out in zip(first + second, outs):
        assert out.finish_reason == "length" and out.token_ids == greedy_full_recompute(model, prompt, 8)
    hits = [o.num_cached_tokens for o in outs[3:]]
    if prefix:  # a checkpoint every 4 tokens of decode: the last one the first round computed is hit (its last
        #   token was sampled, never computed)
        assert hits == [(len(p) + 8 - 1) // BS * BS for p in first]
    else:
        assert hits == [0, 0, 0]
    assert llm.engine.kv_cache.all_blocks_free()


def test_preemption_drops_the_state_and_recomputes():
    """Three slots for three long requests: the scheduler preempts, recomputes, and the outputs stay exact."""
    model = ToyStateLM().eval()
    llm = LLM(model, tokenizer(), block_size=BS, max_num_seqs=3, max_num_batched_tokens=16, num_blocks=12,
              kv_cache_memory_bytes=1 << 20)
    ps = prompts(4, (9, 10, 11))
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for p, o in zip(ps, outs):
        assert o.token_ids == greedy_full_recompute(model, p, 12)
    assert llm.engine.kv_cache.all_blocks_free()


def test_a_failed_step_frees_the_slots_of_its_requests():
    model = ToyStateLM().eval()
    llm = LLM(model, tokenizer(), block_size=BS, max_num_seqs=2, kv_cache_memory_bytes=1 << 20)
    decay = model.decay_logit
    model.decay_logit = None  # the recurrent layer fails: the step's requests end with an error
    outs = llm.generate(prompts(5, (6, 9)), GREEDY, use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["error", "error"] and llm.engine.kv_cache.all_blocks_free()
    model.decay_logit = decay
    p = prompts(6, (7,))[0]
    assert llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids == greedy_full_recompute(model, p, 8)


def test_a_verify_step_keeps_the_state_of_the_end_it_commits():
    """Speculative decoding: a step verifying 2 drafts writes the states after its 1, 2 and 3 tokens (the last in
    place); the end committed keeps its slot, the other two go back; a prefill chunk still writes one (the last
    column), and a step on a checkpoint writes only fresh slots."""
    kv = KVCacheManager([CacheGroupSpec(GROUP, BS), CacheGroupSpec(STATE, BS, kind="state")], {GROUP: 32, STATE: 8},
                        True, state_writes=3)
    ids = list(range(2, 30))
    assert kv.allocate("a", ids, 0, 6)
    read, *writes = kv.block_table("a")[STATE]
    assert read == NULL_BLOCK and writes[:2] == [NULL_BLOCK] * 2 and writes[2] != NULL_BLOCK
    kv.cache_blocks("a", ids, 6)
    slot = writes[2]
    for committed, keep in ((7, 0), (8, 1), (9, 2)):  # 0, 1 or 2 drafts accepted (step of 3 tokens from 6)
        assert kv.allocate("a", ids, 6, 3, ends=range(7, 10))
        read, *writes = kv.block_table("a")[STATE]
        assert read == slot and writes[2] == slot and len({*writes}) == 3  # in place for all accepted
        assert kv.num_free_blocks(STATE) == 8 - 1 - 3
        kv.cache_blocks("a", ids, committed)
        assert kv.block_table("a")[STATE] == [writes[keep], NULL_BLOCK, NULL_BLOCK, NULL_BLOCK]
        assert kv.num_free_blocks(STATE) == 8 - 1 - 1
        kv.free("a")
        assert kv.allocate("a", ids, 0, 6)
        kv.cache_blocks("a", ids, 6)
        slot = kv.block_table("a")[STATE][0]
    assert kv.allocate("a", ids, 6, 3, ends=range(7, 10))
    kv.cache_blocks("a", ids, 8)  # the state after 8 tokens: a checkpoint (block boundary)
    checkpoint = kv.block_table("a")[STATE][0]
    assert kv.allocate("a", ids, 8, 3, ends=range(9, 12))
    read, *writes = kv.block_table("a")[STATE]
    assert read == checkpoint and checkpoint not in writes and NULL_BLOCK not in writes  # never written again
    kv.free("a")
    assert kv.all_blocks_free()


def test_a_request_received_from_a_prefill_instance_gets_a_state_slot():
    """PD: allocate_external holds a slot per state group beside the prompt's blocks (the state the prefill
    instance sends lands there), all or nothing, freed with the request."""
    kv = manager(slots=2)
    assert kv.allocate_external("a", 9)
    slot, *writes = kv.block_table("a")[STATE]
    assert slot != NULL_BLOCK and writes == [NULL_BLOCK] and len(kv.block_table("a")[GROUP]) == 3
    assert not kv.allocate_external("b", 4)  # the one other usable slot is slot 0 of the pool of 2: none left
    assert kv.num_free_blocks(GROUP) == 31 - 3
    kv.free("a")
    assert kv.all_blocks_free()
