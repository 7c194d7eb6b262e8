import warnings

import pytest
import torch

from vlmspec.targets import cpu_kernels

# The kernels exist only on x86 CPUs with AVX2 and a C++ compiler; elsewhere the runner falls back to
# oneDNN/ATen, which test_packed.py covers, and the fallback itself is tested below on every machine.
needs_kernel = pytest.mark.skipif(
    not cpu_kernels.kernel_available(),
    reason="vlmspec's CPU kernels need an x86 CPU with AVX2 plus g++ and ninja; this machine uses the fallback",
)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 33])
def test_the_kernel_computes_x_times_w_transposed_plus_bias(dtype, rows):
    generator = torch.Generator().manual_seed(rows)
    # 37 outputs and 45 inputs: a partial tile of rows of W, and a K that is not a multiple of 8.
    for n, k, with_bias in ((37, 45, True), (64, 576, False), (1000, 96, True)):
        weight = torch.randn(n, k, generator=generator).to(dtype)
        x = torch.randn(rows, k, generator=generator).to(dtype)
        bias = torch.randn(n, generator=generator).to(dtype) if with_bias else None
        expected = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
        result = cpu_kernels.skinny_linear(x, weight, bias)
        assert result.dtype == dtype and result.shape == (rows, n)
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
