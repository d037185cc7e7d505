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
    batches    the Batch API: durable SQLite store and runner (batch_input: the input file checked)
    tenants    the Caller of a request: tenant, key id, what the key allows
    keys       API keys as hashed records (KeyStore, SQLite); keys_cli: `nowait keys`
    auth       a bearer key to its Caller, or 401; admin keys for /admin
    limits     rate limits per key and daily budgets per tenant (429s as OpenAI answers them)
    metrics    Prometheus metrics (vLLM names, `nowait:` prefix) and the live cost identity
    ledger     per-request cost and the JSONL audit log
    app        the FastAPI app
    cli        `nowait serve`

docs/gateway.md is the reference.
"""
