"""Per-request sampling settings, vLLM's names and defaults; the server builds one from the request JSON.

A SamplingParams travels between instances (PD) as `dataclasses.asdict(...)` JSON and is rebuilt with
`SamplingParams(**d)`: a `structured_outputs` dict turns back into StructuredOutputsParams there."""
import json as _json
import math
from dataclasses import dataclass, fields

MAX_LOGPROBS = 20
GREEDY_EPS = 1e-5  # a temperature below this samples greedily (vLLM's _SAMPLING_EPS): dividing by it overflows


STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """Grammar-constrained sampling (vLLM's names): exactly one kind of constraint.
    json: a JSON schema (dict or JSON text); json_object: True = any JSON object; regex: the whole output matches it;
    choice: the output is one of these strings; grammar: an EBNF grammar (xgrammar / GBNF syntax, rule `root`);
    structural_tag: an xgrammar structural tag (dict or JSON text, e.g. `xgrammar.get_model_structural_tag(...)
    .model_dump(mode="json")` for a model's tool-call format).
    disable_any_whitespace: JSON kinds emit no optional whitespace (default: any whitespace, as vLLM).
    reasoning_end_token_id: the constraint starts after this token (a thinking model's `</think>`); the reasoning
    before it is free. A prompt that ends with it starts constrained. None: from the first token on.
    Compiled (and refused, ValueError) by common.engine.structured_output.StructuredOutputManager."""
    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None
    disable_any_whitespace: bool = False
    reasoning_end_token_id: int | None = None

    def __post_init__(self):
        kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(f"SamplingParams.structured_outputs needs exactly one of "
                             f"{', '.join(STRUCTURED_OUTPUT_KINDS)}, got {', '.join(kinds) if kinds else 'none'}")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, (dict, str)), f"structured_outputs.{name}",
                   "a dict or a JSON string", value)
            if isinstance(value, str):
                try:
                    _json.loads(value)
                except ValueError as e:
                    raise ValueError(f"SamplingParams.structured_outputs.{name} is not valid JSON: {e}") from None
        _check(self.json_object is None or isinstance(self.json_object, bool), "structured_outputs.json_object",
               "a bool", self.json_object)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, str), f"structured_outputs.{name}", "a string", value)
        _check(self.grammar is None or self.grammar.strip(), "structured_outputs.grammar", "a non-empty grammar",
               self.grammar)
        _check(self.choice is None or isinstance(self.choice, (list, tuple)) and self.choice
               and all(isinstance(c, str) and c for c in self.choice),
               "structured_outputs.choice", "a non-empty list of non-empty strings", self.choice)
        _check(isinstance(self.disable_any_whitespace, bool), "structured_outputs.disable_any_whitespace", "a bool",
               self.disable_any_whitespace)
        _check(self.reasoning_end_token_id is None or _is_int(self.reasoning_end_token_id)
               and self.reasoning_end_token_id >= 0, "structured_outputs.reasoning_end_token_id", "None or an int >= 0",
               self.reasoning_end_token_id)
        if self.choice is not None:
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        """Which constraint is set: one of STRUCTURED_OUTPUT_KINDS."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: off (0 is stored as -1)
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16  # 0: run the prompt only (with prompt_logprobs: score it), generate nothing
    stop: list[str] | str | None = None  # stored as a list
    stop_token_ids: list[int] | None = None  # stored as a list
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs per generated token; 0: only the sampled token's
    prompt_logprobs: int | None = None  # top logprobs per prompt token (vLLM's name); 0: only the prompt token's
    skip_special_tokens: bool = True  # the output text leaves special tokens out (chat parsers set False)
    structured_outputs: StructuredOutputsParams | None = None  # grammar-constrained sampling; a dict is converted

    def __post_init__(self):
        _check(_is_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
               "temperature", "a finite number >= 0", self.temperature)
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]", self.top_p)
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k", "an int >= -1 (-1 or 0: off)", self.top_k)
        _check(self.seed is None or _is_int(self.seed), "seed", "an int or None", self.seed)
        _check(_is_int(self.max_tokens) and self.max_tokens >= 0, "max_tokens", "an int >= 0", self.max_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or _is_int(value) and 0 <= value <= MAX_LOGPROBS,
                   name, f"None or an int in [0, {MAX_LOGPROBS}]", value)
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "a bool", self.ignore_eos)
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        _check(isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop),
               "stop", "a non-empty string or a list of them", self.stop)
        stop_token_ids = self.stop_token_ids or []
        _check(isinstance(stop_token_ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in stop_token_ids),
               "stop_token_ids", "a list of ints >= 0", self.stop_token_ids)
        _check(isinstance(self.skip_special_tokens, bool), "skip_special_tokens", "a bool", self.skip_special_tokens)
        if isinstance(self.structured_outputs, dict):  # as asdict() wrote it
            unknown = set(self.structured_outputs) - {f.name for f in fields(StructuredOutputsParams)}
            if unknown:
                raise ValueError(f"SamplingParams.structured_outputs has unknown fields {sorted(unknown)}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", "a StructuredOutputsParams, its dict or None", self.structured_outputs)
        self.top_k = -1 if self.top_k == 0 else self.top_k
        self.stop, self.stop_token_ids = list(stop), list(stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check(ok: bool, field: str, expected: str, value):
    if not ok:
        raise ValueError(f"SamplingParams.{field} must be {expected}, got {value!r}")
