"""ScriptedForCausalLM: a model that emits exactly the token ids of its config, whatever the
prompt, then EOS — through the whole real pipeline (router → prefill → KV transfer → decode →
parser → SSE). Clients and parsers can be tested against exact model outputs with real
tokenizers.

config.json: `{"architectures": ["ScriptedForCausalLM"], "vocab_size": V, "eos_token_id": E,
"pdserve_script": [ids...]}` next to an ordinary tokenizer.json / tokenizer_config.json.

Its KV cache is real but tiny: one number per token, the script position that token reached.
A token continues the script when it is the script's next id after the previous token's
position; any other token (the prompt) resets the position to 0. So generation follows the
script exactly (a prompt that itself ends with the script's first ids would start mid-script).
"""
from __future__ import annotations

import torch
from torch import nn

from pdserve.distributed import TPGroup
from pdserve.kvcache import CacheTensorSpec
from pdserve.layers.attention import AttentionMetadata

SCRIPT_LOGIT = 100.0


class ScriptedForCausalLM(nn.Module):
    has_weights = False

    def __init__(self, hf_config: dict, tp: TPGroup = TPGroup(), quant=None):
        super().__init__()
        self.vocab_size = int(hf_config["vocab_size"])
        eos = hf_config["eos_token_id"]
        self.eos = int(eos[0] if isinstance(eos, list) else eos)
        self.script = [int(t) for t in hf_config["pdserve_script"]]
        if any(not 0 <= t < self.vocab_size for t in self.script + [self.eos]):
            raise ValueError("pdserve_script and eos_token_id must be ids below vocab_size")
        self.num_layers = 1

    def cache_spec(self, dtype: torch.dtype, index_dtype: torch.dtype | None = None
                   ) -> list[list[CacheTensorSpec]]:
        return [[CacheTensorSpec("pos", (1,), torch.float32)]]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        cache = meta.kv_caches[0]["pos"].view(-1)  # one slot per token
        block_size = meta.kv_caches[0]["pos"].shape[1]
        out = torch.zeros(len(ids), 1)
        ids_list, slots = ids.tolist(), meta.slot_mapping.tolist()
        for i in range(len(meta.context_lens)):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            first = meta.context_lens[i] - (end - start)  # position of the chunk's first token
            if first > 0:
                prev = first - 1
                pos = int(cache[int(meta.block_tables[i, prev // block_size]) * block_size + prev % block_size])
            else:
                pos = -1
            for j in range(start, end):
                pos = pos + 1 if 0 <= pos < len(self.script) and ids_list[j] == self.script[pos] else 0
                cache[slots[j]] = pos
                out[j, 0] = pos
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(hidden.shape[0], self.vocab_size)
        for row, pos in enumerate(hidden[:, 0].long().tolist()):
            logits[row, self.script[pos] if pos < len(self.script) else self.eos] = SCRIPT_LOGIT
        return logits
