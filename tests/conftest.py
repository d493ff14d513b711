"""Tests mark themselves by folder: tests/unit (fast, fakes allowed) and tests/integration
(the real stack: local Ray, vLLM on tiny-llama, the gateway, the openai SDK).

Property tests (hypothesis) draw new examples on every local run, to find what nobody thought of;
under CI (``CI`` set) they are derandomized, so a red CI is reproducible and never luck."""

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = str(item.fspath)
        if "/integration/" in path:
            item.add_marker(pytest.mark.integration)
