"""LoRA adapters on autoregressive base models, as ``vllm serve --enable-lora`` serves them:
which adapters each base serves (configured in ``lora_modules``, or loaded at run time through
``POST /v1/load_lora_adapter``), loading or unloading one on every replica of its base, and
loading the run-time ones onto a replica whose engine (re)starts. A request names an adapter by
``model``: the router sends it to its base's pool (``router.Router.pool``), preferring replicas
that hold it (``choosers.AdapterAffinity``), and vLLM's serving layer in the replica applies it.
This module owns the adapter table; nothing else changes it.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.routing.replicas import Replica, ReplicaState
from tandem_core.config import ModelKind, TandemConfig
from tandem_core.errors import ErrorKind, TandemError, invalid

logger = logging.getLogger(__name__)

MAX_LOADED = 64  # adapters loaded at run time, all bases together (they are metric labels too)
CALL_TIMEOUT_S = 120.0  # one replica loading one adapter


class Adapters:
    def __init__(self, config: TandemConfig):
        self.config = config
        self.base: dict[str, str] = {}  # adapter -> its base model
        self.path: dict[str, str] = {}  # adapter -> where it was loaded from (as given)
        self.loaded: set[str] = set()  # of those, the ones loaded at run time (reloaded on restarts)
        for m in config.models:
            for name, path in m.lora_modules.items():
                self.base[name], self.path[name] = m.name, path

    def base_of(self, model: object) -> str | None:
        return self.base.get(model) if isinstance(model, str) else None

    def card(self, name: str) -> dict:
        """The adapter as vLLM lists it in /v1/models: its base is its ``parent``."""
        return {"id": name, "object": "model", "created": 0, "owned_by": "tandem", "kind": "lora",
                "root": self.path[name], "parent": self.base[name], "max_model_len": None}

    def _base_for(self, body: dict) -> str:
        """The base a load names (``model``, tandem's field), or the only one that takes adapters."""
        named = body.get("model")
        if named is not None:
            m = self.config.model(named) if isinstance(named, str) else None
            if m is None:
                raise TandemError(ErrorKind.MODEL_NOT_FOUND, f"The model `{named}` does not exist.", "model")
            if m.kind is not ModelKind.AUTOREGRESSIVE:
                raise invalid(f"model {named!r} is a diffusion model and takes no LoRA adapters (tandem's batcher "
                              "runs its base weights only)", param="model")
            if not m.lora_enabled:
                raise invalid(f"model {named!r} takes no LoRA adapters: give it lora_modules, or engine_args "
                              "enable_lora: true", param="model")
            return named
        bases = [m.name for m in self.config.models if m.lora_enabled]
        if len(bases) != 1:
            raise invalid("model: name the base model to load the adapter on (" + (
                f"several take adapters: {', '.join(bases)})" if bases else "none takes adapters: give one "
                "lora_modules, or engine_args enable_lora: true)"), param="model")
        return bases[0]

    async def load(self, router, body: dict) -> str:
        """vLLM's /v1/load_lora_adapter, on every live replica of the base (and, from now on, on
        every replica of it that starts)."""
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise invalid("Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        base = self._base_for(body)
        if name in router.pools:
            raise invalid(f"The lora adapter '{name}' conflicts with a served base model.", param="lora_name")
        inplace = body.get("load_inplace") is True
        if name in self.base and not inplace:
            raise invalid(f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                          "place, set 'load_inplace' to True.", param="lora_name")
        if name not in self.base and len(self.loaded) >= MAX_LOADED:
            raise invalid(f"at most {MAX_LOADED} adapters may be loaded at run time; unload one first",
                          param="lora_name")
        replicas = _live(router.pools[base].replicas)
        if not replicas:
            raise TandemError(ErrorKind.NO_REPLICA, f"model {base!r} has no live replica to load the adapter on; "
                              "try again shortly", retry_after=1)
        request = {"lora_name": name, "lora_path": path, "load_inplace": inplace}
        first = await self._on_all(replicas, "load", {**request, "load_inplace": True})
        self.base[name], self.path[name] = base, path
        self.loaded.add(name)
        logger.info("LoRA adapter %s (%s) loaded on %d replica(s) of %s", name, path, len(replicas), base)
        return first

    async def unload(self, router, body: dict) -> str:
        """vLLM's /v1/unload_lora_adapter, from every live replica of its base."""
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise invalid("'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")
        base = self.base.get(name)
        if base is None:
            raise TandemError(ErrorKind.NOT_FOUND, f"The lora adapter '{name}' cannot be found.", "lora_name")
        # Forgotten first: a replica that starts meanwhile does not get it back.
        del self.base[name], self.path[name]
        self.loaded.discard(name)
        replicas = _live(router.pools[base].replicas)
        results = await asyncio.gather(*(self._call(r, "unload", {"lora_name": name}) for r in replicas),
                                       return_exceptions=True)
        for r, res in zip(replicas, results, strict=True):
            if isinstance(res, BaseException):  # gone there already (e.g. restarted): nothing to unload
                logger.info("replica %s: unload %s: %s", r.id, name, res)
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def on_started(self, replica: Replica) -> None:
        """A replica's engine (re)started: the adapters loaded at run time on its base, loaded
        there too (configured ones its engine loaded itself)."""
        for name in [a for a in self.loaded if self.base.get(a) == replica.model]:
            try:
                await self._call(replica, "load", {"lora_name": name, "lora_path": self.path[name],
                                                   "load_inplace": True})
            except Exception as e:  # noqa: BLE001 - served without it; requests for it there get vLLM's 404
                logger.warning("replica %s: could not load LoRA adapter %s again: %s", replica.id, name, e)

    async def _on_all(self, replicas: list[Replica], op: str, body: dict) -> str:
        results = await asyncio.gather(*(self._call(r, op, body) for r in replicas), return_exceptions=True)
        errors = [res for res in results if isinstance(res, BaseException)]
        if errors:
            ok = [r for r, res in zip(replicas, results, strict=True) if not isinstance(res, BaseException)]
            if ok and op == "load":  # all or nothing: no replica keeps what the others refused
                await asyncio.gather(*(self._call(r, "unload", {"lora_name": body["lora_name"]}) for r in ok),
                                     return_exceptions=True)
            err = errors[0]
            raise err if isinstance(err, TandemError) else TandemError(
                ErrorKind.ENGINE_ERROR, f"loading the adapter failed on a replica: {type(err).__name__}: {err}")
        return next(res for res in results if isinstance(res, str))

    @staticmethod
    async def _call(replica: Replica, op: str, body: dict) -> str:
        return await asyncio.wait_for(replica.handle.lora(op, body), CALL_TIMEOUT_S)


def _live(replicas: list[Replica]) -> list[Replica]:
    return [r for r in replicas if r.state in (ReplicaState.HEALTHY, ReplicaState.UNHEALTHY)]
