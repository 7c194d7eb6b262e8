import warnings

import pytest
import torch

from vlmspec.targets import cpu_linear

needs_kernel = pytest.mark.skipif(not cpu_linear.kernel_available(), reason="the AVX2 kernel is not built here")


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
        result = cpu_linear.skinny_linear(x, weight, bias)
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
    torch.testing.assert_close(cpu_linear.skinny_linear(x, weight), x @ weight.T, atol=1e-4, rtol=1e-5)


def test_a_kernel_that_cannot_be_built_falls_back_with_a_warning_that_names_the_fix(monkeypatch):
    def fail():
        raise OSError("g++: not found")

    monkeypatch.setattr(cpu_linear, "_build_and_load", fail)
    monkeypatch.setattr(cpu_linear, "_cpu_has_avx2", lambda: True)
    monkeypatch.delenv(cpu_linear.KERNEL_ENV, raising=False)
    with pytest.warns(RuntimeWarning, match="apt install g\\+\\+"):
        assert cpu_linear.kernel_available.__wrapped__() is False


def test_the_kernel_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(cpu_linear.KERNEL_ENV, "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_linear.kernel_available.__wrapped__() is False
