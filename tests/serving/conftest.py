"""One tiny fp32 DeepSeek-V4 checkpoint per session; a real uvicorn serving it per test module."""
import pytest
import torch
from transformers import AutoTokenizer

from serving_harness import running_server
from tiny_deepseek_v4 import write_tiny_checkpoint
from weights_deepseek_v4 import load_model


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("serving") / "ckpt", quantized=False)


@pytest.fixture(scope="session")
def model_and_tokenizer(checkpoint):
    return load_model(checkpoint, torch.float32), AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def server(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    with running_server(model, tokenizer, max_num_seqs=16) as (url, engine):
        yield url, engine
