"""The stalled-client hold across Serve's proxy."""
