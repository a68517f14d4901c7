"""Prompt encoders for models that ship Python encoders instead of Jinja chat templates
(DeepSeek V3.2 and V4). GLM and Qwen use their own templates via pdserve.tokenizer."""
from __future__ import annotations

from pdserve.frontend.encoders.dsml_render import EncodeError, thinking_from_kwargs
from pdserve.frontend.encoders.dsv4 import encode_v4
from pdserve.frontend.encoders.dsv32 import encode_v32

__all__ = ["EncodeError", "encode_v32", "encode_v4", "thinking_from_kwargs"]
