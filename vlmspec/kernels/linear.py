"""Linear layers for decode-sized inputs (a few rows): the fastest backend this machine has, chosen once.

Shared by the target's runner (:mod:`vlmspec.targets.packed`) and the drafter's
inference path (:class:`FastLinears`), so both read their weights through the same
kernels (:mod:`vlmspec.kernels.cpu_kernels`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vlmspec.kernels.cpu_kernels import (
    kernel_applies,
    linear_max_rows,
    pack_weight,
    packed_linear,
    packing_applies,
    skinny_linear,
)

# oneDNN reorders a weight for an expected number of rows; 8 is the verify width of a
# speculative round, and measured faster than 1 for 4-16 rows at a small cost for 1.
PACKING_ROWS = 8


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN can prepack this weight on this machine (CPU, float32, or bfloat16 with AVX-512)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear:
    """``y = x @ W.T + b`` for ``W = cat(weights)``, through the fastest backend this machine has.

    ``backend`` is chosen once:

    * ``"packed"``: vlmspec's AVX-512 kernel over a copy of ``W`` in its packed layout
      (16 outputs per vector; bfloat16 through AVX512-BF16), for up to ``max_rows`` rows;
    * ``"kernel"``: vlmspec's AVX2 matrix-vector kernel (:mod:`vlmspec.targets.cpu_kernels`)
      over the fused weight as stored, float32 or bfloat16, for up to ``max_rows`` rows;
    * ``"onednn"``: the weight reordered once for oneDNN (a CPU without the kernel);
    * ``"aten"``: plain ``F.linear`` (GPUs, bfloat16 on a CPU without native bfloat16).

    More rows than ``max_rows`` (a wide batch; :func:`~vlmspec.kernels.cpu_kernels.linear_max_rows`:
    64, or 7 in bfloat16 on an AMX CPU where the kernel runs without its tiles) go through ATen's GEMM, the better tool
    there, over the model's own weights. The native step runs its packed weights itself, up to
    :func:`~vlmspec.kernels.cpu_kernels.kernel_max_rows`.
    """

    def __init__(self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]) -> None:
        self.parts = [(w.detach(), None if b is None else b.detach()) for w, b in zip(weights, biases)]
        weight = torch.cat([w for w, _ in self.parts]) if len(weights) > 1 else self.parts[0][0]  # [N, K]
        self.bias = None
        if any(b is not None for b in biases):
            self.bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in self.parts])  # [N]
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.max_rows = linear_max_rows(weight.dtype)
        if packing_applies(weight):
            self.backend, self.weight = "packed", pack_weight(weight)
        elif kernel_applies(weight):
            self.backend, self.weight = "kernel", weight
        elif can_pack(weight):
            self.backend, self.weight = "onednn", _reorder(weight)
        else:
            self.backend, self.weight = "aten", weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [B, K] -> [B, N]
        if self.backend == "packed":
            if x.shape[0] <= self.max_rows:
                return packed_linear(x, self.weight, self.out_features, self.bias)
            return torch.cat([F.linear(x, w, b) for w, b in self.parts], dim=-1)
        if self.backend == "kernel" and x.shape[0] <= self.max_rows:
            return skinny_linear(x, self.weight, self.bias)
        if self.backend == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_ROWS)


def fused_linear(*modules: nn.Linear) -> PackedLinear:
    """One :class:`PackedLinear` over the modules' weights side by side (q/k/v, gate/up), their outputs concatenated."""
    return PackedLinear([m.weight for m in modules], [m.bias for m in modules])


class FastLinears:
    """A context in which every ``nn.Linear`` of a module runs through a :class:`PackedLinear` (inference only).

    >>> fast = FastLinears(drafter)       # once
    >>> with fast, torch.inference_mode():
    ...     drafter(...)                  # its linears read packed weights

    The packed copies live between blocks; a linear whose weight changed since it was
    packed (in place or replaced) is packed again on entry. Outside the block the modules
    are untouched: training and autograd see plain ``nn.Linear``. Where no kernel applies
    (a GPU, a CPU without AVX2) the modules keep their own forward.
    """

    def __init__(self, module: nn.Module) -> None:
        self._linears = [sub for sub in module.modules() if type(sub) is nn.Linear]
        self._packed: dict[nn.Linear, tuple[tuple[int, ...], Callable]] = {}  # stamp, packed forward
        self._patched: list[nn.Linear] = []

    def __enter__(self) -> FastLinears:
        for sub in self._linears:
            if not kernel_applies(sub.weight):
                continue
            stamp, forward = self._packed.get(sub, (None, None))
            if stamp != _stamp(sub):  # packed once, again only when the weight changed
                stamp, forward = self._packed[sub] = (_stamp(sub), _flat(fused_linear(sub)))
            sub.forward = forward
            self._patched.append(sub)
        return self

    def __exit__(self, *exc) -> None:
        for sub in self._patched:
            del sub.forward
        self._patched.clear()


def _stamp(module: nn.Linear) -> tuple[int, ...]:
    weight, bias = module.weight, module.bias
    return (weight.data_ptr(), weight._version, *((bias.data_ptr(), bias._version) if bias is not None else ()))


def _flat(linear: PackedLinear):
    """The linear over any leading dims: [..., K] -> [..., N]."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != linear.dtype:  # e.g. float32 features into a bfloat16 drafter: the module's own dtype rules
            return F.linear(x, *linear.parts[0])
        return linear(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], linear.out_features)

    return forward
