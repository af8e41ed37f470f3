"""Grammar-constrained sampling (structured output) with xgrammar.

The engine owns one StructuredOutputManager: the tokenizer's xgrammar TokenizerInfo (built once, over the model's
lm-head rows) and a GrammarCompiler whose cache compiles each distinct grammar once (xgrammar keys it by the
grammar's text and options: a JSON schema or structural tag given as a dict is keyed by its `json.dumps`, key order
kept, since property order is output order). `compile` checks a request's StructuredOutputsParams before it is
queued (ValueError naming the bad schema / regex / grammar or the unsupported feature: the server's 400).

Each constrained request gets a GrammarState at `start` (its own matcher; n > 1 samples are separate requests) that
follows the request's committed tokens (`accept`), so a request preempted by recompute keeps its state, and is
dropped when the request finishes (`release`). A step's masks: `apply` fills one int32 bitmask for every constrained
row of the step (xgrammar's layout: bit 1 = allowed) and applies it over the logits in one call, before sampling or
draft verification. A request with MTP drafts d_1..d_k has k + 1 rows; row i's mask is the grammar's state after
d_1..d_i: the matcher walks the drafts, filling a mask per row, then rolls back (vLLM's pattern). From the first
draft the matcher refuses on, the rows are left unmasked: that draft's own row forbids it, so verification rejects
it (greedy: the row's masked argmax differs; sampled: its masked probability is 0) and no later row is committed.
Once the grammar is complete only the stop tokens (the model's EOS) are allowed; a matcher that accepted one has
terminated and the request stops ("stop"), also under ignore_eos. Each row's mask is also ANDed with the tokens that
continue the output as well-formed UTF-8 (utf8_masks.py: xgrammar takes an encoded surrogate for a character), and
`accept` refuses a token that would not.

xgrammar 0.2.9 writes the characters of a JSON string bounded by minLength / maxLength as any but `"`, `\\`, CR and
LF, so other raw control characters (which JSON forbids) get into the JSON: `compile` takes such a schema (or
structural tag) through xgrammar's EBNF with that rule fixed (json_string_bounds_fixed; the cache is then keyed by
the EBNF). Such a string takes no escape, as in xgrammar. With a pattern or a format xgrammar would drop the bound:
refused.

With `reasoning_end_token_id`, rows up to the one that samples that token are free; the next row is the first
constrained one, also when the token is a draft inside the verify window.

Masks are a function of the committed tokens alone, so attention-TP peers, which hold the same requests, mask alike.
Log-probs of a constrained row are those of its masked logits (vLLM's too).
"""
from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass

import torch
import xgrammar as xgr

from .sampling_params import StructuredOutputsParams
from .utf8_masks import COMPLETE, Utf8Masks, Utf8State

MAX_THREADS = min(8, max(1, (os.cpu_count() or 2) // 2))  # xgrammar's compile and batch-fill threads
# whitespace a JSON grammar allows in one run (between two tokens of the JSON): room for pretty-printing four levels
# deep, and a bound on the run where a weak or unlucky sample would wander in whitespace until max_tokens
JSON_MAX_WHITESPACE = 16
CACHE_LIMIT_BYTES = 512 << 20  # compiled grammars kept (vLLM's default VLLM_XGRAMMAR_CACHE_MB)
# string formats xgrammar 0.2.9 enforces; others (idn-email, iri, regex, unknown ones) it would silently ignore
JSON_FORMATS = {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference",
                "uuid", "uri-template", "json-pointer", "relative-json-pointer"}
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
NOT_SCHEMAS = ("enum", "const", "default", "examples", "required", "dependentRequired", "description", "title")
# xgrammar 0.2.9's rule for the characters of a JSON string bounded by minLength / maxLength, and JSON's own
_BOUNDED_CHARACTERS = re.compile(r'^(\w+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
_JSON_RAW_CHARACTER = r'(([^\0-\x1f\"\\]))'
_XGR_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(eq=False)
class GrammarState:
    """One request's grammar: its matcher, whether the reasoning before the constraint is over, and where the
    constrained output's last character stands in UTF-8."""
    matcher: xgr.GrammarMatcher
    reasoning_end_token_id: int | None
    reasoning_ended: bool
    utf8: Utf8State = COMPLETE


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_threads: int = MAX_THREADS,
                 cache_limit_bytes: int = CACHE_LIMIT_BYTES):
        """tokenizer: a transformers tokenizer; vocab_size: the model's lm-head rows (>= the tokenizer's ids);
        stop_token_ids: what a complete grammar allows next (the model's EOS ids)."""
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=True,
                                            cache_limit_bytes=cache_limit_bytes)
        self.batch_matcher = xgr.BatchGrammarMatcher(max_threads)
        self.utf8 = Utf8Masks(self.tokenizer_info.decoded_vocab, vocab_size)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [rows, ceil(V / 32)] int32, grown as needed

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar (cached); ValueError naming what is wrong or unsupported."""
        kind = params.kind
        end = params.reasoning_end_token_id
        if end is not None and end >= self.vocab_size:
            raise ValueError(f"structured_outputs.reasoning_end_token_id {end} is not a token id "
                             f"(vocabulary {self.vocab_size})")
        value, bounded = getattr(params, kind), False
        if kind in ("json", "structural_tag"):
            loaded = json.loads(value) if isinstance(value, str) else value
            unsupported = (unsupported_json_schema_features(loaded) if kind == "json"
                           else [f for s in _tag_schemas(loaded) for f in unsupported_json_schema_features(s)])
            if unsupported:
                raise ValueError(f"structured_outputs.{kind}: unsupported JSON schema feature(s): "
                                 f"{'; '.join(unsupported)}")
            bounded = _has_string_bounds([loaded] if kind == "json" else _tag_schemas(loaded, json_style_only=True))
            value = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        try:
            if bounded:  # through xgrammar's EBNF, its string rule fixed
                return self.compiler.compile_grammar(_bounds_fixed_ebnf(kind, value, not params.disable_any_whitespace))
            if kind in ("json", "json_object"):
                return self.compiler.compile_json_schema(value if kind == "json" else '{"type": "object"}',
                                                         any_whitespace=not params.disable_any_whitespace,
                                                         max_whitespace_cnt=JSON_MAX_WHITESPACE)
            if kind == "regex":
                return self.compiler.compile_regex(value)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(value))
            if kind == "grammar":
                return self.compiler.compile_grammar(value)
            return self.compiler.compile_structural_tag(value)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's C++ errors arrive as RuntimeError
            raise ValueError(f"structured_outputs.{kind}: {_xgr_message(e)}") from None

    def start(self, params: StructuredOutputsParams, prompt_token_ids: list[int]) -> GrammarState:
        """A new request's grammar state (compile raises for params it refuses)."""
        end = params.reasoning_end_token_id
        return GrammarState(xgr.GrammarMatcher(self.compile(params)), end,
                            end is None or prompt_token_ids[-1] == end)

    def apply(self, logits: torch.Tensor, rows: list[tuple[GrammarState, int, list[int]]]) -> None:
        """Mask logits [N, V] in place: per constrained request (its state, its first row, its drafts d_1..d_k)
        rows first .. first + k get the grammar's masks (rows the grammar does not yet or no longer constrain: none).
        The matchers end where they began."""
        n = logits.shape[0]
        if self.bitmask.shape[0] < n:
            self.bitmask = xgr.allocate_token_bitmask(n, self.vocab_size)
        starts = [_first_constrained(state, drafts) for state, _, drafts in rows]
        walked = [0] * len(rows)  # drafts each matcher accepted (rolled back at the end)
        alive = [s is not None for s in starts]
        filled = []
        try:
            for level in range(max((len(d) for _, _, d in rows), default=0) + 1):
                stepping = [j for j, (state, _, drafts) in enumerate(rows)
                            if alive[j] and starts[j] < level <= len(drafts)]
                accepted = xgr.BatchGrammarMatcher.batch_accept_token(
                    [rows[j][0].matcher for j in stepping],
                    [rows[j][2][level - 1] for j in stepping]) if stepping else []
                for j, ok in zip(stepping, accepted):
                    walked[j] += ok
                    alive[j] = ok
                picked = [j for j, (state, _, drafts) in enumerate(rows)
                          if alive[j] and starts[j] <= level <= len(drafts) and not state.matcher.is_terminated()]
                if picked:
                    indices = [rows[j][1] + level for j in picked]
                    self.batch_matcher.batch_fill_next_token_bitmask([rows[j][0].matcher for j in picked],
                                                                     self.bitmask, indices)
                    for j, index in zip(picked, indices):
                        state, _, drafts = rows[j]
                        self.bitmask[index] &= self.utf8.mask(self._utf8_state(state, drafts, starts[j], level))
                    filled += indices
        finally:  # also when a matcher raises: no state is left advanced by a draft
            for (state, _, _), w in zip(rows, walked):
                if w:
                    state.matcher.rollback(w)
        if filled:
            bitmask = self.bitmask[:n].to(logits.device, non_blocking=True)  # [N, ceil(V / 32)]
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=filled)

    def accept(self, state: GrammarState, token: int) -> bool:
        """Advance a request's grammar by its committed token; False when the grammar forbids it or it breaks the
        output's UTF-8 (a masked row never samples one: the caller fails the request)."""
        if not state.reasoning_ended:
            state.reasoning_ended = token == state.reasoning_end_token_id
            return True
        utf8 = self.utf8.after(state.utf8, token)
        if utf8 is None or not state.matcher.accept_token(token):
            return False
        state.utf8 = utf8
        return True

    def _utf8_state(self, state: GrammarState, drafts: list[int], first: int, level: int) -> Utf8State:
        """The UTF-8 state of the row after drafts d_1..d_level, of which the grammar constrains d_first+1.. on."""
        utf8 = state.utf8
        for d in drafts[first:level]:
            utf8 = self.utf8.after(utf8, d) or COMPLETE  # rows after a draft that breaks UTF-8: never committed
        return utf8

    @staticmethod
    def is_terminated(state: GrammarState) -> bool:
        """The grammar accepted a stop token: the request ends here."""
        return state.reasoning_ended and state.matcher.is_terminated()


def _first_constrained(state: GrammarState, drafts: list[int]) -> int | None:
    """The first of a request's rows 0..k that the grammar constrains (None: none this step)."""
    if state.reasoning_ended:
        return None if state.matcher.is_terminated() else 0
    return next((i + 1 for i, d in enumerate(drafts) if d == state.reasoning_end_token_id), None)


def choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of the strings (EBNF string literals take JSON's escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def schemas_in(schema, path: str = "#"):
    """Every (sub)schema of a JSON schema, with where it is: (path, dict), the schema itself first."""
    if not isinstance(schema, dict):
        return
    yield path, schema
    for key, value in schema.items():
        if key in NOT_SCHEMAS:  # values, not schemas
            continue
        if key in SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield from schemas_in(sub, f"{path}/{key}/{name}")
        elif isinstance(value, dict):
            yield from schemas_in(value, f"{path}/{key}")
        elif isinstance(value, list):
            for i, sub in enumerate(value):
                yield from schemas_in(sub, f"{path}/{key}/{i}")


def unsupported_json_schema_features(schema) -> list[str]:
    """The keywords of a JSON schema that xgrammar would accept but not enforce, each with where it is."""
    return [problem for path, s in schemas_in(schema) for problem in _unsupported_here(s, path)]


def _unsupported_here(schema: dict, path: str) -> list[str]:
    out = []
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    if "not" in schema:
        out.append(f"'not' at {path}")
    if schema.get("uniqueItems") is True:
        out.append(f"'uniqueItems' at {path}")
    if "multipleOf" in schema and not (isinstance(schema["multipleOf"], int) and types == ["integer"]):
        out.append(f"'multipleOf' on a non-integer at {path}")
    if isinstance(schema.get("format"), str) and ("string" in types or types == [None]) \
            and schema["format"] not in JSON_FORMATS:
        out.append(f"string format {schema['format']!r} at {path}")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        out.append(f"'allOf' with several schemas at {path}")
    out += [f"'{bound}' with '{other}' at {path}" for bound in ("minLength", "maxLength") if bound in schema
            for other in ("pattern", "format") if other in schema]
    return out


def json_string_bounds_fixed(ebnf: str) -> str:
    """xgrammar's EBNF with the characters of each JSON string bounded by minLength / maxLength being those JSON
    allows raw: any but `"`, `\\` and U+0000..U+001F (xgrammar 0.2.9 writes [^"\\\r\n])."""
    return _BOUNDED_CHARACTERS.sub(lambda m: f"{m.group(1)} ::= {_JSON_RAW_CHARACTER}", ebnf)


def _has_string_bounds(schemas: list) -> bool:
    return any("minLength" in sub or "maxLength" in sub for schema in schemas for _, sub in schemas_in(schema))


@functools.lru_cache(maxsize=256)
def _bounds_fixed_ebnf(kind: str, value: str, any_whitespace: bool) -> str:
    """A json / structural_tag grammar with bounded JSON strings as fixed EBNF (converted once per grammar)."""
    grammar = (xgr.Grammar.from_json_schema(value, any_whitespace=any_whitespace,
                                            max_whitespace_cnt=JSON_MAX_WHITESPACE)
               if kind == "json" else xgr.Grammar.from_structural_tag(value))
    return json_string_bounds_fixed(str(grammar))


def _tag_schemas(tag, json_style_only: bool = False) -> list:
    """The JSON schemas inside a structural tag (json_style_only: those written as JSON, not as raw strings)."""
    if isinstance(tag, list):
        return [s for item in tag for s in _tag_schemas(item, json_style_only)]
    if not isinstance(tag, dict):
        return []
    own = [tag["json_schema"]] if tag.get("type") == "json_schema" and "json_schema" in tag \
        and (not json_style_only or tag.get("style", "json") == "json") else []
    return own + [s for k, v in tag.items() if k != "json_schema" for s in _tag_schemas(v, json_style_only)]


def _xgr_message(e: Exception) -> str:
    return _XGR_PREFIX.sub("", str(e)).strip()
