"""LLM executor: requests and sampling params, scheduler (chunked prefill, preemption, prefix cache), sampler,
structured output (grammar-constrained sampling), model runner, engine step loop, offline API."""
from .config import EngineConfig
from .forward_batch import ForwardBatch
from .llm import LLM
from .llm_engine import LLMEngine, RequestOutput
from .sampler import Sampler, SamplerOutput, TokenLogprobs, make_generator
from .sampling_params import SamplingParams, StructuredOutputsParams
from .structured_output import StructuredOutputManager

__all__ = ["EngineConfig", "ForwardBatch", "LLM", "LLMEngine", "RequestOutput", "Sampler", "SamplerOutput",
           "SamplingParams", "StructuredOutputManager", "StructuredOutputsParams", "TokenLogprobs", "make_generator"]
