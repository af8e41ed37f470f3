"""The request path every generation endpoint shares (vLLM's OpenAIServing): check the model, tokenize, fetch and
place a prompt's images, submit the engine requests (n choices a prompt, PD's remote prefill), stream them as
server-sent events or collect them whole, count usage (image tokens included) and outcomes, and stop when the client
leaves. The endpoints (completions.py, chat.py, responses.py)
only turn their request bodies into prompts and sampling parameters, and engine outputs into their response shapes.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse

from common.engine import SamplingParams
from common.engine.sampling_params import StructuredOutputsParams
from common.kv_transfer import DecodeConnector

from .async_engine import AsyncLLMEngine, EngineOverloaded
from .http_utils import APIError, run_unless_disconnected
from .media_connector import MediaConnector
from .metrics import ServerMetrics
from .pd_protocol import PREFILL_HEADER
from .streams import merge, start

logger = logging.getLogger("npu_cookbook.serving")


def sse(obj, event: str | None = None) -> str:
    """One server-sent event: `data: <json>` (with `event: <type>` first where the endpoint names its events)."""
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def error_event(message: str) -> dict:
    return {"error": {"message": f"generation failed: {message}", "type": "internal_server_error", "param": None,
                      "code": 500}}


class OpenAIServing:
    """media: fetches the images requests name by URL (bounded bytes, time and pixels); max_images: the most images
    one request may carry."""

    def __init__(self, async_engine: AsyncLLMEngine, tokenizer, model_name: str, metrics: ServerMetrics,
                 media: MediaConnector | None = None, max_images: int = 8):
        self.async_engine, self.tokenizer, self.model_name, self.metrics = async_engine, tokenizer, model_name, metrics
        self.engine = async_engine.engine
        self.connector = self.engine.kv_connector
        self.media, self.max_images = media or MediaConnector(), max_images

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                           "NotFoundError", "model")

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        """The engine's rule (LLMEngine.tokenize): completions add the tokenizer's special tokens to text prompts by
        default, chat prompts (whose format writes its own) do not."""
        return self.engine.tokenize(prompt, add_special_tokens)

    async def place_images(self, ids: list[int], images: Sequence[dict], param: str = "messages"):
        """A prompt's image parts (OpenAI's {"type": "image_url", "image_url": {"url": ...}}, in prompt order)
        fetched and run through the model's encoder stage: (the ids with each image placeholder expanded, the placed
        images). 400 naming the problem: too many images, a URL refused, an image the processor refuses (not an
        image, truncated, an unsupported mode, too large), a model that takes no images."""
        if not images:
            return ids, []
        if len(images) > self.max_images:
            raise APIError(400, f"{param}: {len(images)} images in one request; at most {self.max_images} are "
                                "accepted", param=param)

        async def fetch(i: int, url: str) -> bytes:
            try:
                return await asyncio.to_thread(self.media.fetch, url)
            except ValueError as e:
                raise APIError(400, f"{param}: image {i}: {e}", param=param) from None

        sources = await asyncio.gather(*(fetch(i, part["image_url"]["url"]) for i, part in enumerate(images)))
        try:
            return await asyncio.to_thread(self.engine.place_images, ids, sources)
        except ValueError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None

    def remote_prefill(self, raw: Request) -> dict | None:
        """PD decode side: the kv_transfer_params of a request the router paired with a prefill instance."""
        url = raw.headers.get(PREFILL_HEADER)
        if url is None:
            return None  # served here from the prompt on, as colocated
        if not isinstance(self.connector, DecodeConnector):
            raise APIError(400, f"{PREFILL_HEADER}: this instance is not a PD decode instance", param=PREFILL_HEADER)
        try:
            return {"do_remote_prefill": True, "prefill_url": self.connector.check_prefill_url(url)}
        except ValueError as e:
            raise APIError(400, str(e), param=PREFILL_HEADER) from None

    async def check_constraint(self, constraint: StructuredOutputsParams | None, field: str) -> None:
        """Compile a request's grammar now (the engine's cache keeps it), so that one the grammar library refuses
        is a 400 naming the request field it came from."""
        manager = self.engine.structured_output
        if constraint is None:
            return
        if manager is None:
            raise APIError(400, f"{field}: structured output needs the engine's tokenizer", param=field)
        try:
            await asyncio.to_thread(manager.compile, constraint)
        except ValueError as e:
            raise APIError(400, f"{field}: {e}", param=field) from None

    async def submit(self, prompts: list[list[int]], params: Callable[[list[int], int], SamplingParams], n: int,
                     request_id: str, raw: Request, mm_inputs: Sequence = ()) -> list:
        """n engine requests a prompt, params(prompt ids, choice index) each; started (each first output in).
        mm_inputs: the images placed in every prompt (place_images)."""
        try:
            sampling = [params(p, j) for p in prompts for j in range(n)]
        except ValueError as e:
            raise APIError(400, str(e)) from None
        expanded = [p for p in prompts for _ in range(n)]
        kv = self.remote_prefill(raw)
        try:
            return await start(self.async_engine, expanded, sampling, request_id, kv, mm_inputs)
        except EngineOverloaded as e:
            raise APIError(503, str(e), "server_overloaded", headers={"Retry-After": "1"}) from None
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None

    @staticmethod
    def usage(prompts: list[list[int]], finals: dict) -> dict:
        """OpenAI usage of the choices finals[i] (n a prompt, prompt-major). A prompt counts once; its cached_tokens
        (prompt_tokens_details) are the prefix-cache hits of its first choice (vLLM's RequestOutput.num_cached_tokens:
        whole blocks, at the request's first scheduling; under PD, the prefill instance's)."""
        n = max(1, len(finals) // max(1, len(prompts)))
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(o.token_ids) for o in finals.values())
        cached_tokens = sum(finals[i].num_cached_tokens for i in range(0, len(prompts) * n, n) if i in finals)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    async def unless_disconnected(self, raw: Request, work):
        """work's result, or None when the client left first (its engine requests are aborted)."""
        finished, result = await run_unless_disconnected(raw, work)
        if not finished:
            self.metrics.count("aborted")
        return result

    async def collect(self, started, arrival: float) -> dict:
        """The final output of every choice; 500 if one failed."""
        finals = {}
        async for i, out in merge(started, self.metrics, arrival):
            if out.finished:
                finals[i] = out
        failed = [out.error for out in finals.values() if out.finish_reason == "error"]
        if failed:
            raise APIError(500, f"generation failed: {failed[0]}", "internal_server_error")
        return finals

    async def generate_whole(self, prompts, params, n: int, request_id: str, arrival: float, raw: Request,
                             mm_inputs: Sequence = ()):
        """Submit and collect, unless the client leaves: the finals, or None (nobody is listening)."""
        async def work():
            return await self.collect(await self.submit(prompts, params, n, request_id, raw, mm_inputs), arrival)
        finals = await self.unless_disconnected(raw, work())
        if finals is not None:
            self.metrics.count("success")
        return finals

    def stream(self, started, arrival: float, events: Callable[[AsyncIterator], AsyncIterator[str]],
               trailer: str = "") -> StreamingResponse:
        """SSE of the frames `events` makes of the (choice index, output) pairs as they come. `events` ends a failed
        stream by yielding FAILED after its error frames; a fault mid-stream ends it with an error event, then
        `trailer` (the chat / completions shape's `data: [DONE]`). Outcomes counted."""
        return StreamingResponse(self._counted(merge(started, self.metrics, arrival), events, trailer),
                                 media_type="text/event-stream")

    async def _counted(self, outputs, events, trailer: str) -> AsyncIterator[str]:
        outcome = "aborted"
        try:
            async for frame in events(outputs):
                if frame is FAILED:
                    outcome = "error"
                    return
                yield frame
            outcome = "success"
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band
            logger.exception("generation failed mid-stream")
            outcome = "error"
            yield sse(error_event(str(e))) + trailer
        finally:
            self.metrics.count(outcome)

    def chunk_stream(self, started, arrival: float, make_chunk, head: dict, prompts: list[list[int]] | None = None
                     ) -> StreamingResponse:
        """The completions / chat stream: `data:` chunks make_chunk(i, out) builds (None: nothing to send), a
        failed choice's chunk then an error event, with prompts (stream_options.include_usage) a last chunk of
        `head` with no choices and the usage, then `data: [DONE]`."""
        async def events(outputs):
            finals = {}
            async for i, out in outputs:
                chunk = make_chunk(i, out)
                if chunk is not None:
                    yield sse(chunk)
                if out.finished:
                    finals[i] = out
                if out.finish_reason == "error":  # the choice's finish_reason said it; the event says why
                    yield sse(error_event(out.error)) + DONE
                    yield FAILED
                    return
            if prompts is not None:
                yield sse({**head, "choices": [], "usage": self.usage(prompts, finals)})
            yield DONE
        return self.stream(started, arrival, events, DONE)


DONE = "data: [DONE]\n\n"
FAILED = object()  # an `events` generator yields it after its error frames: the stream ends, counted as an error
