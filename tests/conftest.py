"""Tests mark themselves by folder: tests/unit (fast, fakes allowed) and tests/integration
(the real stack: local Ray, vLLM on tiny-llama, the gateway, the openai SDK).

Property tests (hypothesis) draw new examples on every local run, to find what nobody thought of;
under CI (``CI`` set) they are derandomized, so a red CI is reproducible and never luck."""

import os
import tempfile

import pytest
from hypothesis import settings

# Durable state (the batch store: ``batches.data_dir`` defaults under XDG_STATE_HOME) of every
# gateway the tests start, in-process or as `tandem serve`, goes to a folder of this run, never
# to the user's own.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="tandem-test-state-")

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = str(item.fspath)
        if "/integration/" in path:
            item.add_marker(pytest.mark.integration)
