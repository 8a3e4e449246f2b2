"""The embedded task, answer extractors, statistics, and the ``ead-llm bench`` harness."""
