"""LLM executor: requests and sampling params, scheduler (chunked prefill, preemption, prefix cache), sampler,
model runner, engine step loop, offline API."""
from .config import EngineConfig
from .forward_batch import ForwardBatch
from .llm import LLM
from .llm_engine import LLMEngine, RequestOutput
from .sampler import Sampler, SamplerOutput, TokenLogprobs, make_generator
from .sampling_params import SamplingParams

__all__ = ["EngineConfig", "ForwardBatch", "LLM", "LLMEngine", "RequestOutput", "Sampler", "SamplerOutput",
           "SamplingParams", "TokenLogprobs", "make_generator"]
