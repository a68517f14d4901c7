"""The DeepSeek-V3 / V3.2 / GLM-5 Mixture-of-Experts block: a sigmoid router with group-limited
top-k, routed SwiGLU experts and always-on shared experts.

The math is transformers' `DeepseekV3MoE` (identical in `DeepseekV32MoE` and `GlmMoeDsaMoE`):

* Router, in fp32 (the gate's weight and bias stay fp32 whatever the model dtype):
  `s = sigmoid(x W^T)`. Experts are *chosen* on `s + e_score_correction_bias`: the experts form
  `n_group` groups, each scored by the sum of its two best biased scores; only the `topk_group`
  best groups compete, and the `num_experts_per_tok` best biased scores among them win. The
  *weights* are the unbiased `s` of the winners, divided by their sum (+1e-20) when
  `norm_topk_prob`, times `routed_scaling_factor`.
* Each routed expert runs in the model dtype; its output times the fp32 weight is cast back to
  the model dtype and summed into the result. The shared experts (one SwiGLU MLP of width
  `n_shared_experts * moe_intermediate_size`) see every token and are added to it.

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
gate/up load into the fused `gate_up_proj` (shard ids 0 and 1). `MoE.load_weights` (or
`MoE.target` inside a model's own loop) does the mapping and skips other ranks' experts.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pdserve.distributed import TPGroup
from pdserve.layers.activation import silu_and_mul
from pdserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pdserve.layers.quant import QuantConfig, linear_method

# checkpoint module name → (our module name, shard id of the fused gate_up_proj)
STACKED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class Router(nn.Module):
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
        # routing decisions must not depend on a bf16 rounding of the logits
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
                             f"router expects a float {tuple(target.shape)}")
        target.data.copy_(tensor.to(torch.float32))


class ExpertMLP(nn.Module):
    """SwiGLU MLP whose down projection returns its partial sum: the MoE reduces once for all.

    Routed experts are built with a size-1 group (whole on one rank), the shared experts with
    the TP group (gate/up column-parallel, down row-parallel).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, prefix: str, tp: TPGroup,
                 quant: QuantConfig | None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, tp=tp,
            method=linear_method(quant, [f"{prefix}.gate_proj", f"{prefix}.up_proj"]))
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp=tp, reduce=False,
                                           method=linear_method(quant, [f"{prefix}.down_proj"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class MoE(nn.Module):
    """Router + this rank's routed experts + TP-sharded shared experts, one all_reduce.

    `prefix` is the block's checkpoint module name (e.g. `model.layers.3.mlp`); it names the
    checkpoint modules that `quant` is asked about and the tensors `load_weights` takes.
    Layout: `gate` (Router), `experts` (ModuleDict: str(expert id) → ExpertMLP, only this
    rank's), `shared_experts` (ExpertMLP, or None when `n_shared_experts` is 0).
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
        self.gate = Router(hidden_size, n_routed_experts, num_experts_per_tok, n_group, topk_group,
                           norm_topk_prob, routed_scaling_factor)
        self.experts = nn.ModuleDict({
            str(e): ExpertMLP(hidden_size, moe_intermediate_size, f"{prefix}.experts.{e}", TPGroup(), quant)
            for e in range(self.first_expert, self.last_expert)})
        self.shared_experts = (
            ExpertMLP(hidden_size, moe_intermediate_size * n_shared_experts, f"{prefix}.shared_experts",
                      tp, quant) if n_shared_experts else None)

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
        out = torch.zeros_like(x)
        flat = ids.flatten()
        # (token, slot) pairs grouped by expert; `counts` is the one host sync per layer
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.n_routed_experts).tolist()
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        top_k = ids.shape[1]
        flat_weights = weights.flatten()
        # ascending expert order, like the reference: the same summation order at TP=1
        for e in range(self.first_expert, self.last_expert):
            if not counts[e]:
                continue
            pairs = order[starts[e]:starts[e + 1]]
            tokens = pairs // top_k
            y = self.experts[str(e)](x.index_select(0, tokens))
            # model-dtype output times the fp32 weight, rounded back once (as the reference)
            out.index_add_(0, tokens, (y * flat_weights[pairs, None]).to(x.dtype))
        return out

    # ---- loading ----------------------------------------------------------------------
    def target(self, name: str) -> tuple[nn.Module, str, object] | None:
        """(submodule, parameter, shard id) for checkpoint tensor `name` under `prefix`, or None
        for a routed expert another rank holds (its tensors are not read at all)."""
        if not name.startswith(self.prefix + "."):
            raise ValueError(f"checkpoint tensor {name} is not under {self.prefix}")
        path, _, param = name[len(self.prefix) + 1:].rpartition(".")
        parts = path.split(".")
        if parts[0] == "experts":
            expert = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else -1
            if not 0 <= expert < self.n_routed_experts:
                raise ValueError(f"checkpoint tensor {name}: not a routed expert of "
                                 f"{self.n_routed_experts} ({self.prefix})")
            if not self.owns(expert):
                return None
        leaf, shard_id = STACKED.get(parts[-1], (parts[-1], None))
        try:
            module = self.get_submodule(".".join([*parts[:-1], leaf]))
        except AttributeError:
            module = None
        if module is None or not hasattr(module, param):
            raise ValueError(f"checkpoint tensor {name} has no place in the MoE block {self.prefix}; "
                             "is the checkpoint's quantization config (or its exclude list) right?")
        return module, param, shard_id

    def load_weights(self, source, names: Iterable[str]) -> set[str]:
        """Load checkpoint tensors `names` (all under `prefix`) into this rank's part of the block.

        Returns the parameters loaded (names relative to this module) and raises when one of
        this rank's parameters got no tensor. Other ranks' experts are skipped unread.
        """
        loaded: set[str] = set()
        modules = {id(m): n for n, m in self.named_modules()}
        for name in names:
            found = self.target(name)
            if found is None:
                continue
            module, param, shard_id = found
            module.load(param, source, name, shard_id)
            loaded.add(f"{modules[id(module)]}.{param}")
        missing = sorted({n for n, _ in self.named_parameters()} - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing tensors for {self.prefix}: {missing[:8]}")
        return loaded
