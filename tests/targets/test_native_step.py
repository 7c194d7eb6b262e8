"""The native step (every decoder layer in one call) against the Python reference over the same kernels.

Both make the same kernel calls in the same order (the native one from C++), so logits,
features and KV writes must be equal bit for bit, not merely close: ``torch.equal``
throughout. Covered for both families that take the native step, float32 and bfloat16,
and ragged batches of one and of several tokens per row. The native step runs packed
(AVX-512) linears only: held to AVX2, and for Qwen3-VL (per-head q/k norms), the reference runs.
"""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.identity import first_difference, top2_logits
from vlmspec import SpecEngine
from vlmspec.drafters.prompt_lookup import PromptLookup
from vlmspec.kernels import cpu_kernels
from vlmspec.targets.packed import PackedDecoder

NATIVE_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
FEATURE_LAYERS = (2, 0)  # out of order on purpose: features come back in the order asked for
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(autouse=True)
def kernel():
    if not cpu_kernels.kernel_available():
        pytest.skip("the native step needs vlmspec's CPU kernel (x86 with AVX2 and a C++ compiler)")


@pytest.fixture
def packed_linears():
    if cpu_kernels.kernel_isa() == "avx2":
        pytest.skip("the native step runs packed linears, which need AVX-512 (on AVX2 the reference runs)")


class Slots:
    """A KV pool, the rows' block tables and each packed token's row and slot (the decoder's KVSlots)."""

    def __init__(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], tables, rows, slots, features=None
    ) -> None:
        self.keys, self.values = keys, values
        self.features = features  # [N, bs, m * d] the feature plane, or None: the decoder returns the features
        self.tables, self.rows, self.slots = tables, rows, slots  # [R, M], [B], [B] int64
        size = keys[0].shape[2]
        self.blocks, self.offsets = tables[rows, slots // size], slots % size  # [B] each
        self.native_attention = True  # these steps are a few tokens a row: the kernel's attention

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer], self.values[layer]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys[layer][self.blocks, :, self.offsets] = k
        self.values[layer][self.blocks, :, self.offsets] = v
        return self.buffers(layer)


def target_of(make_target, family: str, dtype: torch.dtype):
    return make_target(family) if dtype == torch.float32 else make_target(family, dtype=dtype)


def random_buffers(decoder: PackedDecoder, blocks: int, block_size: int, dtype: torch.dtype, seed: int):
    """Finite random keys and values in every slot, so that a wrong block or slot shows in the result."""
    generator = torch.Generator().manual_seed(seed)
    shape = (blocks, decoder.kv_heads, block_size, decoder.head_dim)
    return [torch.randn(shape, generator=generator).to(dtype) for _ in decoder.layers]


def packed_step(decoder: PackedDecoder, per_row: list[int], dtype: torch.dtype, plane: torch.Tensor | None = None):
    """One packed forward over rows with committed lengths 21, 0, 9: logits, features and the KV pool after it.

    The pool holds 8 blocks of 16 slots, and each row's two blocks are scattered over it (row 0's
    slots cross from its first block into its second), so a slot read through the wrong table entry
    shows in the result.
    """
    lengths = torch.tensor([21, 0, 9])
    tables = torch.tensor([[5, 2], [7, 0], [1, 6]])  # [R, M]
    keys = random_buffers(decoder, 8, 16, dtype, seed=1)
    values = random_buffers(decoder, 8, 16, dtype, seed=2)
    counts = torch.tensor(per_row)
    rows = torch.repeat_interleave(torch.arange(3), counts)  # [B]
    offsets = torch.arange(rows.numel()) - (torch.cumsum(counts, 0) - counts)[rows]
    slots = lengths[rows] + offsets  # [B]
    ids = torch.randint(0, 5000, (rows.numel(),), generator=torch.Generator().manual_seed(3))
    positions = slots + torch.tensor([0, 7, 2])[rows]  # rope deltas differ per row, as after an image
    visible = slots + 1

    def attend(q, k, v, scaling):  # the runner's attention wherever the kernel applies
        return cpu_kernels.paged_attention(q, k, v, tables, rows, visible, scaling)

    before = [k.clone() for k in keys]
    kv = Slots(keys, values, tables, rows, slots, plane)
    logits, features = decoder(ids, positions, kv, attend, FEATURE_LAYERS)
    return logits, features, keys, values, before, (kv.blocks, kv.offsets)


@pytest.mark.parametrize("family", NATIVE_FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("per_row", [[1, 1, 1], [3, 1, 4]], ids=["one-token-rows", "ragged-rows"])
def test_native_step_equals_the_python_reference_bit_for_bit(make_target, family, dtype, per_row, packed_linears):
    target = target_of(make_target, family, dtype)
    native, python = PackedDecoder(target.model), PackedDecoder(target.model)
    assert native.native is not None, "this family should take the native step on this machine"
    assert native.layers[0].qkv.backend == "packed"
    python.native = None
    logits, features, keys, values, before, (blocks, offsets) = packed_step(native, per_row, dtype)
    expected_logits, expected_features, expected_keys, expected_values, _, _ = packed_step(python, per_row, dtype)
    assert logits.dtype == torch.float32 and features.shape == (
        sum(per_row),
        2 * target.model.config.get_text_config().hidden_size,
    )
    assert torch.equal(logits, expected_logits)
    assert torch.equal(features, expected_features)
    for layer in range(len(keys)):
        assert torch.equal(keys[layer], expected_keys[layer]) and torch.equal(values[layer], expected_values[layer])
    written = torch.zeros(keys[0].shape[0], keys[0].shape[2], dtype=torch.bool)  # [N, bs]
    written[blocks, offsets] = True
    changed = (keys[0] != before[0]).any(dim=-1).any(dim=1)  # [N, bs]: slots whose keys the step rewrote
    assert torch.equal(changed, written)  # the new keys landed in their slots, and nowhere else


@pytest.mark.parametrize("family", NATIVE_FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_the_native_step_writes_the_hooked_features_beside_the_kv_as_the_reference_does(
    make_target, family, dtype, packed_linears
):
    """With the runner's feature plane the features land at each token's block and offset, bit for bit."""
    target = target_of(make_target, family, dtype)
    native, python = PackedDecoder(target.model), PackedDecoder(target.model)
    python.native = None
    width = len(FEATURE_LAYERS) * target.model.config.get_text_config().hidden_size
    planes = [torch.full((8, 16, width), 7.0, dtype=dtype) for _ in range(2)]  # [N, bs, m * d]: 7 where unwritten
    per_row = [3, 1, 4]
    _, returned, *_ = packed_step(native, per_row, dtype)
    logits, none, _, _, _, (blocks, offsets) = packed_step(native, per_row, dtype, planes[0])
    expected_logits, also_none, *_ = packed_step(python, per_row, dtype, planes[1])
    assert none is None and also_none is None and torch.equal(logits, expected_logits)
    assert torch.equal(planes[0], planes[1])
    assert torch.equal(planes[0][blocks, offsets], returned)  # what the step returns without a plane
    untouched = torch.ones(8, 16, dtype=torch.bool)
    untouched[blocks, offsets] = False
    assert planes[0][untouched].eq(7).all()


def test_qwen3_vl_keeps_the_python_reference_and_the_others_take_the_native_step(make_target, packed_linears):
    assert make_target("qwen3_vl").packed_decoder().native is None  # per-head q/k norms sit between qkv and RoPE
    for family in NATIVE_FAMILIES:
        assert make_target(family).packed_decoder().native is not None


def test_held_to_avx2_the_reference_runs(make_target, monkeypatch):
    """Linears on the AVX2 kernel (weights as stored) are not the native step's: the reference runs them."""
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx2")  # read at packing and at every kernel call
    decoder = PackedDecoder(make_target("qwen2_vl").model)
    assert decoder.native is None and decoder.backend == "kernel"


def test_without_the_kernel_there_is_no_native_step(make_target, monkeypatch):
    monkeypatch.setenv(cpu_kernels.KERNEL_ENV, "0")
    cpu_kernels.kernel_available.cache_clear()
    try:
        decoder = PackedDecoder(make_target("qwen2_vl").model)
        assert decoder.native is None and decoder.backend in ("onednn", "aten")
    finally:
        monkeypatch.delenv(cpu_kernels.KERNEL_ENV)
        cpu_kernels.kernel_available.cache_clear()


@pytest.mark.parametrize("family", NATIVE_FAMILIES)
def test_greedy_speculation_is_the_target_alone_and_the_python_reference_up_to_bf16_ties(
    make_target, family, astronaut, packed_linears
):
    target = target_of(make_target, family, torch.bfloat16)
    engine = SpecEngine(target, PromptLookup(max_draft_tokens=4))
    picture = astronaut.resize((64, 64))
    prompt = "Repeat after me: one two three four five. Repeat after me: one two three four five."
    decoder = target.packed_decoder()
    assert decoder.native is not None
    native = engine.generate(picture, prompt, max_new_tokens=20)
    alone = engine.generate(picture, prompt, max_new_tokens=20, speculative=False)
    loop, decoder.native = decoder.native, None
    try:
        python = engine.generate(picture, prompt, max_new_tokens=20)
    finally:
        decoder.native = loop
    assert target.packed_decoder() is decoder  # the same packed weights ran both loops
    inputs = target.build_inputs(picture, prompt)
    assert_same_or_split_at_a_bf16_tie(target, inputs, alone.token_ids, native.token_ids)
    assert_same_or_split_at_a_bf16_tie(target, inputs, alone.token_ids, python.token_ids)


def assert_same_or_split_at_a_bf16_tie(target, inputs, expected: list[int], got: list[int]) -> None:
    """``got`` is ``expected`` token for token, or first differs where the target's top two logits tie in bf16.

    A verify forward sums a row's products in another order than a one-token step, so where
    the two best logits lie within two bf16 ulps of each other either may win: a tie, not an
    error. (Random tiny models meet such ties; on one CPU this prompt met one at token 13.)
    Anywhere else a difference is a bug.
    """
    if got == expected:
        return
    at = first_difference(expected, got)
    best, second = top2_logits(target, inputs, expected[:at])
    bound = 2 * _bf16_ulp(best)
    assert best - second <= bound, f"outputs differ at token {at}, where the top-2 margin {best - second} > {bound}"


def _bf16_ulp(value: float) -> float:
    """The spacing of bfloat16 numbers at ``value`` (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(value), 2.0**-126))) - 7)
