"""The task API family: /v1/generations routes, admission, conversations."""
