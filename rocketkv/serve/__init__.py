"""An OpenAI-compatible HTTP server for the engine (``serve.py``, ``rocketkv serve``): FastAPI
app factory ``app.create_app(engine, defaults)``: up to ``max_batch`` requests decoded together
(continuous batching, ``engine.batch``), the others waiting in a queue."""
