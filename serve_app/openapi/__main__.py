"""`python -m serve_app.openapi [--admin] [--keyed]`: print a document without a server
(the served model, profiles and formats stay open: a live server names its own)."""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m serve_app.openapi")
    parser.add_argument("--admin", action="store_true", help="the admin port's document")
    parser.add_argument("--keyed", action="store_true", help="as a server with API keys")
    args = parser.parse_args()
    if args.admin:
        from serve_app.openapi.admin import admin_document

        doc = admin_document(keyed=args.keyed)
    else:
        from serve_app.openapi.public import public_document

        doc = public_document(keyed=args.keyed)
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
