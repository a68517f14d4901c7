"""How one request wants its tokens sampled and when it stops.

Defined in ``pdserve.worker_api`` (it travels from the router to the workers as the ``params``
of /generate and /prefill, and the router never imports the engine); the engine's name for it.
"""
from __future__ import annotations

from pdserve.worker_api import SamplingParams

__all__ = ["SamplingParams"]
