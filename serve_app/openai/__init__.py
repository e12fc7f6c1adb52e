"""The OpenAI API family: routes, admission, formatting, the SSE stream, request ids."""
