"""OpenAI-compatible serving over the engine: the engine thread bridge, the FastAPI app, the router."""
from .async_engine import AsyncLLMEngine, EngineOverloaded

__all__ = ["AsyncLLMEngine", "EngineOverloaded"]
