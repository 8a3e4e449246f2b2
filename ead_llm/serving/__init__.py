"""``ead-llm serve`` (an OpenAI-compatible server) and the ``ead-llm`` command line."""
