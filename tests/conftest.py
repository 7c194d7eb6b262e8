"""Shared fixtures: the real Qwen tokenizer, real images and tiny random-init Qwen-VL targets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vlmspec.targets import QwenVLTarget
from vlmspec.targets.tiny import FAMILIES, qwen_tokenizer, tiny_model, tiny_processor

# Tiny models run fastest on one thread, and the machine may be shared: no oversubscription.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    return qwen_tokenizer()


@pytest.fixture(scope="session")
def make_target(tokenizer):
    """Build (and memoise) a tiny random target per family: ``make_target("qwen2_vl")``."""
    built: dict[tuple, QwenVLTarget] = {}

    def make(family: str, **overrides) -> QwenVLTarget:
        key = (family, tuple(sorted(overrides.items())))
        if key not in built:
            built[key] = QwenVLTarget(
                tiny_model(family, **overrides), tiny_processor(family, tokenizer), name=f"tiny-{family}"
            )
        return built[key]

    return make


@pytest.fixture(scope="session")
def confined_target(tokenizer) -> QwenVLTarget:
    """A tiny target confined to four tokens, for statistical tests (see stat_helpers)."""
    from stat_helpers import confined_target as build

    return build(tokenizer)


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def astronaut() -> Image.Image:
    from skimage import data

    return Image.fromarray(data.astronaut())


@pytest.fixture(scope="session")
def coffee() -> np.ndarray:
    from skimage import data

    return data.coffee()  # an H x W x 3 uint8 array: exercises the numpy input path


@pytest.fixture(params=["reference", "native"])
def sampler_path(request, monkeypatch) -> str:
    """Run a sampling test through the PyTorch reference, then through the native kernel (skipped where it
    cannot be built): ``vlmspec.sampling.native_sampling_applies`` decides which one every call takes."""
    from vlmspec import sampling
    from vlmspec.kernels import cpu_kernels

    if request.param == "reference":
        monkeypatch.setattr(sampling, "native_sampling_applies", lambda tensor: False)
    elif not cpu_kernels.kernel_available():
        pytest.skip("vlmspec's CPU kernel is not available here (no compiler, or VLMSPEC_CPU_KERNEL=0)")
    return request.param
