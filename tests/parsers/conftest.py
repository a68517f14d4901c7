"""Session fixtures: the real tokenizers (see realtok.py for where each one comes from)."""
from __future__ import annotations

import pytest

from tests.parsers.realtok import Model, load_model


@pytest.fixture(scope="session")
def v32() -> Model:
    return load_model("deepseek-v3.2")


@pytest.fixture(scope="session")
def v4() -> Model:
    return load_model("deepseek-v4")


@pytest.fixture(scope="session")
def glm() -> Model:
    return load_model("glm-4.7-flash")


@pytest.fixture(scope="session")
def qwen() -> Model:
    return load_model("qwen-3")
