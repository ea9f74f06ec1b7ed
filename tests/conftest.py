# Shared fixtures for the test suite (the runner's tests use them too).

import pytest

import interact


@pytest.fixture(scope="session")
def qwen_tokenizer_dir():
    """The real Qwen3 tokenizer files (tokenizer.json, tokenizer_config.json with the chat template, ...)."""
    return interact.qwen_tokenizer_dir()


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_tokenizer_dir):
    return interact.load_tokenizer(qwen_tokenizer_dir)
