"""Structured output on a tiny byte-level BPE tokenizer: the params' checks and round trip, the refusals, and the
masks StructuredOutputManager puts on a step's rows (drafts, a rejected draft, the reasoning boundary)."""
import dataclasses
import json
import re

import pytest
import torch
from transformers import AutoTokenizer

from common.engine import SamplingParams, StructuredOutputManager, StructuredOutputsParams
from common.loader import write_tokenizer

EOS, END_THINK = 1, 2
V = 300  # lm-head rows: more than the tokenizer's ids (padding rows are never allowed)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = write_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=290,
                           special_tokens={"bos": "<s>", "eos": "</s>", "end_think": "</think>"}, chat_template="")
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def manager(tok):
    return StructuredOutputManager(tok, V, [EOS], max_threads=1)


def allowed(logits_row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(logits_row > float("-inf")).flatten().tolist())


def masks(manager, state, drafts, rows=None):
    logits = torch.zeros(rows or len(drafts) + 1, V)
    manager.apply(logits, [(state, 0, drafts)])
    return [allowed(r) for r in logits]


def encode(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def test_params_round_trip_through_json():
    so = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}},
                                 reasoning_end_token_id=END_THINK)
    params = SamplingParams(temperature=0.5, seed=3, skip_special_tokens=False, structured_outputs=so)
    rebuilt = SamplingParams(**json.loads(json.dumps(dataclasses.asdict(params))))
    assert rebuilt == params and isinstance(rebuilt.structured_outputs, StructuredOutputsParams)
    assert SamplingParams(**dataclasses.asdict(SamplingParams())).structured_outputs is None


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of .* got none"),
    ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"json": {"type": "object"}, "json_object": True}, "got json, json_object"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": 3}, "structured_outputs.json must be a dict or a JSON string"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": ["a", ""]}, "choice must be a non-empty list of non-empty strings"),
    ({"regex": 5}, "regex must be a string"),
    ({"json_object": "yes"}, "json_object must be a bool"),
    ({"regex": "a", "reasoning_end_token_id": -1}, "reasoning_end_token_id must be None or an int >= 0"),
])
def test_params_refusals(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_refuse_unknown_structured_fields():
    with pytest.raises(ValueError, match="unknown fields \\['guided_json'\\]"):
        SamplingParams(structured_outputs={"guided_json": {}})


@pytest.mark.parametrize("kwargs, message", [
    ({"json": {"type": "foo"}}, r'structured_outputs.json: Unsupported type "foo"'),
    ({"json": '{"$ref": "#/$defs/missing"}'}, "structured_outputs.json: .*missing"),
    ({"json": {"type": "array", "uniqueItems": True}}, "unsupported JSON schema feature.*'uniqueItems' at #"),
    ({"json": {"type": "object", "properties": {"not": {"type": "object", "properties": {"x": {"not": {}}}}}}},
     r"'not' at #/properties/not/properties/x$"),  # a property named "not" is no keyword
    ({"json": {"type": "number", "multipleOf": 0.5}}, "'multipleOf' on a non-integer"),
    ({"json": {"type": "string", "format": "iri"}}, "string format 'iri'"),
    ({"regex": "(?<=a)b"}, "structured_outputs.regex: .*Lookbehind is not supported"),
    ({"regex": "[a"}, "structured_outputs.regex: .*Unclosed"),
    ({"grammar": 'start ::= "a"'}, 'structured_outputs.grammar: .*root rule with name "root" is not found'),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "nope"}}},
     "structured_outputs.structural_tag: .*Format type not recognized: nope"),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {"not": {}}}}},
     "structured_outputs.structural_tag: unsupported JSON schema feature.*'not'"),
    ({"regex": "a", "reasoning_end_token_id": V}, f"reasoning_end_token_id {V} is not a token id"),
])
def test_compile_refusals_name_the_problem(manager, kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        manager.compile(StructuredOutputsParams(**kwargs))
    assert "/project/cpp" not in str(e.value)  # xgrammar's source location is left out


def test_first_mask_is_the_grammar_and_padding_rows_are_excluded(manager, tok):
    state = manager.start(StructuredOutputsParams(regex="[0-9]+"), [5])
    digits = {t for t in range(len(tok)) if re.fullmatch("[0-9]+", tok.decode([t]))}
    assert digits and masks(manager, state, [])[0] == digits  # no EOS before a digit; no id >= len(tok)
    manager.accept(state, min(digits))
    assert masks(manager, state, [])[0] == digits | {EOS}


def test_choice_and_termination(manager, tok):
    state = manager.start(StructuredOutputsParams(choice=['say "hi"', "a\\b"]), [5])
    for t in encode(tok, "a\\b"):
        assert manager.accept(state, t)
    assert masks(manager, state, [])[0] == {EOS}  # complete: only the stop token
    assert not manager.is_terminated(state)
    assert manager.accept(state, EOS) and manager.is_terminated(state)
    assert masks(manager, state, [])[0] == set(range(V))  # a terminated grammar masks nothing more
    assert not manager.accept(state, EOS)


def test_draft_masks_are_the_masks_along_the_drafts_and_the_matcher_rolls_back(manager, tok):
    params = StructuredOutputsParams(json={"type": "object", "properties": {"ab": {"type": "integer"}},
                                           "required": ["ab"]}, disable_any_whitespace=True)
    drafts = encode(tok, '{"ab": 1')
    state = manager.start(params, [5])
    got = masks(manager, state, drafts)
    step = manager.start(params, [5])  # the same grammar, one token at a time
    for i, d in enumerate(drafts):
        assert got[i] == masks(manager, step, [])[0] and d in got[i]
        assert manager.accept(step, d)
    assert got[-1] == masks(manager, step, [])[0]
    assert masks(manager, state, []) == got[:1]  # apply left the request's matcher where it was


def test_a_draft_the_grammar_refuses_is_masked_on_its_row_and_later_rows_are_free(manager, tok):
    state = manager.start(StructuredOutputsParams(regex="[0-9]{4}"), [5])
    digit, letter = encode(tok, "7")[0], encode(tok, "x")[0]
    got = masks(manager, state, [digit, letter, digit])
    assert letter not in got[1]  # the refused draft's row forbids it: verification rejects it
    assert got[2] == got[3] == set(range(V))
    assert masks(manager, state, [])[0] == got[0]


def test_reasoning_boundary_inside_the_draft_window(manager, tok):
    params = StructuredOutputsParams(regex="[0-9]{2}", reasoning_end_token_id=END_THINK)
    word, digit = encode(tok, "x")[0], encode(tok, "7")[0]
    state = manager.start(params, [5, 6])
    got = masks(manager, state, [word, END_THINK, digit, digit])
    digits = got[2]
    assert got[0] == got[1] == set(range(V))  # still reasoning: rows up to the one that samples </think>
    assert digit in digits and word not in digits and EOS not in digits  # the row right after it: constrained
    assert digit in got[3] and EOS not in got[3] and got[4] == {EOS}
    assert not state.reasoning_ended
    for t in (word, END_THINK):
        assert manager.accept(state, t)
    assert state.reasoning_ended and masks(manager, state, [])[0] == digits
    assert manager.start(params, [5, END_THINK]).reasoning_ended  # a prompt that closes the reasoning


def test_one_bitmask_for_several_requests_rows(manager, tok):
    a = manager.start(StructuredOutputsParams(regex="[0-9]+"), [5])
    b = manager.start(StructuredOutputsParams(choice=["x"]), [5])
    logits = torch.zeros(5, V)
    digit = encode(tok, "7")[0]
    manager.apply(logits, [(a, 0, [digit]), (b, 3, [])])  # row 2: an unconstrained request
    rows = [allowed(r) for r in logits]
    assert EOS not in rows[0] and EOS in rows[1] and rows[2] == set(range(V)) and rows[3] == set(encode(tok, "x"))
    assert rows[4] == set(range(V))
