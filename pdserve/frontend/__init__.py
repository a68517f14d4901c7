"""The router: the OpenAI-compatible API in front of prefill and decode workers.

Where things are: ``app`` (FastAPI app, routes, error mapping) · ``middleware`` (request id, API
key, body limit) · ``protocol`` (request models) · ``prompts`` (tokenization, chat template) ·
``params`` (sampling settings, context check) · ``chat`` / ``completions`` (the two endpoints) ·
``serving`` (JSON or SSE answer) · ``generation`` (a request's choices) · ``choice`` (one
choice's PD flow) · ``output`` (token ids → deltas: the hook for the token-ID parsers) ·
``batching`` (stream batching) · ``render`` (response bodies and chunks) · ``workers`` (health,
load, selection) · ``backend`` (HTTP calls to workers) · ``server`` (the process's one server
object) · ``metrics`` · ``cli`` (`pdserve router`, `pdserve serve` flags) · ``encoders``
(DeepSeek prompt encoders). Nothing here imports the engine: workers are other processes.

Kept free of imports so that ``pdserve.frontend.encoders`` stays light.
"""
