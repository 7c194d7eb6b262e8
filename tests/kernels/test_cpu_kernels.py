import warnings

import pytest
import torch

from vlmspec.kernels import cpu_kernels

# The kernels exist only on x86 CPUs with AVX2 and a C++ compiler; elsewhere the runner falls back to
# oneDNN/ATen, which test_packed.py covers, and the fallback itself is tested below on every machine.
needs_kernel = pytest.mark.skipif(
    not cpu_kernels.kernel_available(),
    reason="vlmspec's CPU kernels need an x86 CPU with AVX2 plus g++ and ninja; this machine uses the fallback",
)


@needs_kernel
@pytest.mark.parametrize("isa", ["native", "avx2"])  # native: the AVX-512 kernels where the CPU has them
@pytest.mark.parametrize(
    "dtype,x_dtype", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)]
)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 33])
def test_the_kernel_computes_x_times_w_transposed_plus_bias(dtype, x_dtype, rows, isa, monkeypatch):
    if isa == "avx2":
        monkeypatch.setenv("VLMSPEC_CPU_ISA", "avx2")
    generator = torch.Generator().manual_seed(rows)
    # 37 outputs and 45 inputs: a partial tile of rows of W, and a K that is not a multiple of 8, 16 or 32.
    for n, k, with_bias in ((37, 45, True), (64, 576, False), (1000, 96, True), (9, 1536, False)):
        weight = torch.randn(n, k, generator=generator).to(dtype)
        x = torch.randn(rows, k, generator=generator).to(x_dtype)
        bias = torch.randn(n, generator=generator).to(dtype) if with_bias else None
        expected = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
        result = cpu_kernels.skinny_linear(x, weight, bias)
        assert result.dtype == x_dtype and result.shape == (rows, n)
        # float32 sums in another order than float64; bfloat16 adds one rounding of the output.
        tolerance = 1e-4 * k**0.5 if dtype == torch.float32 else 1e-2 * expected.abs().max().item()
        torch.testing.assert_close(
            result.double(), expected, atol=tolerance, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5
        )


@needs_kernel
def test_the_kernel_reads_a_non_contiguous_weight_as_its_values():
    weight = torch.randn(40, 64).T  # [64, 40], a transposed view
    x = torch.randn(2, 40)
    torch.testing.assert_close(cpu_kernels.skinny_linear(x, weight), x @ weight.T, atol=1e-4, rtol=1e-5)


def test_a_kernel_that_cannot_be_built_falls_back_with_a_warning_that_names_the_fix(monkeypatch):
    def fail():
        raise OSError("g++: not found")

    monkeypatch.setattr(cpu_kernels, "_build_and_load", fail)
    monkeypatch.setattr(cpu_kernels, "_cpu_has_avx2", lambda: True)
    monkeypatch.delenv(cpu_kernels.KERNEL_ENV, raising=False)
    with pytest.warns(RuntimeWarning, match="apt install g\\+\\+"):
        assert cpu_kernels.kernel_available.__wrapped__() is False


def test_the_kernel_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(cpu_kernels.KERNEL_ENV, "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_kernels.kernel_available.__wrapped__() is False


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_computes_what_the_qwen_vl_module_computes(dtype):
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRMSNorm

    module = Qwen2VLRMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.rand(96, generator=torch.Generator().manual_seed(1)) + 0.5)
    x = (3 * torch.randn(5, 4, 96, generator=torch.Generator().manual_seed(2))).to(dtype)  # [..., d], per head too
    with torch.no_grad():
        expected = module(x)
    result = cpu_kernels.rms_norm(x, module.weight, module.variance_epsilon)
    assert result.dtype == dtype and result.shape == x.shape
    # The same roundings in the same order; only the sum of squares may add in another order.
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3  # bfloat16: at most one rounding step
    torch.testing.assert_close(result.float(), expected.float(), rtol=tolerance, atol=tolerance)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_sdpa_over_each_rows_visible_slots(dtype):
    generator = torch.Generator().manual_seed(0)
    rows_cap, kv_heads, slots, head_dim, heads = 3, 2, 40, 16, 6  # grouped heads: 3 queries per KV head
    keys = torch.randn(rows_cap, kv_heads, slots, head_dim, generator=generator).to(dtype)
    values = torch.randn(rows_cap, kv_heads, slots, head_dim, generator=generator).to(dtype)
    rows = torch.tensor([0, 0, 0, 2, 1])  # a 3-token verify in row 0, one token in rows 2 and 1
    visible = torch.tensor([10, 11, 12, 40, 1])
    query = torch.randn(5, heads, head_dim, generator=generator).to(dtype)
    result = cpu_kernels.decode_attention(query, keys, values, rows, visible, 0.25)
    assert result.shape == query.shape and result.dtype == dtype
    for b in range(5):
        n = int(visible[b])
        expected = torch.nn.functional.scaled_dot_product_attention(
            query[b, :, None].float(),  # [H, 1, hd]
            keys[rows[b], :, :n].float().repeat_interleave(3, dim=0),
            values[rows[b], :, :n].float().repeat_interleave(3, dim=0),
            scale=0.25,
        )[:, 0]
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(result[b].float(), expected, atol=tolerance, rtol=tolerance)


@needs_kernel
@pytest.mark.parametrize("isa", ["native", "avx2"])  # native: the AVX512-BF16 form where the CPU has it
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 14, 2), (32, 7, 1), (40, 4, 2)])
def test_decode_attention_gives_a_token_the_same_result_alone_and_in_a_verify(
    isa, head_dim, heads, kv_heads, monkeypatch
):
    # Speculation is lossless only if a token's attention does not depend on the tokens beside it:
    # a one-token step and an 8-token verify split their work differently (heads alone, or up to
    # three heads of a KV head together) but must compute every head alike. And SDPA's values.
    if isa == "avx2":
        monkeypatch.setenv("VLMSPEC_CPU_ISA", "avx2")
    generator = torch.Generator().manual_seed(head_dim)
    slots = 300
    keys = torch.randn(2, kv_heads, slots, head_dim, generator=generator).bfloat16()
    values = torch.randn(2, kv_heads, slots, head_dim, generator=generator).bfloat16()
    query = (torch.randn(8, heads, head_dim, generator=generator) * 2).bfloat16()
    rows = torch.tensor([1] * 7 + [0])
    visible = torch.tensor([257, 258, 259, 260, 261, 262, 263, 17])
    scaling = head_dim**-0.5
    together = cpu_kernels.decode_attention(query, keys, values, rows, visible, scaling)
    assert together.dtype == torch.bfloat16 and together.shape == query.shape
    for b in range(8):
        alone = cpu_kernels.decode_attention(
            query[b : b + 1], keys, values, rows[b : b + 1], visible[b : b + 1], scaling
        )
        assert torch.equal(alone[0], together[b])
        n, group = int(visible[b]), heads // kv_heads
        expected = torch.nn.functional.scaled_dot_product_attention(
            query[b, :, None].double(),
            keys[rows[b], :, :n].double().repeat_interleave(group, dim=0),
            values[rows[b], :, :n].double().repeat_interleave(group, dim=0),
            scale=scaling,
        )[:, 0]
        torch.testing.assert_close(together[b].double(), expected, atol=1e-2, rtol=1e-2)


@needs_kernel
@pytest.mark.parametrize("isa", ["native", "avx2"])  # native: the AVX512-BF16 form where the CPU has it
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (32, 7, 1), (40, 4, 2)])
@pytest.mark.parametrize("block_size", [16, 64])
def test_paged_attention_equals_decode_attention_over_the_same_slots_bit_for_bit(
    isa, dtype, head_dim, heads, kv_heads, block_size, monkeypatch
):
    # The runner's pool: each row's slots in blocks scattered over the pool. Read through the block
    # tables, the attention must sum the same slots in the same order as over a contiguous row.
    if isa == "avx2":
        monkeypatch.setenv("VLMSPEC_CPU_ISA", "avx2")
    generator = torch.Generator().manual_seed(head_dim + block_size)
    slots = 200
    keys = torch.randn(2, kv_heads, slots, head_dim, generator=generator).to(dtype)  # [R, Hkv, S, hd]
    values = torch.randn(2, kv_heads, slots, head_dim, generator=generator).to(dtype)
    width = -(-slots // block_size)
    blocks = torch.randperm(2 * width + 3, generator=generator)[: 2 * width].view(2, width)  # [R, M]
    pool_k = torch.randn(2 * width + 3, kv_heads, block_size, head_dim, generator=generator).to(dtype)
    pool_v = torch.randn(2 * width + 3, kv_heads, block_size, head_dim, generator=generator).to(dtype)
    for row in range(2):
        for j in range(slots):
            pool_k[blocks[row, j // block_size], :, j % block_size] = keys[row, :, j]
            pool_v[blocks[row, j // block_size], :, j % block_size] = values[row, :, j]
    query = torch.randn(9, heads, head_dim, generator=generator).to(dtype)
    rows = torch.tensor([1] * 7 + [0, 0])
    visible = torch.tensor([15, 16, 17, 63, 64, 65, 200, 1, 129])
    expected = cpu_kernels.decode_attention(query, keys, values, rows, visible, head_dim**-0.5)
    paged = cpu_kernels.paged_attention(query, pool_k, pool_v, blocks, rows, visible, head_dim**-0.5)
    assert torch.equal(paged, expected)
    alone = cpu_kernels.paged_attention(query[6:7], pool_k, pool_v, blocks, rows[6:7], visible[6:7], head_dim**-0.5)
    assert torch.equal(alone[0], expected[6])  # one token alone: another thread split, the same sums


@needs_kernel
def test_paged_attention_refuses_blocks_it_cannot_read_and_tables_outside_the_pool():
    pool = torch.zeros(4, 1, 24, 8)  # 24 slots a block: not a power of two
    tables = torch.tensor([[0, 1]])
    with pytest.raises(RuntimeError, match="power of two"):
        cpu_kernels.paged_attention(
            torch.zeros(1, 1, 8), pool, pool, tables, torch.tensor([0]), torch.tensor([30]), 1.0
        )
    pool = torch.zeros(4, 1, 16, 8)
    with pytest.raises(RuntimeError, match="not in the pool"):
        cpu_kernels.paged_attention(
            torch.zeros(1, 1, 8), pool, pool, torch.tensor([[0, 9]]), torch.tensor([0]), torch.tensor([30]), 1.0
        )


@needs_kernel
def test_decode_attention_refuses_a_row_outside_the_buffer():
    keys = torch.zeros(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.decode_attention(torch.zeros(1, 1, 8), keys, keys, torch.tensor([1]), torch.tensor([2]), 1.0)


@needs_kernel
def test_decode_attention_softmax_is_exact_to_float32_rounding_over_a_wide_range_of_scores():
    # Scores from -100 to +100 exercise the vectorised exp (flushed below -87 from the max) in full blocks of 8.
    keys = torch.linspace(-1, 1, 64)[:, None].repeat(1, 8)[None, None]  # [1, 1, 64, 8]
    values = torch.randn(1, 1, 64, 8, generator=torch.Generator().manual_seed(1))
    query = torch.full((1, 1, 8), 12.5)
    result = cpu_kernels.decode_attention(query, keys, values, torch.tensor([0]), torch.tensor([64]), 1.0)
    expected = torch.softmax((keys[0, 0] @ query[0, 0]).double(), dim=0) @ values[0, 0].double()
    torch.testing.assert_close(result[0, 0].double(), expected, atol=1e-6, rtol=1e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_rounds_as_the_eager_rotation_and_writes_k_and_v_into_their_slots(dtype):
    from vlmspec.targets.packed import _rotate

    generator = torch.Generator().manual_seed(2)
    heads, kv_heads, head_dim, tokens = 4, 2, 16, 3
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    angles = torch.rand(tokens, head_dim, generator=generator) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    keys, values = (
        torch.zeros(2, kv_heads, 8, head_dim, dtype=dtype),
        torch.zeros(2, kv_heads, 8, head_dim, dtype=dtype),
    )
    rows, slots = torch.tensor([1, 1, 0]), torch.tensor([5, 6, 2])
    q = cpu_kernels.rope_write(qkv, cos, sin, keys, values, rows, slots, heads)
    qk = _rotate(qkv[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim), cos[:, None], sin[:, None])
    assert torch.equal(q, qk[:, :heads])  # bit for bit: the same roundings in the same order
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    for b in range(tokens):
        assert torch.equal(keys[rows[b], :, slots[b]], qk[b, heads:])
        assert torch.equal(values[rows[b], :, slots[b]], v[b])
    assert int((keys != 0).any(dim=-1).sum()) == tokens * kv_heads  # nothing else written


needs_packing = pytest.mark.skipif(
    not cpu_kernels.kernel_available() or not cpu_kernels.kernel_isa().startswith("avx512"),
    reason="the packed linears need AVX-512 (AVX512-BF16 for bfloat16); PackedLinear uses the AVX2 kernel here",
)


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 17])
def test_packed_linear_computes_x_times_w_transposed_plus_bias(dtype, rows):
    if dtype == torch.bfloat16 and cpu_kernels.kernel_isa() != "avx512_bf16":
        pytest.skip("bfloat16 packing needs AVX512-BF16")
    generator = torch.Generator().manual_seed(rows)
    # Partial blocks of 16 outputs, groups of 1-4 blocks, and an odd K (a padded bfloat16 pair).
    for n, k, with_bias in ((37, 45, True), (64, 576, False), (1000, 96, True), (16, 7, False), (120, 33, True)):
        weight = torch.randn(n, k, generator=generator).to(dtype)
        x = torch.randn(rows, k, generator=generator).to(dtype)
        bias = torch.randn(n, generator=generator).to(dtype) if with_bias else None
        expected = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
        result = cpu_kernels.packed_linear(x, cpu_kernels.pack_weight(weight), n, bias)
        assert result.dtype == dtype and result.shape == (rows, n)
        tolerance = 1e-4 * k**0.5 if dtype == torch.float32 else 1e-2 * expected.abs().max().item()
        torch.testing.assert_close(
            result.double(), expected, atol=tolerance, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5
        )


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_computes_each_row_as_it_would_alone_with_a_float32_bias(dtype):
    # Tiles of 1-8 rows and 1-4 blocks, split over the threads by blocks: a row's outputs are the
    # same fused multiply-adds whatever else is in the call (a decode and a verify agree bit for bit).
    if dtype == torch.bfloat16 and cpu_kernels.kernel_isa() != "avx512_bf16":
        pytest.skip("bfloat16 packing needs AVX512-BF16")
    generator = torch.Generator().manual_seed(5)
    for n, k in ((960, 576), (36 * 16 + 5, 64), (49, 1536)):
        weight = torch.randn(n, k, generator=generator).to(dtype)
        bias = torch.randn(n, generator=generator)  # float32 whatever the activations are
        packed = cpu_kernels.pack_weight(weight)
        x = torch.randn(11, k, generator=generator).to(dtype)
        together = cpu_kernels.packed_linear(x, packed, n, bias)
        for m in range(11):
            assert torch.equal(cpu_kernels.packed_linear(x[m : m + 1], packed, n, bias)[0], together[m])
        sums = cpu_kernels.packed_linear(x, packed, n).float()  # bias added in float32, then rounded once
        if dtype == torch.float32:
            assert torch.equal(together, sums + bias)
        expected = x.double() @ weight.double().T + bias.double()
        tolerance = 1e-4 * k**0.5 if dtype == torch.float32 else 1e-2 * expected.abs().max().item()
        torch.testing.assert_close(together.double(), expected, atol=tolerance, rtol=1e-2)


needs_amx = pytest.mark.skipif(
    not cpu_kernels.kernel_available() or not cpu_kernels.kernel_uses_amx(),
    reason="the AMX tile path needs a CPU with AMX-BF16, Linux's permission and a compiler that knows AMX",
)
# K: a partial last chunk of 32 (odd: a padded pair), one chunk, several chunks and a partial one;
# N: a partial block of 16, groups of 1-4 blocks of outputs.
AMX_SHAPES = ((37, 45), (16, 32), (200, 96), (49, 1000))
AMX_ROWS = (1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 63, 64)


@needs_amx
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_amx_packed_linear_computes_x_times_w_transposed_plus_bias(with_bias):
    generator = torch.Generator().manual_seed(7)
    for n, k in AMX_SHAPES:
        weight = torch.randn(n, k, generator=generator).to(torch.bfloat16)
        bias = torch.randn(n, generator=generator).to(torch.bfloat16) if with_bias else None
        packed = cpu_kernels.pack_weight(weight)
        for rows in range(1, 65):
            x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
            expected = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
            result = cpu_kernels.packed_linear(x, packed, n, bias)
            assert result.dtype == torch.bfloat16 and result.shape == (rows, n)
            tolerance = 1e-2 * expected.abs().max().item()  # the bfloat16 tolerance of the tests above
            torch.testing.assert_close(result.double(), expected, atol=tolerance, rtol=1e-2)


@needs_amx
def test_amx_packed_linear_computes_each_row_as_it_would_alone_on_any_thread_count():
    # Every bfloat16 call takes the tiles from one row on, the chunks of 16 rows overlap at the end of
    # a call, and a tile's rows are independent sums: a decode and a verify agree bit for bit.
    generator = torch.Generator().manual_seed(8)
    threads = torch.get_num_threads()
    for n, k in AMX_SHAPES:
        weight = torch.randn(n, k, generator=generator).to(torch.bfloat16)
        bias = torch.randn(n, generator=generator)  # float32, added before the one rounding
        packed = cpu_kernels.pack_weight(weight)
        x = torch.randn(64, k, generator=generator).to(torch.bfloat16)
        alone = torch.cat([cpu_kernels.packed_linear(x[m : m + 1], packed, n, bias) for m in range(64)])
        for rows in AMX_ROWS:
            first = 64 - rows  # the last rows, so that each row also sits at another place in its tile
            assert torch.equal(cpu_kernels.packed_linear(x[first:], packed, n, bias), alone[first:])
        try:
            torch.set_num_threads(2)
            assert torch.equal(cpu_kernels.packed_linear(x, packed, n, bias), alone)
        finally:
            torch.set_num_threads(threads)


@needs_amx
def test_held_off_the_tiles_bfloat16_runs_vdpbf16ps_and_goes_to_aten_sooner(monkeypatch):
    generator = torch.Generator().manual_seed(9)
    weight = torch.randn(300, 1000, generator=generator).to(torch.bfloat16)
    x = torch.randn(9, 1000, generator=generator).to(torch.bfloat16)
    packed = cpu_kernels.pack_weight(weight)
    tiles = cpu_kernels.packed_linear(x, packed, 300)
    assert cpu_kernels.kernel_max_rows(torch.bfloat16) == cpu_kernels.linear_max_rows(torch.bfloat16) == 64
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx512_bf16")  # read at every kernel call
    assert not cpu_kernels.kernel_uses_amx() and cpu_kernels.kernel_isa() == "avx512_bf16"
    assert cpu_kernels.kernel_max_rows(torch.bfloat16) == cpu_kernels.AMX_BF16_MAX_ROWS
    assert cpu_kernels.linear_max_rows(torch.bfloat16) == cpu_kernels.AMX_BF16_LINEAR_MAX_ROWS
    vdpbf16ps = cpu_kernels.packed_linear(x, packed, 300)
    # Both sum exact products in float32, in another order: at most a bfloat16 step apart.
    torch.testing.assert_close(vdpbf16ps.float(), tiles.float(), atol=0, rtol=2**-7)


@needs_packing
def test_packed_linear_refuses_activations_of_another_dtype():
    packed = cpu_kernels.pack_weight(torch.randn(16, 8))
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_kernels.packed_linear(torch.randn(1, 8).to(torch.bfloat16), packed, 16)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inner", [1536, 13])  # 13: a tail shorter than the 8 lanes
def test_silu_mul_is_silu_of_the_gate_times_up_to_the_dtypes_rounding(dtype, inner):
    generator = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(5, 2 * inner, generator=generator) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 30.0, -30.0])  # zero, saturated sigmoid, a vanishing one
    result = cpu_kernels.silu_mul(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    exact = (gate.double() * torch.sigmoid(gate.double())).to(dtype).double() * up.double()
    assert result.dtype == dtype and result.shape == (5, inner)
    if dtype == torch.float32:  # float32 exp to a few ulp, then two roundings
        torch.testing.assert_close(result.double(), exact, rtol=2e-6, atol=1e-30)
    else:  # each of the two roundings may land one bfloat16 step away from the float64 value's
        torch.testing.assert_close(result.double(), exact.to(dtype).double(), rtol=2 * 2**-8, atol=0)
    assert torch.equal(result[1:], cpu_kernels.silu_mul(gate_up[1:]))  # a row does not depend on the others


def named_layer(d: int = 32, heads: int = 2, head_dim: int = 16, inner: int = 48):
    """One decoder layer's tensors by name, as PackedDecoder hands them to decoder_weights, and their output sizes."""
    generator = torch.Generator().manual_seed(11)
    sizes = {"qkv": (heads + 2) * head_dim, "out": d, "gate_up": 2 * inner, "down": d}
    widths = {"qkv": d, "out": heads * head_dim, "gate_up": d, "down": inner}
    tensors = {
        name: cpu_kernels.pack_weight(torch.randn(sizes[name], widths[name], generator=generator)) for name in sizes
    }
    tensors |= {"input_norm": torch.ones(d), "post_norm": torch.ones(d), "qkv_bias": torch.zeros(sizes["qkv"])}
    return tensors, sizes


@needs_packing
def test_decoder_weights_take_each_layer_by_name_and_name_what_is_missing_or_misshapen():
    tensors, sizes = named_layer()
    weights = cpu_kernels.decoder_weights([tensors, tensors], [sizes, sizes], 2, 16, 1e-6, 0.25)
    assert weights.num_layers() == 2
    with pytest.raises(RuntimeError, match="lack 'post_norm'"):
        cpu_kernels.decoder_weights(
            [{k: v for k, v in tensors.items() if k != "post_norm"}], [sizes], 2, 16, 1e-6, 0.25
        )
    with pytest.raises(RuntimeError, match="'down' is not a packed"):
        cpu_kernels.decoder_weights([tensors | {"down": torch.randn(32, 48)}], [sizes], 2, 16, 1e-6, 0.25)
    with pytest.raises(RuntimeError, match="width differs"):
        cpu_kernels.decoder_weights([tensors], [sizes], 3, 16, 1e-6, 0.25)  # the out linear reads 2 heads, not 3


def test_every_kernel_file_is_compiled_or_hashed_into_the_build():
    """A source missing from SOURCES would not be built, a header missing from HEADERS would not rebuild on an edit."""
    directory = cpu_kernels.SOURCES[0].parent
    assert set(directory.glob("*.cpp")) == set(cpu_kernels.SOURCES)
    assert set(directory.glob("*.h")) == set(cpu_kernels.HEADERS)
