"""Structured output: grammar spec and service, schema limits, tool grammars, compile pool."""
