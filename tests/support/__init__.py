"""Helpers the tests import (never fixtures: those live in the conftest.py files).

- `admin`: reading the admin port (engine timelines, replicas reporting).
- `cluster`: the simulated multi-node Ray cluster, run as `python -m tests.support.cluster`.
- `generations`: the session server's generation profiles, and polling a generation.
- `grammar`: compiling a spec, checking what a compiled grammar admits.
- `ports`: free loopback ports.
- `postgres`: databases on the tests' PostgreSQL server.
- `rewriting_proxy`: a deliberately changed server (a proxy that rewrites answers).
- `scheduler`: sequences, a scheduler and a simulated engine for the scheduler tests.
- `side_apps`: a second Serve app beside the session's one.
"""
