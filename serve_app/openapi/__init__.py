"""The published HTTP contract: OpenAPI 3.1 documents generated from the pydantic models the
routes parse and answer with.

`document` builds a document from a table of operations and imports only pydantic and
`serve_app.errors` (a leaf anyone may import); `public` is the public port's table (it reads
both API families' protocol models, so only entry points import it); `admin` is the admin
port's. Run `python -m serve_app.openapi [--admin] [--keyed]` to print one without a server.
"""
