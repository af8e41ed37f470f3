"""Per-request sampling settings, vLLM's names and defaults; the server builds one from the request JSON."""
import math
from dataclasses import dataclass

MAX_LOGPROBS = 20
GREEDY_EPS = 1e-5  # a temperature below this samples greedily (vLLM's _SAMPLING_EPS): dividing by it overflows


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
