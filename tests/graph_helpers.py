"""Graph mode against eager on one checkpoint: each mode's greedy tokens, shared by the model tests."""
import torch
from transformers import AutoTokenizer

from common.engine import LLM, SamplingParams


def greedy_eager_and_graph(load_model, path, prompts: list[list[int]], params: SamplingParams,
                           bucket: int = 4) -> dict[str, list[list[int]]]:
    """{mode: token ids per prompt} of an fp32 engine in eager and in graph mode (one bucket of `bucket`
    sequences); the graph engine's decode steps must have run as its graph."""
    tok = AutoTokenizer.from_pretrained(path)
    outs = {}
    for mode in ("eager", "graph"):
        llm = LLM(load_model(path, torch.float32), tok, block_size=16, max_num_seqs=bucket, exe_mode=mode,
                  graph_capture_sizes=(bucket,) if mode == "graph" else None)
        outs[mode] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if mode == "graph":
            assert sum(llm.engine.runner.graphs.replays.values()) >= params.max_tokens - 2  # decode steps as graphs
    return outs
