"""The OpenAI-compatible gateway: one endpoint in front of the owned engines and remote upstreams.

    config     the YAML file (pydantic), with defaults for the bundled demo models
    schemas    the OpenAI wire format as pydantic models
    errors     OpenAI error objects and the handlers that produce them
    calls      request bodies -> Calls (metadata, prompt, schema, sampling)
    prompts    chat messages -> the models' prompt template; response_format -> JSON Schema
    dispatch   route, run, fall back, account
    engines    owned engines: a thread per engine, continuous batching, back-pressure, cancellation
    remote     OpenAI-compatible upstreams over httpx
    responses  Outcomes -> OpenAI objects and SSE chunks
    batches    the Batch API: durable SQLite store and runner
    metrics    Prometheus metrics (vLLM names, `nowait:` prefix) and the live cost identity
    ledger     per-request cost and the JSONL audit log
    app        the FastAPI app
    cli        `nowait serve`

docs/gateway.md is the reference.
"""
