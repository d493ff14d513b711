"""Which GEMMs give a row the same bits whatever its batch mates, on this device's BLAS.

``python tests/gpu/probe_gemm.py [device]`` prints one JSON line per probe: for a row's block
(256 canvas positions, or one 32-row expert tile) computed alone and inside a larger call, the
batch sizes at which its result differs (bits) from the reference size. Fast mode's batch
invariance rests on these facts; ``tests/gpu`` checks the kernels built on them.
"""

import json
import sys

import torch

C, TILE = 256, 32


def _differs(ref: torch.Tensor, got: torch.Tensor) -> bool:
    return not torch.equal(ref, got)


def dense(device: str, H: int, out_dim: int, sizes=range(1, 17)) -> dict:
    g = torch.Generator(device="cpu").manual_seed(H * 7 + out_dim)
    x = torch.randn(max(sizes) * C, H, generator=g).to(device)
    w = (torch.randn(out_dim, H, generator=g) / H ** 0.5).to(device)
    ref = torch.nn.functional.linear(x[:C], w)
    out = {"probe": "linear (B*256, H) x (H, O)", "H": H, "out": out_dim}
    out["differs_at_B"] = [b for b in sizes if _differs(ref, torch.nn.functional.linear(x[:b * C], w)[:C])]
    out["differs_at_B_3d"] = [b for b in sizes
                              if _differs(ref, torch.nn.functional.linear(x[:b * C].view(b, C, H), w)[0])]
    from diffusion_plugin.step.gemm import bmm_blocks  # fast mode's form: one bmm over the rows (>= 2)

    alone = bmm_blocks(x[:C].view(1, C, H), w.t())[0]
    out["bmm_rows_differs_at_B"] = [b for b in sizes if _differs(alone, bmm_blocks(x[:b * C].view(b, C, H), w.t())[0])]
    from diffusion_plugin.step.gemm import bmm_halves  # ... over the rows' canvas halves (the form served)

    alone = bmm_halves(x[:C].view(1, C, H), w.t())[0]
    out["bmm_halves_differs_at_B"] = [b for b in sizes
                                      if _differs(alone, bmm_halves(x[:b * C].view(b, C, H), w.t())[0])]
    return out


def tiles(device: str, H: int, out_dim: int, counts=(1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 32, 33, 64, 100)) -> dict:
    g = torch.Generator(device="cpu").manual_seed(H + out_dim)
    x = torch.randn(max(counts), TILE, H, generator=g).to(device)
    w = (torch.randn(out_dim, H, generator=g) / H ** 0.5).to(device)
    ref = torch.bmm(x[:2], w.t().expand(2, -1, -1))[0]
    mm = torch.mm(x[0], w.t())
    return {"probe": "bmm (n, 32, H) x (H, O), tile 0 vs n=2", "H": H, "out": out_dim,
            "differs_at_n": [n for n in counts if _differs(ref, torch.bmm(x[:n], w.t().expand(n, -1, -1))[0])],
            "mm_differs_from_bmm2": _differs(ref, mm)}


def attention(device: str, heads: int, D: int, keys: int, sizes=range(1, 17)) -> dict:
    g = torch.Generator(device="cpu").manual_seed(heads + D)
    q = torch.randn(max(sizes), heads, C, D, generator=g).to(device)
    k = torch.randn(max(sizes), heads, keys, D, generator=g).to(device)
    ref = torch.matmul(q[:1], k[:1].transpose(-1, -2))[0]
    return {"probe": "matmul (B, heads, 256, D) x (B, heads, D, keys)", "heads": heads, "D": D, "keys": keys,
            "differs_at_B": [b for b in sizes if _differs(ref, torch.matmul(q[:b], k[:b].transpose(-1, -2))[0])]}


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    for H, n_out in ((128, 256), (128, 4096), (1024, 1024), (1024, 4096), (2816, 2816), (2816, 8192)):
        print(json.dumps(dense(device, H, n_out)), flush=True)
    for H, n_out in ((2816, 262144), (262144, 2816)):  # the vocabulary pass's head and soft embedding
        print(json.dumps(dense(device, H, n_out, sizes=(1, 2, 3, 4, 8))), flush=True)
    for H, n_out in ((128, 128), (64, 128), (1024, 64), (32, 1024), (2816, 1408), (704, 2816)):
        print(json.dumps(tiles(device, H, n_out)), flush=True)
    for heads, D, keys in ((16, 256, 256), (8, 256, 256), (16, 256, 512)):
        print(json.dumps(attention(device, heads, D, keys)), flush=True)


if __name__ == "__main__":
    main()
