"""tandem's tools, the top floor: the ``tandem`` command, the benchmarks and their load
generator, and the `vllm serve` shim. The runtime (gateway, workers, engines) never imports them."""
