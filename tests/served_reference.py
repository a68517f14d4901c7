"""transformers as the reference of the model `pdserve serve` runs by default on this CPU.

On an AVX-512 CPU the default model's Q4 layers and its Q8_0 LM head multiply activations
rounded to int16 per block of 32 (docs/cpu-kernels.md). The reference applies that rounding, with
the library's torch reference of it, to the input of the same linear layers of transformers' model
on the same weights, so tests that compare the served model with transformers keep a tight bound instead of
widening it by the rounding. Elsewhere (AVX2, `PDSERVE_INT16_ACTIVATIONS=0`) nothing changes.
"""
from __future__ import annotations

import functools

import torch
import transformers

from pdserve_kernels import cpu_lib
from pdserve_kernels.quant import round_activations_int16

# How far a served log-probability may lie from the reference's. Both sides round the same
# inputs bit for bit, but those inputs already differ in their last bits (the native kernels and
# transformers sum in other orders), and a value that close to a rounding boundary lands on the
# neighbouring int16 step (1/32767 of its block's largest value): ~100x the fp32 difference.
# Measured over 30 prompts (2,439 log-probabilities) on a Sapphire Rapids VM: max 2.2e-3, p99
# 1.1e-3; without the rounding on either side: max 1.5e-5 (docs/cpu-kernels.md).
LOGPROB_TOLERANCE = 4e-3 if cpu_lib.int16_activations() else 1e-3

# transformers' names of the linear layers the default model multiplies with int16 activations:
# the projections it holds in Q4 blocks and its LM head (tied to the Q8_0 embedding)
ROUNDED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def served_reference(model: torch.nn.Module) -> torch.nn.Module:
    """`model` (a transformers Llama on the default model's weights) with the served arithmetic:
    int16-rounded inputs to its Q4 projections and LM head when the server rounds them here."""
    if not cpu_lib.int16_activations():
        return model
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in ROUNDED_LINEARS:
            module.register_forward_pre_hook(lambda _m, args: (round_activations_int16(args[0]),))
    return model


@functools.lru_cache(maxsize=2)
def _reference_model(model_dir: str) -> torch.nn.Module:
    return served_reference(transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())


def chat_near_tie(model_dir: str, tokenizer, messages: list[dict], got: str, expected: str) -> bool:
    """Whether two greedy answers to the chat `messages` part at a near-tie of the served model: the
    first token where they differ and the other answer's token there are the reference's top two,
    within 1e-3 of each other, after the prompt and the tokens both answers share. (Kernels that
    a batch's size chooses sum in different orders; such a tie is the one place that shows.)"""
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
    a, b = tokenizer.encode(got), tokenizer.encode(expected)
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:  # one answer is the other's prefix: not two tokens at a tie
        return False
    with torch.no_grad():
        logits = _reference_model(model_dir)(torch.tensor([ids + a[:i]])).logits[0, -1]
    top = logits.topk(2)
    return set(top.indices.tolist()) == {a[i], b[i]} and float(top.values[0] - top.values[1]) < 1e-3
