"""``kivi serve``: an OpenAI-compatible HTTP server over transformers' continuous batching with a KIVI cache.

Modules: ``engine`` (the one continuous-batching manager, its factory, per-request checks, cache
statistics), ``running`` (one request's tokens as text deltas, stop sequences, cancellation),
``params`` (request bodies, checked field by field), ``stop`` (stop sequences over streamed text),
``errors`` (OpenAI-shaped errors), ``app`` (the FastAPI routes). Needs the ``serve`` extra
(``pip install 'kivi[serve]'``: fastapi, uvicorn, openai); ``import kivi`` does not import this package.
"""
