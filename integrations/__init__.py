"""Suites that run ead-llm inside the real LangChain and DSPy on the embedded pair, offline.

Each module has a ``run(...)`` that returns its measured figures (the tests call it with small
sizes) and a ``main()`` for ``python -m integrations.<name>``.
"""
