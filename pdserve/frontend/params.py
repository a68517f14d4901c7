"""OpenAI request fields → one ``SamplingParams`` per choice, and the context-length check."""
from __future__ import annotations

import dataclasses
from typing import Any

from pdserve.engine.sampling_params import SamplingParams
from pdserve.frontend.errors import context_too_long, invalid
from pdserve.frontend.protocol import GenerationFields

SEED_MODULUS = 2**63  # torch generators take non-negative 64-bit seeds; keep clear of the sign bit


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, param: str) -> int:
    """The output budget: as requested if prompt + output fit the context, else 400 with numbers.

    With no request (chat's default) the budget is whatever the context leaves.
    """
    if prompt_len >= max_model_len:
        raise context_too_long(max_model_len, prompt_len, requested, param)
    if requested is None:
        return max_model_len - prompt_len
    if prompt_len + requested > max_model_len:
        raise context_too_long(max_model_len, prompt_len, requested, param)
    return requested


def sampling_params(req: GenerationFields, max_tokens: int, logprobs: int | None,
                    vocab_size: int) -> SamplingParams:
    """The request's sampling settings, checked; seeds are normalised, not yet per choice."""
    bias = {int(k): float(v) for k, v in (req.logit_bias or {}).items()}
    bad = [t for t in bias if not 0 <= t < vocab_size]
    if bad:
        raise invalid(f"logit_bias names token id {bad[0]}, outside the vocabulary [0, {vocab_size})",
                      "logit_bias")
    stop_ids = list(req.stop_token_ids or [])
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise invalid(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(req.top_k or 0, 0),
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=bias,
        seed=None if req.seed is None else req.seed % SEED_MODULUS,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        stop_token_ids=stop_ids,
        stop=req.stop_list(),
        logprobs=logprobs,
    )
    try:
        params.validate()
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise invalid(str(e), field if hasattr(params, field) else None) from None
    return params


def expand_choices(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n copies; with a seed, choice i gets seed + i so the choices differ yet reproduce."""
    if params.seed is None:
        return [dataclasses.replace(params) for _ in range(n)]
    return [dataclasses.replace(params, seed=(params.seed + i) % SEED_MODULUS) for i in range(n)]


def worker_params(params: SamplingParams) -> dict[str, Any]:
    """The fields a worker takes (worker_api.md); stop strings stay with the router."""
    body = dataclasses.asdict(params)
    body.pop("stop", None)
    body["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    return body
