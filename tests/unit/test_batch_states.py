"""A batch job's status moves only through ``BatchStore.move``, against one table
(``gateway.batches.states.TRANSITIONS``), as a replica's moves only through ``Replica.move_to``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gateway.batches.states import ACTIVE, FINAL, TRANSITIONS, BatchStatus, sources
from gateway.batches.store import BatchStore, Line

S = BatchStatus
GATEWAY = Path(__file__).resolve().parents[2] / "gateway"


def test_every_status_is_reached_from_validating_and_the_final_ones_are_never_left():
    assert set(TRANSITIONS) == set(S)
    reached, todo = {S.VALIDATING}, [S.VALIDATING]
    while todo:
        for nxt in TRANSITIONS[todo.pop()] - reached:
            reached.add(nxt)
            todo.append(nxt)
    assert reached == set(S)
    assert all(not TRANSITIONS[s] and s.final for s in FINAL)
    assert all(TRANSITIONS[s] >= {S.FAILED, S.EXPIRED} and not s.final for s in ACTIVE)
    # What the API and the runner rely on: a cancel only before finalizing; completion only after it.
    assert set(sources(S.CANCELLING)) == {S.VALIDATING, S.IN_PROGRESS}
    assert sources(S.COMPLETED) == (S.FINALIZING,) and sources(S.CANCELLED) == (S.CANCELLING,)


def _batch(store: BatchStore) -> str:
    f = store.add_file(b"{}\n", "batch", "in.jsonl", None)
    b = store.add_batch(endpoint="/v1/chat/completions", input_file_id=f["id"], completion_window="24h",
                        window_s=86400, metadata=None, output_expires_s=None, tenant=None, key=None)
    store.add_lines(b["id"], [Line(0, "c0", {})], "fake")
    return b["id"]


@pytest.mark.parametrize("path", [
    [S.IN_PROGRESS, S.FINALIZING, S.COMPLETED],
    [S.IN_PROGRESS, S.CANCELLING, S.CANCELLED],
    [S.CANCELLING, S.CANCELLED],
    [S.IN_PROGRESS, S.EXPIRED],
    [S.FAILED],
])
def test_the_store_makes_each_move_of_the_table_and_refuses_every_other(tmp_path, path):
    store = BatchStore(tmp_path)
    batch = _batch(store)
    now = S.VALIDATING
    for nxt in path:
        for other in S:  # every move the table does not hold changes nothing
            if other not in TRANSITIONS[now] and other is not nxt:
                assert not store.move(batch, other), (now, other)
                assert store.batch(batch)["status"] == now
        assert store.move(batch, nxt), (now, nxt)
        row = store.batch(batch)
        assert row["status"] == nxt and (nxt is S.VALIDATING or row[f"{nxt.value}_at"])
        now = nxt
    assert now.final and not any(store.move(batch, s) for s in S)
    store.close()


def test_only_the_stores_move_writes_a_batchs_status():
    """Every SQL statement in gateway/ that updates ``batches`` sets no status, but ``move``'s."""
    writers = []
    for path in GATEWAY.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and "UPDATE batches" in node.value:
                    text = node.value
                elif isinstance(node, ast.JoinedStr) and any(
                        isinstance(v, ast.Constant) and "UPDATE batches" in str(v.value) for v in node.values):
                    text = ast.unparse(node)
                else:
                    continue
                if "status" in text.split("WHERE")[0] or "{" in text.split("WHERE")[0]:
                    writers.append(f"{path.relative_to(GATEWAY)}:{fn.name}")
    assert sorted(set(writers)) == ["batches/store.py:move"], writers
