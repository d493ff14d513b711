"""Tests mark themselves by folder: tests/unit (fast, fakes allowed) and tests/integration
(the real stack: local Ray, vLLM on tiny-llama, the gateway, the openai SDK).

Property tests (hypothesis) draw new examples on every local run, to find what nobody thought of;
under CI (``CI`` set) they are derandomized, so a red CI is reproducible and never luck."""

import os
import tempfile

import pytest
from hypothesis import settings

from tests import parallel

# Durable state (the batch store: ``batches.data_dir`` defaults under XDG_STATE_HOME) of every
# gateway the tests start, in-process or as `tandem serve`, goes to a folder of this run, never
# to the user's own.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="tandem-test-state-")

parallel.bind_engines_to_a_core()  # under -n only (tests/parallel.py)

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (``tests/parallel.py``)
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = str(item.fspath)
        if "/integration/" in path:
            item.add_marker(pytest.mark.integration)
    parallel.group_items(config, items)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # around pytest-timeout's: a wait for a turn is no test's time
def pytest_runtest_protocol(item, nextitem):
    """Under ``-n``: each module holds its turn from its first test's setup to its last test's
    teardown; a module marked ``alone`` runs while the other worker waits (``tests/parallel.py``)."""
    if parallel.running_in_parallel():
        parallel.TURNS.enter(item, item.config._tmp_path_factory.getbasetemp().parent / "locks")
    yield
    if parallel.running_in_parallel() and (nextitem is None or nextitem.module is not item.module):
        parallel.TURNS.leave()
