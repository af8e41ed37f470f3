"""Per-choice output bookkeeping shared by the streaming and the whole-response paths: incremental text deltas,
logprobs in OpenAI's two shapes, and the merge of several engine streams."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from common.engine import RequestOutput

REPLACEMENT = "\ufffd"  # what a decode of an incomplete UTF-8 character ends with


class TextStream:
    """Text of one choice, handed out as deltas that never need taking back. The engine decodes incrementally
    (RequestOutput.text: complete characters only, cut at a stop string); while unfinished, the last
    len(longest stop)-1 characters are held back (a stop string may be starting there). Splitting the text into
    reasoning, content and tool calls is the chat format's parser's job (chat_format.py)."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0
        self.num_logprobs_sent = 0
        self.text_offset = 0  # characters of this choice's text that logprobs offsets already covered

    def update(self, out: RequestOutput) -> str:
        """The text delta since the last update."""
        text = out.text if out.finished else out.text[: max(0, len(out.text) - self.hold)]
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta

    def new_logprobs(self, out: RequestOutput) -> list:
        new = (out.logprobs or [])[self.num_logprobs_sent:]
        self.num_logprobs_sent += len(new)
        return new

    def completion_logprobs(self, logprobs: list, prompt: tuple[list[int], list] | None = None) -> dict:
        """OpenAI completions shape for the new tokens; with prompt = (prompt ids, their prompt log-probs) the
        prompt's tokens come first (echo), the first of them with no log-prob. Offsets run on across calls."""
        entries = []
        if prompt is not None:
            ids, lps = prompt
            entries.append((self.tokenizer.decode([ids[0]]), None, None))
            entries += [(self.tokenizer.decode([lp.token_id]), lp.logprob,
                         {self.tokenizer.decode([i]): v for i, v in lp.top}) for lp in lps]
        entries += [(self.tokenizer.decode([lp.token_id]), lp.logprob,
                     {self.tokenizer.decode([i]): v for i, v in lp.top}) for lp in logprobs]
        offsets = []
        for token, _, _ in entries:
            offsets.append(self.text_offset)
            self.text_offset += len(token)
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [e[2] for e in entries], "text_offset": offsets}


def chat_logprobs(tokenizer, logprobs: list) -> dict:
    """OpenAI chat shape: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    def entry(token_id: int, logprob: float) -> dict:
        token = tokenizer.decode([token_id])
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                        for lp in logprobs]}


async def start(async_engine, prompts: list[list[int]], params: list, request_id: str,
                kv_transfer_params: dict | None = None, mm_inputs=()) -> list:
    """Submit one engine request per (prompt, params) and wait for each first output, so that a rejection
    (EngineOverloaded, ValueError) comes before any response starts; on one, the others are aborted. mm_inputs: the
    images placed in every prompt (a chat request's n choices share one)."""
    gens = [async_engine.generate(p, sp, f"{request_id}-{i}", kv_transfer_params, mm_inputs)
            for i, (p, sp) in enumerate(zip(prompts, params))]
    firsts = await asyncio.gather(*(anext(g) for g in gens), return_exceptions=True)
    errors = [f for f in firsts if isinstance(f, BaseException)]
    if errors:
        await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)
        raise errors[0]
    return list(zip(gens, firsts))


async def merge(started: list, metrics=None, arrival: float | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from several started engine streams as they come; stopping early aborts them all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen, out: RequestOutput) -> None:
        last = time.perf_counter()
        if metrics is not None and arrival is not None:
            metrics.ttft.observe(last - arrival)
        try:
            queue.put_nowait((i, out))
            while not out.finished:
                prev, out = len(out.token_ids), await anext(gen)
                now = time.perf_counter()
                if metrics is not None and len(out.token_ids) > prev:
                    metrics.itl.observe((now - last) / (len(out.token_ids) - prev))
                last = now
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        finally:
            await gen.aclose()

    tasks = [asyncio.create_task(pump(i, gen, first)) for i, (gen, first) in enumerate(started)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            remaining -= item.finished
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
