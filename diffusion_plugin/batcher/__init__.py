"""The batcher: sequences and their status (``request``), the pure scheduler (what runs next,
within the memory budget: ``scheduler``, ``memory``), and the loop that steps it."""
