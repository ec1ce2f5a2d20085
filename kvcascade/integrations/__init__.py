"""Adapters to serving engines (vLLM)."""
