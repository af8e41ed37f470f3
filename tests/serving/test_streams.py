"""TextStream: deltas that concatenate to the engine's text, hold-backs, and the reasoning split at `</think>`."""
from common.engine import RequestOutput
from common.engine.detokenizer import IncrementalDetokenizer
from common.serving.streams import TextStream


def output(ids, tokenizer, finished=False, text=None):
    """What the engine hands out after ids: its incremental text (complete characters), or the final text."""
    if text is None:
        detokenizer = IncrementalDetokenizer(tokenizer)
        detokenizer.update(ids)
        text = detokenizer.text
    return RequestOutput("r", None, [1], text, ids, finished, "stop" if finished else None)


def test_reasoning_then_content_split_at_the_end_think_token(model_and_tokenizer):
    tokenizer = model_and_tokenizer[1]
    end = tokenizer.convert_tokens_to_ids("</think>")
    thought, answer = tokenizer("let me see", add_special_tokens=False).input_ids, \
        tokenizer(" it is 4", add_special_tokens=False).input_ids
    ids = thought + [end] + answer
    stream = TextStream(tokenizer, [], end)
    deltas = [stream.update(output(ids[:k], tokenizer)) for k in range(1, len(ids))]
    deltas.append(stream.update(output(ids, tokenizer, finished=True)))
    assert "".join(r for r, _ in deltas) == "let me see" and "".join(c for _, c in deltas) == " it is 4"


def test_stop_hold_back_and_incomplete_characters(model_and_tokenizer):
    tokenizer = model_and_tokenizer[1]
    ids = tokenizer("héllo wörld", add_special_tokens=False).input_ids
    stream = TextStream(tokenizer, ["wörld"])
    sent = ""
    for k in range(1, len(ids)):
        _, delta = stream.update(output(ids[:k], tokenizer))
        sent += delta
        assert "\ufffd" not in sent and "wörld" not in sent
    sent += stream.update(output(ids, tokenizer, finished=True, text="héllo "))[1]
    assert sent == "héllo "


def stream_text(engine, prompt, params, stop=()):
    """Run one request through the engine as the server does: (concatenated deltas, final output)."""
    engine.add_request(prompt, params, "long")
    stream, sent, final = TextStream(engine.tokenizer, list(stop)), "", None
    while engine.has_unfinished():
        for out in engine.step():
            sent += stream.update(out)[1]
            final = out
    return sent, final


def test_a_long_streamed_output_equals_the_decode_of_all_its_tokens(model_and_tokenizer):
    from common.engine import EngineConfig, LLMEngine, SamplingParams
    model, tokenizer = model_and_tokenizer
    engine = LLMEngine(model, tokenizer, EngineConfig(max_model_len=1024))
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=400, ignore_eos=True)  # random ids: split UTF-8
    sent, final = stream_text(engine, [5, 6, 7], params)
    full = tokenizer.decode(final.token_ids, skip_special_tokens=True)
    assert len(final.token_ids) == 400 and sent == final.text == full.removesuffix("\ufffd")
    assert any("\ufffd" in tokenizer.decode([t]) for t in final.token_ids)  # some tokens are parts of a character
    # a stop string from the middle, split across tokens: the text ends right before it, streamed or not
    start = len(full) // 2
    stop = full[start: start + 4]
    sent, final = stream_text(engine, [5, 6, 7], SamplingParams(temperature=1.0, seed=3, max_tokens=400,
                                                                ignore_eos=True, stop=[stop]), [stop])
    assert final.finish_reason == "stop" and sent == final.text == full[: full.index(stop)]
    assert engine.kv_cache.all_blocks_free()
