"""The pair inside the frameworks: a LangChain LLM that is also a DSPy LM, a LangChain chat model,
DSPy's engine route and a completion adapter, over one shared ``PairModel``."""
