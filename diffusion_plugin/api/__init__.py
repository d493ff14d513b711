"""The API side of the diffusion engine: a request in (body models, prompt, structured output,
parsers: ``prepare``), the choice events out as OpenAI's answers (``chunks``, ``responses``,
``decisions``)."""
