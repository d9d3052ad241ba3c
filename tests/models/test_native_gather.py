"""The native gathered products (`hf_mohd.models.native_gather`) against the same sums written as einsums over the
gathered weights."""

import pytest
import torch

from hf_mohd.models import native_gather as ng


@pytest.fixture(scope="module")
def kernels():
    module = ng.native_gather()
    assert module is not None, "the native gather kernels did not build (see the logged reason)"
    return module


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float64, 1e-12), (torch.float32, 2e-5), (torch.bfloat16, 1e-2)]
)
def test_gathered_products_equal_einsums_over_the_picked_experts(kernels, dtype, tolerance, threads):
    """Up: row (t, k) = W[e_tk] x_t over an (E, l, o) table; down: row t = sum_k sum_j h_tkj W[e_tk, j, :] over an
    (E, m, l) table; at widths that are not multiples of a cache line or of the per-thread slice, with repeated and
    out-of-order ids, at 1 and 2 threads. The reference is float64 on the same (rounded) inputs; bf16 outputs are
    rounded once at the end, so their error is bf16's unit roundoff relative to the largest output."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        for tokens, top_k, experts, width, inner in [(1, 3, 7, 70, 5), (3, 2, 5, 130, 8), (8, 4, 9, 576, 8)]:
            x = torch.randn(tokens, width, generator=generator).to(dtype)
            ids = torch.randint(0, experts, (tokens, top_k), generator=generator)
            ids[0, -1] = ids[0, 0]  # a repeated id
            up = torch.randn(experts, width, 2 * inner, generator=generator).to(dtype)
            down = torch.randn(experts, inner, width, generator=generator).to(dtype)
            hidden = torch.randn(tokens * top_k, inner, generator=generator).to(dtype)

            expected_up = torch.einsum("tl,tklo->tko", x.double(), up.double()[ids]).reshape(tokens * top_k, -1)
            expected_down = torch.einsum(
                "tkm,tkml->tl", hidden.double().view(tokens, top_k, inner), down.double()[ids]
            )
            got_up, got_down = kernels.gathered_up(x, ids, up), kernels.gathered_down(hidden, ids, down)
            assert got_up.dtype == dtype and got_down.dtype == dtype
            for got, expected in ((got_up, expected_up), (got_down, expected_down)):
                error = (got.double() - expected).abs().max() / expected.abs().max()
                assert error <= tolerance, (dtype, tokens, top_k, width, error.item())
    finally:
        torch.set_num_threads(saved)


def test_gathered_products_refuse_what_they_cannot_read(kernels):
    """A strided table, a mismatched width, an expert id outside the table, int32 ids or mixed dtypes raise
    (RuntimeError naming what was expected) instead of reading the wrong memory."""
    x, ids = torch.randn(2, 6), torch.tensor([[0, 1], [2, 0]])
    table = torch.randn(3, 6, 4)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.gathered_up(x, ids, torch.randn(3, 4, 6).transpose(1, 2))
    with pytest.raises(RuntimeError, match=r"x \(M, l\)"):
        kernels.gathered_up(torch.randn(2, 5), ids, table)
    with pytest.raises(RuntimeError, match=r"expert id 3 outside \[0, 3\)"):
        kernels.gathered_up(x, torch.tensor([[0, 3], [1, 2]]), table)
    with pytest.raises(RuntimeError, match=r"expert id -1 outside"):
        kernels.gathered_down(torch.randn(4, 6), torch.tensor([[0, -1], [1, 2]]), torch.randn(3, 6, 5))
    with pytest.raises(RuntimeError, match="int64"):
        kernels.gathered_up(x, ids.int(), table)
    with pytest.raises(RuntimeError, match=r"hidden \(M K, m\)"):
        kernels.gathered_down(torch.randn(4, 3), ids, table.double())


def test_switched_off_by_the_environment(monkeypatch):
    """HF_MOHD_NATIVE_GATHER=0: `native_gather()` returns None without building, so decoding keeps embedding_bag."""
    monkeypatch.setattr(ng, "_state", {})
    monkeypatch.setenv("HF_MOHD_NATIVE_GATHER", "0")
    assert ng.native_gather() is None
