"""A step's numbers from the host onto its device in one copy that does not stall the host.

``torch.tensor(values, device=cuda)`` copies from pageable memory and then waits for the stream.
Made between a step's kernels, it holds the host until every kernel queued before it has run,
and the device idles while the host launches what follows. ``stage`` instead packs a step's
numbers into one byte buffer: its rows' starts, seeds, counters, temperatures and acceptance
knobs, and its block tables. It copies the buffer once, from pinned memory with
``non_blocking`` (no synchronisation), and hands back views of it (no kernel). On the host the
views are of the buffer itself.

The values are the ones ``torch.tensor(values, dtype=dtype)`` makes: each Python number is
converted once, to the dtype asked for (``array``'s C conversions: the same rounding).
"""

from __future__ import annotations

import array

import torch

CODES = {torch.int64: "q", torch.int32: "i", torch.float64: "d", torch.float32: "f"}
SIZES = {dtype: array.array(code).itemsize for dtype, code in CODES.items()}
ALIGN = 64  # every array starts on a cache line (a compiled kernel reads its inputs aligned)


def stage(device: torch.device, **arrays: tuple[torch.dtype, list]) -> dict[str, torch.Tensor]:
    """``name=(dtype, values)``, ``values`` a list of numbers or of equal-length lists (a
    matrix) -> {name: a tensor of ``dtype`` on ``device``}, all of them views of one copy."""
    blob, spans = bytearray(), []
    for name, (dtype, values) in arrays.items():
        shape: tuple[int, ...] = (len(values),)
        if values and isinstance(values[0], (list, tuple)):
            shape = (len(values), len(values[0]))
            if any(len(row) != shape[1] for row in values):
                raise ValueError(f"{name}: rows of unequal lengths")
            values = [v for row in values for v in row]
        start = len(blob)
        blob += array.array(CODES[dtype], values).tobytes()
        spans.append((name, dtype, shape, start, len(blob)))
        blob += bytes(-len(blob) % ALIGN)
    if not blob:
        return {}
    buf = torch.frombuffer(blob, dtype=torch.uint8)
    if device.type == "cuda":
        buf = buf.pin_memory().to(device, non_blocking=True)  # (the host allocator keeps it until copied)
    elif device.type != "cpu":
        buf = buf.to(device)
    whole = {dtype: buf.view(dtype) for dtype in {dtype for _, dtype, _, _, _ in spans}}  # (one view a dtype)
    return {name: whole[dtype].as_strided(shape, (shape[1], 1) if len(shape) == 2 else (1,), a // SIZES[dtype])
            for name, dtype, shape, a, _ in spans}
