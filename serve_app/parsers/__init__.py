"""Model text -> content, tool calls and reasoning (streaming, per request)."""
