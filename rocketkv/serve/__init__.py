"""An OpenAI-compatible HTTP server for the engine (``serve.py``, ``rocketkv serve``): FastAPI
app factory ``app.create_app(engine, defaults)``. One request at a time through
one ``Engine`` (a single worker thread and its queue), no continuous batching yet."""
