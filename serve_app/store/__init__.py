"""The durable store: its contract and the SQLite and PostgreSQL backends."""
