"""The deployments app.py deploys: the tokenizer and the engine (the grammar deployment
is `serve_app.grammar.service.GrammarService`)."""
