"""The DeepSeek-V3 / V3.2 / GLM-5 Mixture-of-Experts block: a sigmoid router with group-limited
top-k, routed SwiGLU experts and always-on shared experts.

The math is transformers' `DeepseekV3MoE` (identical in `DeepseekV32MoE` and `GlmMoeDsaMoE`):

* MoEGate, the gate that routes tokens to experts, in fp32 (its weight and bias stay fp32
  whatever the model dtype): `s = sigmoid(x W^T)`. Experts are *chosen* on
  `s + e_score_correction_bias`: the experts form `n_group` groups, each scored by the sum of
  its two best biased scores; only the `topk_group` best groups compete, and the
  `num_experts_per_tok` best biased scores among them win. The *weights* are the unbiased `s`
  of the winners, divided by their sum (+1e-20) when `norm_topk_prob`, times
  `routed_scaling_factor`.
* Each routed expert runs in the model dtype; its outputs times the fp32 weights are summed
  in fp32 and rounded to the model dtype once, as transformers' default experts path
  (`grouped_mm`) does (its eager loop instead rounds every contribution before adding it).
  The shared experts (one SwiGLU MLP of width `n_shared_experts * moe_intermediate_size`) see
  every token; their output is added in the model dtype.

Tensor parallelism: expert parallelism inside the TP group, not TP-sharded experts. After
attention every TP rank holds every token, so rank r runs the contiguous block of experts
`[r E/N, (r+1) E/N)` on all the tokens routed to them, adds its slice of the TP-sharded shared
experts (column/row-parallel, with the row-parallel sum left undone), and ONE all_reduce adds
the partial outputs of all ranks. That is the collective a TP-sharded MoE needs too, but here
each rank reads and holds only 1/N of the experts, each expert's matmuls keep their full shape
(moe_intermediate_size is not cut to 2048/N, which matters for the NVFP4 GEMM tiles and their
alignment), and an expert that got no token costs a rank nothing. The price is balance: a rank
whose experts are popular in a batch works longer; with many tokens per step it evens out.

Checkpoint names (per expert, as transformers' save_pretrained and real checkpoints write them):
`{prefix}.gate.weight`, `{prefix}.gate.e_score_correction_bias`,
`{prefix}.experts.{e}.{gate,up,down}_proj.*`, `{prefix}.shared_experts.{gate,up,down}_proj.*`;
gate/up load into the fused `gate_up_proj` (shard ids 0 and 1), the rest 1:1, through each
submodule's `load(param, source, name, shard_id)`. Only this rank's experts exist here, so a
loader skips the tensors of experts `owns` is False for (`load_weights` does all of this for
one block).
"""
from __future__ import annotations

from collections.abc import Iterable
from itertools import accumulate

import torch
from torch import nn

from pdserve.distributed import TPGroup
from pdserve.layers.mlp import GatedMLP
from pdserve.layers.quant import QuantConfig
from pdserve.weights.loading import load_tensors, require_loaded, stacked_target

# checkpoint module name → (our module name, shard id of the fused gate_up_proj)
STACKED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class MoEGate(nn.Module):
    """The MoE gate: which experts each token goes to, and with what weight (all in fp32)."""

    PARAMS = ("weight", "e_score_correction_bias")

    def __init__(self, hidden_size: int, n_experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float):
        super().__init__()
        if n_group < 1 or n_experts % n_group:
            raise ValueError(f"{n_experts} routed experts do not form n_group={n_group} equal groups")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group={topk_group} must be between 1 and n_group={n_group}")
        group_size = n_experts // n_group
        if topk_group < n_group and group_size < 2:
            raise ValueError(f"groups of {group_size} expert: a group is scored by its top-2 experts")
        if not 1 <= top_k <= topk_group * group_size:
            raise ValueError(f"num_experts_per_tok={top_k} exceeds the {topk_group * group_size} "
                             "experts of the chosen groups")
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        # fp32 whatever the model dtype, as transformers keeps them (_keep_in_fp32_modules_strict):
        # routing decisions must not depend on a bf16 rounding of the logits. The bias is a
        # parameter (a buffer in transformers) so that a loader's missing-tensor check covers it.
        self.weight = nn.Parameter(torch.empty(n_experts, hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] → (weights [T, top_k] fp32, expert ids [T, top_k] int64)."""
        scores = torch.nn.functional.linear(x.float(), self.weight).sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.topk_group < self.n_group:  # with every group allowed the mask is all ones
            groups = choice.view(choice.shape[0], self.n_group, choice.shape[1] // self.n_group)
            group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)
            best = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids

    def load(self, param: str, source, name: str, shard_id: object = None) -> None:
        """Copy checkpoint tensor `name` (whole: the router is replicated) into `param`."""
        if param not in self.PARAMS:
            raise ValueError(f"checkpoint tensor {name}: the MoE router gate is not quantized in "
                             f"pdserve (it takes {' and '.join(self.PARAMS)}); list the gate in the "
                             "quantization config's exclude/ignore list")
        tensor = source.get(name)
        target = getattr(self, param)
        if not tensor.is_floating_point() or tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"checkpoint tensor {name} is {tensor.dtype} {tuple(tensor.shape)}; the "
                             f"router expects an unquantized float {tuple(target.shape)}")
        target.data.copy_(tensor.to(torch.float32))


class MoE(nn.Module):
    """MoEGate + this rank's routed experts + TP-sharded shared experts, one all_reduce.

    `prefix` is the block's checkpoint module name (e.g. `model.layers.3.mlp`); it names the
    checkpoint modules that `quant` is asked about and the tensors `load_weights` takes.
    Layout: `gate` (MoEGate), `experts` (ModuleDict: str(expert id) → GatedMLP, only this
    rank's, whole), `shared_experts` (GatedMLP, TP-sharded; None when `n_shared_experts` is
    0). Neither reduces its down projection: `forward` sums everything with one all_reduce.
    """

    def __init__(self, hidden_size: int, moe_intermediate_size: int, n_routed_experts: int,
                 num_experts_per_tok: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                 routed_scaling_factor: float, n_shared_experts: int, prefix: str,
                 tp: TPGroup = TPGroup(), quant: QuantConfig | None = None):
        super().__init__()
        if n_routed_experts % tp.size:
            raise ValueError(f"{n_routed_experts} routed experts do not split evenly over TP size "
                             f"{tp.size} (expert parallelism places E/N whole experts on each rank)")
        self.prefix = prefix
        self.tp = tp
        self.n_routed_experts = n_routed_experts
        self.first_expert, self.last_expert = tp.shard(n_routed_experts)  # contiguous: same on every run
        self.gate = MoEGate(hidden_size, n_routed_experts, num_experts_per_tok, n_group, topk_group,
                           norm_topk_prob, routed_scaling_factor)
        # a routed expert is whole on its rank: a size-1 group, so nothing is sharded or reduced
        self.experts = nn.ModuleDict({
            str(e): GatedMLP(hidden_size, moe_intermediate_size, f"{prefix}.experts.{e}", TPGroup(),
                             quant, reduce=False)
            for e in range(self.first_expert, self.last_expert)})
        self.shared_experts = (
            GatedMLP(hidden_size, moe_intermediate_size * n_shared_experts, f"{prefix}.shared_experts",
                     tp, quant, reduce=False) if n_shared_experts else None)

    def owns(self, expert: int) -> bool:
        """Whether this rank holds routed expert `expert`."""
        return self.first_expert <= expert < self.last_expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden] → [tokens, hidden], summed over the TP group."""
        weights, ids = self.gate(x)
        out = self._routed(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts over the tokens routed to them; one matmul pair per busy expert."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat = ids.flatten()
        # (token, slot) pairs grouped by expert; `counts` is the one host sync per layer
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.n_routed_experts).tolist()
        starts = [0, *accumulate(counts)]
        top_k = ids.shape[1]
        flat_weights = weights.flatten()
        # fixed (ascending) expert order, and no token twice in one index_add_: the same sums
        # on every run, on a GPU too
        for e in range(self.first_expert, self.last_expert):
            if not counts[e]:
                continue
            pairs = order[starts[e]:starts[e + 1]]
            tokens = pairs // top_k
            y = self.experts[str(e)](x.index_select(0, tokens))
            out.index_add_(0, tokens, y.float() * flat_weights[pairs, None])
        return out.to(x.dtype)

    # ---- loading ----------------------------------------------------------------------
    def load_weights(self, source, names: Iterable[str]) -> None:
        """Load checkpoint tensors `names` (all under `prefix`) into this rank's part of the block.

        The mapping a model's own loader uses too: gate_proj/up_proj into `gate_up_proj` (shard
        ids 0/1), everything else 1:1; tensors of experts this rank does not own are skipped
        unread. Raises when a tensor has no place or a parameter of this rank got none.
        """
        mine = []
        for name in names:
            parts = name.removeprefix(self.prefix + ".").split(".")
            if parts[0] == "experts" and len(parts) == 4 and parts[1].isdigit():
                expert = int(parts[1])
                if expert >= self.n_routed_experts:
                    raise ValueError(f"checkpoint tensor {name}: expert {expert} of "
                                     f"{self.n_routed_experts} routed experts")
                if not self.owns(expert):
                    continue  # another rank's
            mine.append(name)
        loaded = load_tensors(self, source, mine,
                              lambda n: stacked_target(n.removeprefix(self.prefix + "."), STACKED))
        require_loaded(self, loaded, self.prefix)
