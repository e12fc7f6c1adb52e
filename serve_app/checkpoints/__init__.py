"""A checkpoint's artifacts and how they are read: tokenizer, chat template, prompt encoding."""
