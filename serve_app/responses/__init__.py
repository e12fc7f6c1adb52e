"""The OpenAI Responses API family: routes, admission, protocol, output items, the run."""
