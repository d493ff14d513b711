"""The shape the per-model benchmarks share (``bench_tenants``, ``bench_decisions``): parse their
flags, then one `tandem serve` per model, one alive at a time, each reported as it ends and all of
them written as JSON with ``--out``."""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("tandem.bench")


def per_model(argv: list[str] | None, doc: str, add_arguments: Callable, workdir: str,
              run_model: Callable, report: Callable, prepare: Callable | None = None) -> int:
    """``run_model(model, args, workdir) -> dict`` for each of ``--models``; ``report(model, result)``
    prints it; ``prepare(args)`` runs once the flags are parsed."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    if prepare is not None:
        prepare(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for model in args.models.split(","):
        t0 = time.monotonic()
        results[model] = run_model(model, args, work)
        print(report(model, results[model]), flush=True)
        logger.info("%s done in %.0f s", model, time.monotonic() - t0)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0
