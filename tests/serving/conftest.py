"""One tiny fp32 DeepSeek-V4 checkpoint per session, loaded once; every engine gets a model of its own (an engine owns
its model's caches: a second engine on the same model would take them); a real uvicorn serving it per module."""
import pytest
import torch
from transformers import AutoTokenizer

from serving_harness import own_model, running_server
from tiny_deepseek_v4 import write_tiny_checkpoint
from weights_deepseek_v4 import load_model


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("serving") / "ckpt", quantized=False)


@pytest.fixture(scope="session")
def loaded_model(checkpoint):
    """The checkpoint's model and tokenizer, loaded once: never given to an engine itself (see own_model)."""
    return load_model(checkpoint, torch.float32), AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture
def model_and_tokenizer(loaded_model):
    """A model of this test's own (for one engine) and the tokenizer."""
    return own_model(loaded_model)


@pytest.fixture(scope="module")
def server(loaded_model):
    with running_server(*own_model(loaded_model), max_num_seqs=16) as (url, engine):
        yield url, engine
