"""One generation request as the scheduler tracks it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .multimodal import MultiModalInput
from .sampler import TokenLogprobs, make_generator
from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # PD decode side: blocks held, the prompt's KV on its way
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # [i]: prompt token i + 1, from position i
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache (prefill skipped) at first schedule
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # why, when finish_reason is "error"
    text: str = ""  # the output's text, cut at a stop string
    generator: torch.Generator | None = None
    detokenizer: object | None = field(default=None, repr=False)  # the engine's IncrementalDetokenizer
    spec_token_ids: list[int] = field(default_factory=list)  # MTP drafts of the tokens after the last one
    grammar: object | None = field(default=None, repr=False)  # structured output: the engine's GrammarState
    # PD disaggregation: what the KV connector needs (where from / to, which blocks), with vLLM's flags (below)
    kv_transfer_params: dict | None = field(default=None, repr=False)
    mm_inputs: list[MultiModalInput] = field(default_factory=list, repr=False)  # images placed in the prompt, in order

    def __post_init__(self):
        self.generator = make_generator(self.sampling_params.seed)

    @property
    def do_remote_prefill(self) -> bool:
        """Decode instance: the prompt's KV and first token come from a prefill instance into blocks allocated here."""
        return bool(self.kv_transfer_params and self.kv_transfer_params.get("do_remote_prefill"))

    @property
    def do_remote_decode(self) -> bool:
        """Prefill instance: once the request finished its prefill, its blocks are held until the KV connector has
        sent them."""
        return bool(self.kv_transfer_params and self.kv_transfer_params.get("do_remote_decode"))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
