"""Fast mode's batch-invariant GEMMs (``diffusion_plugin.step.gemm``) at the released model's sizes.

A row's linear batched with others must give the bits it gives alone: plain ``F.linear`` over
(B*256, H) did not at hidden 2816 on this CPU's BLAS nor on an H200 (``tests/gpu/probe_gemm.py``);
one ``bmm`` over the rows (a lone row padded to two) does, and so does one over the rows' canvas
halves (a lone row is two blocks), the form an installed model's linears take only inside a fast-mode pass over canvases (``ROWS``), flattened rows (the MoE router's
input) included."""

import torch

from diffusion_plugin.step import gemm

C = 256


def _rows(n: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(n, C, hidden, generator=torch.Generator().manual_seed(seed))


def test_a_rows_linear_has_the_same_bits_alone_and_batched_at_real_size():
    hidden, out = 2816, 1408
    torch.set_num_threads(1)
    w = torch.randn(out, hidden, generator=torch.Generator().manual_seed(1)) / hidden ** 0.5
    row = _rows(1, hidden, 2)
    alone = gemm.bmm_blocks(row, w.t())[0]
    assert torch.allclose(alone, torch.nn.functional.linear(row[0], w), rtol=1e-4, atol=1e-4)
    for mates in (1, 2, 4):
        batch = torch.cat([_rows(mates, hidden, 3 + mates), row, _rows(1, hidden, 9)])
        assert torch.equal(gemm.bmm_blocks(batch, w.t())[mates], alone), f"{mates} mates before it"


def test_a_rows_halves_have_the_same_bits_alone_and_batched_at_real_size():
    """``bmm_halves`` (the device form's vocabulary GEMMs): the head's shape at hidden 2816 (a
    vocabulary slice) and the soft embedding's (vocabulary -> hidden), a lone row as one GEMM."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(4)
    for k, o in ((2816, 2048), (4096, 2816)):
        w_t = torch.randn(k, o, generator=g) / k ** 0.5
        row = _rows(1, k, 5)
        alone = gemm.bmm_halves(row, w_t)[0]
        assert torch.allclose(alone, row[0] @ w_t, rtol=1e-4, atol=1e-4)
        for mates in (1, 3):
            batch = torch.cat([_rows(mates, k, 6 + mates), row])
            assert torch.equal(gemm.bmm_halves(batch, w_t)[mates], alone), f"({k}, {o}): {mates} mates before it"


def test_installed_linears_take_the_row_form_only_inside_rows():
    lin = torch.nn.Linear(64, 32, bias=True)
    model = torch.nn.Sequential(lin)
    x = torch.randn(3, C, 64)
    want = lin(x)
    calls = []
    real = gemm.bmm_halves
    gemm.bmm_halves = lambda *a: calls.append(1) or real(*a)
    try:
        gemm.install(model)
        assert torch.equal(lin(x), want) and not calls  # outside ROWS: HF's own forward
        token = gemm.ROWS.set(C)
        try:
            got = lin(x)
            assert calls and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
            assert torch.equal(lin(x[1:2]), got[1:2])  # and a lone row has its batched bits
            flat = lin(x.reshape(-1, 64))  # the MoE router's input: the rows flattened
            assert torch.equal(flat, got.reshape(-1, 32)) and torch.equal(lin(x[2]), got[2])
            calls.clear()
            assert torch.equal(lin(x[:, :100]), torch.nn.functional.linear(x[:, :100], lin.weight, lin.bias))
            assert not calls  # not canvases (a prompt chunk): HF's own forward
        finally:
            gemm.ROWS.reset(token)
    finally:
        gemm.bmm_halves = real
