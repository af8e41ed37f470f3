"""POST /v1/completions: prompts (text or token ids, one or several) -> choices of text, streamed or whole; echo and
log-probs in the completions shape (prompt scoring with max_tokens 0 and echo)."""
from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from .openai_serving import OpenAIServing
from .protocol import CompletionRequest
from .streams import TextStream


class OpenAIServingCompletion:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def create(self, body: CompletionRequest, raw: Request):
        s, tokenizer = self.serving, self.serving.tokenizer
        arrival, created = time.perf_counter(), int(time.time())
        s.check_model(body.model)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if body.structured_outputs is not None:
            await s.check_constraint(body.structured_outputs.constraint(), "structured_outputs")
        prompts = [s.tokenize(p, body.add_special_tokens) for p in body.prompts]
        # echo: each choice's text starts with its prompt (as sent, or decoded from ids), log-probs too
        prompt_texts = [p if isinstance(p, str) else tokenizer.decode(ids) for p, ids in zip(body.prompts, prompts)]
        head = {"id": request_id, "object": "text_completion", "created": created, "model": s.model_name}
        streams = [TextStream(tokenizer, body.stop_strings) for _ in range(len(prompts) * body.n)]

        def params(prompt: list[int], index: int):
            return body.sampling_params(len(prompt), s.max_model_len, index=index)

        def choice(i, out, text, first: bool):
            echo = body.echo and first
            ids = prompts[i // body.n]
            lps = None
            if body.logprobs is not None:
                lps = streams[i].completion_logprobs(streams[i].new_logprobs(out),
                                                     (ids, out.prompt_logprobs or []) if echo else None)
            return {"index": i, "text": prompt_texts[i // body.n] + text if echo else text, "logprobs": lps,
                    "finish_reason": out.finish_reason if out.finished else None}

        if body.stream:
            started = await s.unless_disconnected(raw, s.submit(prompts, params, body.n, request_id, raw))
            if started is None:
                return Response(status_code=499)  # gone before its first token (PD: while P prefilled)
            sent_first = set()

            def make_chunk(i, out):
                text = streams[i].update(out)
                first = i not in sent_first
                if not text and not out.finished and body.logprobs is None and not (body.echo and first):
                    return None
                sent_first.add(i)
                return {**head, "choices": [choice(i, out, text, first)]}

            return s.chunk_stream(started, arrival, make_chunk, head, prompts if body.include_usage else None)

        finals = await s.generate_whole(prompts, params, body.n, request_id, arrival, raw)
        if finals is None:
            return Response(status_code=499)  # nobody is listening
        choices = [choice(i, finals[i], streams[i].update(finals[i]), True) for i in range(len(finals))]
        return {**head, "choices": choices, "usage": s.usage(prompts, finals)}
