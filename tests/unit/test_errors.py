import json
import pickle

import pytest

from tandem_core.errors import STATUS_TABLE, ErrorKind, TandemError, kind_for_status


def test_every_kind_has_a_status_and_type():
    assert set(STATUS_TABLE) == set(ErrorKind)


@pytest.mark.parametrize("kind, status", [
    (ErrorKind.INVALID_REQUEST, 400), (ErrorKind.CONTEXT_TOO_LONG, 400), (ErrorKind.MODEL_NOT_FOUND, 404),
    (ErrorKind.OVERLOADED, 429), (ErrorKind.NO_REPLICA, 503), (ErrorKind.ENGINE_ERROR, 500),
    (ErrorKind.ENGINE_DEAD, 500),
])
def test_status_table(kind, status):
    err = TandemError(kind, "m", "p")
    assert err.status == status
    env = err.envelope()["error"]
    assert set(env) == {"message", "type", "param", "code"}
    assert (env["message"], env["param"]) == ("m", "p")


def test_error_survives_pickling_across_the_actor_boundary():
    err = TandemError(ErrorKind.CONTEXT_TOO_LONG, "too long", "messages")
    back = pickle.loads(pickle.dumps(err))
    assert back == err and back.kind is ErrorKind.CONTEXT_TOO_LONG and back.param == "messages"


def test_sse_error_event_is_the_envelope():
    event = TandemError(ErrorKind.ENGINE_DEAD, "gone").sse()
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event[6:])["error"]["message"] == "gone"


def test_engine_status_mapping():
    assert kind_for_status(400) is ErrorKind.INVALID_REQUEST
    assert kind_for_status(404) is ErrorKind.MODEL_NOT_FOUND
    assert kind_for_status(500) is ErrorKind.ENGINE_ERROR
