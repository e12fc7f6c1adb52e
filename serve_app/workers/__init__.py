"""The deployments app.py deploys and the processes they own: tokenizer, grammar compiler,
engine (a later issue moves the flat modules here)."""
