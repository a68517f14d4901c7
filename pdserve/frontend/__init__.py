"""The router: the OpenAI-compatible API in front of prefill and decode workers.

One request, in the order it runs: ``app`` (middleware, routes, error mapping) → ``requests``
(its life: prompt → choices → events → JSON or SSE; sampling settings; drain tracking) →
``prompts`` (tokenization, chat templates; DeepSeek ``encoders``) and ``tools`` (what tools and
tool_choice mean) → ``choices`` (each choice across its workers, stream batching) →
``workers`` (the pool: health, load, which worker gets a request) and ``worker_client`` (the
typed client of ``pdserve.worker_api``, the contract with the workers) → ``output`` (token ids
→ deltas: the token-ID parsers) → ``render`` (OpenAI bodies, chunks, SSE). Beside it:
``protocol`` (OpenAI request models), ``errors`` (OpenAI error objects), ``server`` (the
router process: lifecycle, health, drain), ``config``, ``discovery`` (workers from DNS),
``cli`` (`pdserve router`). Nothing here imports the engine: workers are other processes.

Kept free of imports so that ``pdserve.frontend.encoders`` stays light.
"""
