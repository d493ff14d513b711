"""The benchmarks and measuring tools: `tandem bench` (``main``) and the `python -m` ones."""
