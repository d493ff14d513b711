"""tests/gpu: the shape model on a CUDA device (both samplers, batch invariance, memory per row)
and the diffusion benchmark at small scale. Every test here carries the ``gpu`` marker and is
skipped, with the reason, where ``torch.cuda.is_available()`` is False; on a lent device run
``python -m pytest tests/gpu -q -rs`` at once (a few minutes)."""

import pytest


def _no_cuda_reason() -> str | None:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a dependency
        return f"torch does not import: {e}"
    if not torch.cuda.is_available():
        return f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__})"
    return None


_skipped: dict[str, int | str] = {}


def pytest_collection_modifyitems(config, items):
    reason = None
    checked = False
    for item in items:
        if "/gpu/" not in str(item.fspath):
            continue
        item.add_marker(pytest.mark.gpu)
        if not checked:
            reason, checked = _no_cuda_reason(), True
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
            _skipped["reason"], _skipped["count"] = reason, int(_skipped.get("count", 0)) + 1


def pytest_terminal_summary(terminalreporter):
    """Say why, even under -q (which hides skip reasons unless -rs)."""
    if _skipped:
        terminalreporter.write_line(f"tests/gpu: {_skipped['count']} skipped: {_skipped['reason']}")


@pytest.fixture(scope="session")
def shape_path():
    from workers import tiny_models

    return str(tiny_models.build(tiny_models.SHAPE_DIFFUSIONGEMMA))
