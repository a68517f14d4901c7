"""The engine: request state, the model runner, and the single-process LLM engine."""
