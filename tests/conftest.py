"""Tests mark themselves by folder: tests/unit (fast, fakes allowed) and tests/integration
(the real stack: local Ray, vLLM on tiny-llama, the gateway, the openai SDK)."""

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = str(item.fspath)
        if "/integration/" in path:
            item.add_marker(pytest.mark.integration)
