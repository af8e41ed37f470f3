"""The tiny HunyuanImage-3.0 checkpoint, written once per session into a temporary folder."""
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from tiny_hunyuan_image import write_tiny_checkpoint
from weights_hunyuan_image import load_model, special_token_ids


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("hunyuan-image-tiny"))


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    return PreTrainedTokenizerFast.from_pretrained(tiny_path)


@pytest.fixture(scope="session")
def special(tokenizer):
    return special_token_ids(tokenizer)


@pytest.fixture()
def model(tiny_path):
    return load_model(tiny_path, torch.float32)
