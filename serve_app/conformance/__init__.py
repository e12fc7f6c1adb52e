"""The semantic conformance suite as a tool: run its cases against any OpenAI-compatible server
over HTTP (`serve-app conformance run`) and classify every difference between two runs
(`serve-app conformance diff`) as an intended API change, an allowed numerical variation or a
regression.

It is a client: it imports nothing of the service, so it can be pointed at this server at two
revisions or at a peer. docs/conformance.md lists the cases, the record and the rules.

- `record`: a run's record (server identity, one entry per case), saved as JSON.
- `session`: the server under test (HTTP, the `openai` client, the admin port) and the SSE reader.
- `observe`: what the cases record of a response: generations, field shapes, stream events.
- `cases/`: the cases, one module per concern.
- `runner`: runs a selection of cases into a record.
- `changes`: the intended API changes file; `diff`: the classification, case by case;
  `divergence`: two generations' tokens and logprobs; `differences`: the classes and the
  report's data; `report`: its tables.
- `revisions`: `make conformance-diff` (a past revision and this tree, served in turn).
"""
