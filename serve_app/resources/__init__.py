"""Durable resources the API families share: the runner, the resource, live state."""
