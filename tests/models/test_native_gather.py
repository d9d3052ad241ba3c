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


@pytest.mark.parametrize("routed_gate", ["softmax", "normalized", "unit"])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-14), (torch.float32, 1e-6)])
def test_mohd_route_picks_and_gates_as_the_router(kernels, routed_gate, dtype, tolerance):
    """`mohd_route` against `MoHDRouter` on the same token: the same absolute block ids in the same order (the k
    largest softmax probabilities, ties to the lower index: the router has duplicated rows, so equal logits meet at
    the top) and the same gates for each `routed_gate`."""
    from hf_mohd.models.configuration_mohd import MoHDConfig
    from hf_mohd.models.modeling_mohd import MoHDRouter

    config = MoHDConfig(
        hidden_size=48, num_sub_dims=12, num_shared_sub_dims=3, num_routed_sub_dims_per_tok=4, routed_gate=routed_gate
    )
    router = MoHDRouter(config, 0, "mlp", top_k=4).to(dtype)
    generator = torch.Generator().manual_seed(1)
    for trial in range(20):
        weight = torch.randn(9, 48, generator=generator, dtype=dtype)
        weight[5] = weight[2]  # a tie between routed choices 2 and 5 ...
        weight[7] = weight[2] if trial % 2 else weight[7]  # ... and, every other trial, a three-way one
        router.weight.data.copy_(weight)
        x = torch.randn(1, 1, 48, generator=generator, dtype=dtype)
        x[..., :] += 2 * weight[2] / weight[2].norm()  # pull the tied choices to the top
        with torch.no_grad():
            _, gates, ids = router(x)
        native_ids, native_gates = kernels.mohd_route(
            x.view(1, -1), router.weight, 4, 3, router.NATIVE_GATE_MODES[routed_gate]
        )
        assert torch.equal(native_ids, ids.view(1, -1)), (trial, native_ids, ids)
        torch.testing.assert_close(native_gates, gates.view(1, -1), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("threads", [1, 2])
def test_mohd_gathered_sides_equal_the_masked_formulas(kernels, threads):
    """`mohd_gather_in`: (g ⊙ x) Wt with g 1 on the shared blocks, the gates on the picked ones and 0 elsewhere;
    `mohd_gather_out`: scale F (m ⊙ W h) over the blocks, m 1 on the active blocks, and without F scale (m ⊙ W h);
    in float64, with picked blocks next to the shared ones, next to each other and out of order, no shared block at
    all, and 1 and 2 threads."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(2)
        for num_blocks, num_shared, block, ids in [(8, 2, 4, [2, 5]), (10, 3, 6, [7, 6, 9]), (6, 0, 5, [4, 0, 2])]:
            width = num_blocks * block
            x = torch.randn(1, width, generator=generator, dtype=torch.float64)
            gates = torch.rand(1, len(ids), generator=generator, dtype=torch.float64)
            ids_tensor = torch.tensor([ids])
            weight_t = torch.randn(width, 13, generator=generator, dtype=torch.float64)
            gate_vector = torch.zeros(num_blocks, dtype=torch.float64)
            gate_vector[:num_shared] = 1
            gate_vector[ids] = gates[0]
            expected_in = (x.view(num_blocks, block) * gate_vector[:, None]).view(1, -1) @ weight_t
            got_in = kernels.mohd_gather_in(x, ids_tensor, gates, weight_t, num_shared, block)
            torch.testing.assert_close(got_in, expected_in, rtol=1e-13, atol=1e-13)

            hidden = torch.randn(1, 11, generator=generator, dtype=torch.float64)
            weight = torch.randn(width, 11, generator=generator, dtype=torch.float64)
            fusion = torch.randn(num_blocks, num_blocks, generator=generator, dtype=torch.float64)
            mask = (gate_vector != 0).double()
            blocks = (hidden @ weight.t()).view(num_blocks, block) * mask[:, None]
            got = kernels.mohd_gather_out(hidden, ids_tensor, weight, fusion, num_shared, block, 1.5)
            torch.testing.assert_close(got, (1.5 * fusion @ blocks).view(1, -1), rtol=1e-13, atol=1e-13)
            got = kernels.mohd_gather_out(hidden, ids_tensor, weight, None, num_shared, block, 1.5)
            torch.testing.assert_close(got, 1.5 * blocks.view(1, -1), rtol=1e-13, atol=1e-13)
    finally:
        torch.set_num_threads(saved)


def test_mohd_kernels_refuse_what_they_cannot_read(kernels):
    """A routed id outside [N_s, N), several tokens, a width that is not whole blocks or mixed dtypes raise
    (RuntimeError naming what was expected)."""
    x, gates, weight_t = torch.randn(1, 16), torch.ones(1, 2), torch.randn(16, 5)
    with pytest.raises(RuntimeError, match=r"routed block id 1 outside \[2, 4\)"):
        kernels.mohd_gather_in(x, torch.tensor([[1, 3]]), gates, weight_t, 2, 4)
    with pytest.raises(RuntimeError, match=r"routed block id 4 outside"):
        kernels.mohd_gather_out(torch.randn(1, 3), torch.tensor([[2, 4]]), torch.randn(16, 3), None, 2, 4, 1.0)
    with pytest.raises(RuntimeError, match=r"x \(1, D\)"):
        kernels.mohd_gather_in(torch.randn(2, 16), torch.tensor([[2, 3]]), gates, weight_t, 2, 4)
    with pytest.raises(RuntimeError, match=r"D = N s"):
        kernels.mohd_gather_out(torch.randn(1, 3), torch.tensor([[2, 3]]), torch.randn(15, 3), None, 2, 4, 1.0)
    with pytest.raises(RuntimeError, match=r"weight \(C, D\)"):
        kernels.mohd_route(x, torch.randn(4, 16).double(), 2, 2, 0)


def test_switched_off_by_the_environment(monkeypatch):
    """HF_MOHD_NATIVE_GATHER=0: `native_gather()` returns None without building, so decoding keeps embedding_bag."""
    monkeypatch.setattr(ng, "_state", {})
    monkeypatch.setenv("HF_MOHD_NATIVE_GATHER", "0")
    assert ng.native_gather() is None


@pytest.mark.slow
def test_two_copies_of_the_kernels_register_side_by_side(kernels, monkeypatch):
    """A second copy of this file with another source (as the remote code of a checkpoint saved by another version,
    loaded beside the package) builds its own library under its own operator namespace instead of colliding with
    the first one's (a second registration of one namespace would abort the process); both answer."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("other_native_gather", ng.__file__)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    other.SOURCE += "\n// another version of this file\n"
    other_kernels = other.native_gather()
    assert other_kernels is not None and other_kernels.name != kernels.name
    x, weight = torch.randn(1, 16, dtype=torch.float64), torch.randn(6, 16, dtype=torch.float64)
    for module in (kernels, other_kernels):
        ids, gates = module.mohd_route(x, weight, 2, 1, 0)
        expected = torch.sort(torch.softmax(x @ weight.t(), -1), descending=True, stable=True)
        assert torch.equal(ids, expected.indices[:, :2] + 1)
        torch.testing.assert_close(gates, expected.values[:, :2], rtol=1e-14, atol=1e-14)
