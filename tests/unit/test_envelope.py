"""The request record (``gateway/request/envelope.py``) and serving it without HTTP (issue 33): a batch
job's line goes through ``gateway.serving.serve`` as a route handler's request does, with its
key's tenant and priority, and the record crosses the hop to the replica as an ``EngineRequest``."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission.keys import resolve_keys
from gateway.config import parse_config
from gateway.request.envelope import envelope
from gateway.serving.serve import serve
from gateway.serving.service import Service
from tandem_core.errors import ErrorKind, TandemError
from tandem_core.protocol import EngineRequest
from tests.waiting import async_wait_for
from workers.fake_engine import FakeDeployment

KEYS = [{"key": "sk-bulk-0123456789abcdef", "name": "bulk", "tenant": "etl", "priority": 10, "weight": 2},
        {"key": "sk-narrow-0123456789abcd", "name": "narrow", "models": ["other"]}]
TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _config():
    return parse_config({"auth": {"api_keys": KEYS},
                         "models": [{"name": "fake", "kind": "autoregressive", "source": "none"},
                                    {"name": "other", "kind": "autoregressive", "source": "none"}]})


def test_a_record_is_served_without_http_and_crosses_the_hop_whole():
    async def main():
        config = _config()
        deployment = FakeDeployment({"num_tokens": 3})
        service = Service(config, deployment)
        await service.start()
        try:
            await async_wait_for(service.router.ready, "the fake replicas to be ready")
            bulk, narrow = resolve_keys(config.auth)
            sent: list[EngineRequest] = []
            for replica in service.router.all_replicas():
                call = replica.handle.call

                async def spy(method, *args, call=call):
                    if method == "submit":
                        sent.append(args[-1])
                    return await call(method, *args)
                replica.handle.call = spy
            body = {"model": "fake", "messages": [{"role": "user", "content": "x"}]}
            env = envelope("chat", body, request_id="batch_1-line-7", config=config, key=bulk,
                           headers={"traceparent": TRACE})
            assert env.claim.priority == 10 and env.claim.tenant == "etl" and env.claim.weight == 2
            answer = await serve(service, env)
            assert answer.json["choices"][0]["finish_reason"] == "stop" and answer.json["usage"]["completion_tokens"] == 3
            (req,) = sent
            assert (req.route, req.request_id, req.priority, req.tenant, req.key) == (
                "chat", "chat-batch_1-line-7", 10, "etl", "bulk")
            assert req.body["priority"] == 10 and req.trace == {"traceparent": TRACE}
            assert req.deadline is not None  # the request timeout, as wall-clock time for the replica
            (engine,) = [deployment.engines[r.id] for r in service.router.pools["fake"].replicas]
            assert engine.priorities == [10]
            # The same checks as a route handler's: a model outside the key's list is a 404.
            with pytest.raises(TandemError) as e:
                await serve(service, envelope("chat", dict(body), request_id="r2", config=config, key=narrow))
            assert e.value.kind is ErrorKind.MODEL_NOT_FOUND
        finally:
            await service.stop()
    asyncio.run(main())


def test_a_request_whose_deadline_passed_before_the_replica_started_it_is_a_504():
    async def main():
        config = _config()
        service = Service(config, FakeDeployment({"num_tokens": 3}))
        await service.start()
        try:
            await async_wait_for(service.router.ready, "the fake replicas to be ready")
            env = envelope("completions", {"model": "fake", "prompt": "x"}, request_id="r", config=config,
                           timeout_s=0.0)
            with pytest.raises(TandemError) as e:
                await serve(service, env)
            assert e.value.kind is ErrorKind.REQUEST_TIMEOUT
        finally:
            await service.stop()
    asyncio.run(main())
