import pytest
import torch
from torch import nn

from vlmspec.kernels import cpu_kernels
from vlmspec.kernels.linear import FastLinears

needs_kernel = pytest.mark.skipif(
    not cpu_kernels.kernel_available(),
    reason="vlmspec's CPU kernels need an x86 CPU with AVX2 plus g++ and ninja; the modules keep their own forward",
)


def small_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 40), nn.SiLU(), nn.Sequential(nn.Linear(40, 24, bias=False))).to(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_linears_compute_what_the_modules_compute_and_leave_them_untouched(dtype):
    model = small_model(dtype)
    x = torch.randn(2, 3, 48).to(dtype)  # leading dims are kept
    with torch.inference_mode():
        expected = model(x)
        with FastLinears(model):
            result = model(x)
            assert all("forward" in vars(m) for m in model.modules() if type(m) is nn.Linear)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(result.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert not any("forward" in vars(m) for m in model.modules())  # outside: plain nn.Linear again
    loss = model(x.float().to(dtype).requires_grad_()).float().sum()
    loss.backward()  # and autograd works as before
    assert model[0].weight.grad is not None


@needs_kernel
def test_a_weight_changed_since_packing_is_packed_again():
    model = small_model(torch.float32)
    fast = FastLinears(model)
    x = torch.randn(4, 48)
    with torch.inference_mode(), fast:
        model(x)
    with torch.no_grad():
        model[0].weight.mul_(2.0)
    with torch.inference_mode():
        expected = model(x)
        with fast:
            torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_past_the_kernels_limit_go_to_atens_gemm_with_the_same_values(dtype):
    from vlmspec.kernels.linear import PackedLinear

    limit = cpu_kernels.linear_max_rows(dtype)
    # Where ATen's GEMM has AMX tiles that the kernel lacks (held off them), bfloat16 goes to ATen sooner.
    amx = dtype == torch.bfloat16 and cpu_kernels.cpu_has_amx_bf16() and not cpu_kernels.kernel_uses_amx()
    assert limit == (cpu_kernels.AMX_BF16_LINEAR_MAX_ROWS if amx else cpu_kernels.MAX_ROWS)
    assert cpu_kernels.kernel_max_rows(dtype) == (cpu_kernels.AMX_BF16_MAX_ROWS if amx else cpu_kernels.MAX_ROWS)
    torch.manual_seed(0)
    weight, bias = torch.randn(40, 48).to(dtype), torch.randn(40).to(dtype)
    linear = PackedLinear([weight], [bias])
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for rows in (1, limit, limit + 1):
        x = torch.randn(rows, 48).to(dtype)
        expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
        torch.testing.assert_close(linear(x).float(), expected, atol=tolerance, rtol=tolerance)
