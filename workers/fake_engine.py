"""A fake engine for unit tests: OpenAI-shaped answers, no model.

Told through ``engine_args`` (or attributes) to be slow (``token_delay_s``), to fail
(``fail``: "start", "config", "request", "midstream"), or to hang (``hang``: true).

Fault injection across processes (a fake inside a Ray actor): with ``engine_args.control_file``
set, the engine reads that JSON file (``{"<pid>": "hang" | "stall" | "raise"}``) before each token
and each health check. A fault names the process, so it dies with it: the restarted replica is
healthy again; ``"*"`` names every process without a fault of its own (replicas not created yet
too: autoscaling tests). ``hang``: tokens and health checks do not return while it lasts; ``stall``:
tokens do not come but health checks pass; ``raise``: requests and health checks fail, as an engine whose core died.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from tandem_core.errors import EngineConfigError, ErrorKind, TandemError, invalid
from tandem_core.protocol import DONE, EngineInfo, EngineStats, Item, Role
from workers.actor import EngineActor
from workers.transport.handles import LocalReplicaHandle


class FakeEngine:
    def __init__(self, model: str, engine_args: dict[str, Any] | None = None,
                 lora_modules: dict[str, str] | None = None):
        args = dict(engine_args or {})
        self.model = model
        # LoRA adapters it serves (name -> path): configured ones, then loaded at run time; a
        # request for one answers with its name before each token ("<name>:tok0").
        self.loras: dict[str, str] = dict(lora_modules or {})
        self.lora_enabled = bool(self.loras) or args.get("enable_lora") is True
        self.lora_requests: dict[str, int] = {}
        self.num_tokens: int = args.get("num_tokens", 4)
        self.token_delay_s: float = args.get("token_delay_s", 0.0)
        self.fail: str | None = args.get("fail")
        self.hang: bool = args.get("hang", False)
        self.max_model_len: int = args.get("max_model_len", 64)
        self.control_file: str | None = args.get("control_file")
        self.broken = False
        self.stall = False
        self.progress = 0
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.served: list[str] = []
        self.served_at: list[float] = []  # when each of ``served`` arrived (time.time())
        self.priorities: list[int] = []  # each generation request's `priority`, in arrival order
        self.responses_store: dict[str, dict] = {}  # this replica's stored responses, by id

    def _file_fault(self) -> str | None:
        """This process's fault in the control file, as the file says now (lifted when the test
        rewrites the file; a restarted replica is a new pid, so it is healthy again)."""
        if self.control_file is None:
            return None
        try:
            with open(self.control_file) as f:
                faults = json.load(f)
            return faults.get(str(os.getpid()), faults.get("*"))
        except (OSError, ValueError):
            return None

    async def _step(self, token: bool = True) -> None:
        """Before each token (and health check): apply injected faults."""
        fault = self._file_fault()
        while self.hang or fault == "hang" or (token and (self.stall or fault == "stall")):
            # Held while the fault lasts (tests flip the attribute in-process or rewrite the
            # control file) or until the request is cancelled.
            await asyncio.sleep(0.02)
            fault = self._file_fault()
        if self.broken or fault == "raise":
            raise RuntimeError("fake engine: its core died")

    async def _paced(self, words: list[str], midstream: bool = True) -> AsyncIterator[tuple[int, str]]:
        """Each word after its delay and the injected faults (``fail: midstream`` fails the second
        one), then one more fault check: a held engine finishes nothing."""
        for i, w in enumerate(words):
            await self._step()
            await asyncio.sleep(self.token_delay_s)
            if midstream and self.fail == "midstream" and i == 1:
                raise RuntimeError("fake engine failed mid-stream")
            self.progress += 1
            yield i, w
        await self._step()

    async def start(self) -> EngineInfo:
        if self.fail == "start":
            raise RuntimeError("fake engine told to fail at start")
        if self.fail == "config":  # as vLLM refusing an engine argument (workers/vllm_engine.py)
            raise EngineConfigError(f"model {self.model!r}: engine_args.fail: the fake engine refuses its config")
        return EngineInfo(model=self.model, kind="fake", max_model_len=self.max_model_len)

    def chat(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            return _one(invalid("messages: must be a non-empty list", param="messages"))
        prompt = " ".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
        return self._generate(body, request_id, prompt, chat=True)

    def completions(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        if not isinstance(body.get("prompt"), str):
            return _one(invalid("prompt: must be a string", param="prompt"))
        return self._generate(body, request_id, body["prompt"], chat=False)

    # Routes besides chat and completions (not ``messages``: the fake serves no Anthropic API, so
    # it stands for a model kind that lacks a route).

    async def responses(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        """The Responses API: the response id is the request id (as vLLM does); stored here."""
        if not isinstance(body.get("input"), str):
            yield invalid("input: must be a string", param="input")
            return
        words = [f"tok{i}" for i in range(min(body.get("max_output_tokens") or self.num_tokens, self.num_tokens))]
        resp = {"id": request_id, "object": "response", "created_at": int(time.time()), "model": self.model,
                "status": "completed", "output": [{"type": "message", "id": "msg_1", "role": "assistant",
                                                   "status": "completed", "content": [
                                                       {"type": "output_text", "text": " ".join(words),
                                                        "annotations": []}]}]}
        self.responses_store[request_id] = resp
        if not body.get("stream"):
            yield resp
            return
        yield _event({"type": "response.created", "sequence_number": 0, "response": {**resp, "status": "in_progress",
                                                                                   "output": []}})
        async for i, w in self._paced(words):
            yield _event({"type": "response.output_text.delta", "sequence_number": i + 1, "item_id": "msg_1",
                          "output_index": 0, "content_index": 0, "delta": (" " if i else "") + w})
        yield _event({"type": "response.completed", "sequence_number": len(words) + 1, "response": resp})

    async def responses_retrieve(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        resp = self.responses_store.get(body.get("response_id"))
        if resp is None:
            yield TandemError(ErrorKind.NOT_FOUND, f"Response with id '{body.get('response_id')}' not found.",
                              "response_id")
            return
        yield resp

    async def responses_cancel(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        async for item in self.responses_retrieve(body, request_id):
            yield invalid("Cannot cancel a synchronous response.", "response_id") if isinstance(item, dict) else item

    async def tokenize(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        """One token per character (its code point)."""
        if not isinstance(body.get("prompt"), str):
            yield invalid("prompt: must be a string", param="prompt")
            return
        tokens = [ord(c) for c in body["prompt"]]
        yield {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens, "token_strs": None}

    async def detokenize(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
            yield invalid("tokens: Input should be greater than or equal to 0", param="tokens")
            return
        yield {"prompt": "".join(chr(t) for t in tokens)}

    async def _generate(self, body: dict, rid: str, prompt: str, chat: bool) -> AsyncIterator[Item]:
        adapter = body.get("model") if body.get("model") != self.model else None
        if adapter is not None and adapter not in self.loras:  # as vLLM's serving layer answers
            yield TandemError(ErrorKind.MODEL_NOT_FOUND, f"The model `{adapter}` does not exist.", "model")
            return
        if adapter is not None:
            self.lora_requests[adapter] = self.lora_requests.get(adapter, 0) + 1
        self.priorities.append(body.get("priority", 0))  # what the gateway passed on (vLLM's field)
        n_prompt = len(prompt.split())
        if n_prompt > self.max_model_len:
            yield TandemError(ErrorKind.CONTEXT_TOO_LONG, "prompt too long", "messages" if chat else "prompt")
            return
        max_tokens = body.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            yield invalid("max_tokens must be at least 1", param="max_tokens")
            return
        n = self.num_tokens if max_tokens is None else min(max_tokens, self.num_tokens)
        finish = "length" if max_tokens is not None and max_tokens <= self.num_tokens else "stop"
        self.running.add(rid)
        self.served.append(rid)
        self.served_at.append(time.time())
        try:
            if self.fail == "request":
                raise RuntimeError("fake engine told to fail")
            words = [f"{adapter}:tok{i}" if adapter else f"tok{i}" for i in range(n)]
            if body.get("stream"):
                async for _, w in self._paced(words):
                    yield _chunk(rid, self.model, chat, w + " ", None)
                self.running.discard(rid)  # from here on it finishes whatever happens: not "running"
                yield _chunk(rid, self.model, chat, "", finish)
                yield DONE
            else:
                async for _ in self._paced(words, midstream=False):
                    pass
                self.running.discard(rid)
                text = " ".join(words)
                choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                          if chat else {"index": 0, "text": text, "finish_reason": finish})
                yield {"id": rid, "object": "chat.completion" if chat else "text_completion",
                       "created": int(time.time()), "model": self.model, "choices": [choice],
                       "usage": {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}}
        except asyncio.CancelledError:
            self.aborted.append(rid)
            raise
        finally:
            self.running.discard(rid)

    async def abort(self, request_id: str) -> bool:
        return request_id in self.running

    async def check_health(self) -> None:
        await self._step(token=False)

    async def stats(self) -> EngineStats:
        return EngineStats(running=len(self.running), progress=self.progress)

    async def reset_prefix_cache(self) -> bool:
        self.prefix_resets = getattr(self, "prefix_resets", 0) + 1
        return True

    async def lora(self, op: str, body: dict) -> str:
        """vLLM's answers to /v1/load_lora_adapter and /v1/unload_lora_adapter, in miniature."""
        if not self.lora_enabled:
            raise invalid(f"model {self.model!r} was not started with LoRA support", param="model")
        await self._step(token=False)
        name = body.get("lora_name")
        if op == "load":
            if name in self.loras and not body.get("load_inplace"):
                raise invalid(f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                              "in place, set 'load_inplace' to True.")
            self.loras[name] = body.get("lora_path")
            return f"Success: LoRA adapter '{name}' added successfully."
        if name not in self.loras:
            raise TandemError(ErrorKind.NOT_FOUND, f"The lora adapter '{name}' cannot be found.")
        del self.loras[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def shutdown(self) -> None:
        self.running.clear()


def _chunk(rid: str, model: str, chat: bool, text: str, finish: str | None) -> str:
    choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
              else {"index": 0, "text": text, "finish_reason": finish})
    obj = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
           "created": int(time.time()), "model": model, "choices": [choice]}
    return f"data: {json.dumps(obj)}\n\n"


def _event(data: dict) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n"


async def _one(item: Item) -> AsyncIterator[Item]:
    yield item


def create_engine(cfg, source_path: str) -> FakeEngine:
    """The ``fake`` entry in ``workers.registry``."""
    return FakeEngine(cfg.name, cfg.engine_args, cfg.lora_modules)


class FakeDeployment:
    """In-process replicas around FakeEngines (unit tests of the gateway; no Ray)."""

    def __init__(self, engine_args: dict[str, Any] | None = None):
        self.engine_args = engine_args
        self.engines: dict[str, FakeEngine] = {}
        self.removed: list[str] = []  # replicas released by ``remove_replica`` (autoscaling down)
        self.tables: dict[str, dict[str, str]] = {}  # what ``publish_replicas`` wrote, by model

    def create_replicas(self, model) -> list[tuple[str, LocalReplicaHandle]]:
        return [self.create_replica(model, i) for i in range(model.replicas)]

    def create_replica(self, model, index: int) -> tuple[str, LocalReplicaHandle]:
        def make(rid: str) -> EngineActor:  # also how a "restarted" replica gets a fresh engine
            engine = FakeEngine(model.name, self.engine_args if self.engine_args is not None else model.engine_args,
                                model.lora_modules)
            self.engines[rid] = engine
            return EngineActor(model.model_dump(mode="json"), model.source, rid, engine=engine)

        rid = f"{model.name}/{index}"
        return rid, LocalReplicaHandle(make(rid), factory=lambda: make(rid))

    def remove_replica(self, replica_id: str) -> None:
        self.removed.append(replica_id)  # its engine stays in ``engines``: tests read its counters

    def placement_problem(self, model, replica_id: str | None = None) -> str | None:
        return None  # in-process: always placed

    role = Role.SOLO  # one gateway, in-process

    def publish_replicas(self, model: str, table: dict[str, str]) -> None:
        self.tables[model] = dict(table)

    def replica_table(self, model: str) -> dict[str, str] | None:
        return self.tables.get(model)

    def close(self) -> None:
        self.engines.clear()
