"""What the PD roles and the router agree on: the header that names a request's prefill instance, and the JSON
form of log-probs in the prefill instance's answer."""
from __future__ import annotations

from common.engine.sampler import TokenLogprobs

PREFILL_HEADER = "x-pd-prefill"  # router -> decode instance: the base URL of the prefill instance to use


def logprobs_to_json(lps: list[TokenLogprobs | None] | None) -> list | None:
    if lps is None:
        return None
    return [None if lp is None else [lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in lps]


def logprobs_from_json(data: list | None) -> list[TokenLogprobs | None] | None:
    if data is None:
        return None
    return [None if d is None else TokenLogprobs(int(d[0]), float(d[1]), [(int(i), float(v)) for i, v in d[2]])
            for d in data]
