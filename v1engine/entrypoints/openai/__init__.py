"""The OpenAI-compatible HTTP server behind `python -m v1engine.serve`.

Kept free of imports: a worker process imports `startup.kv_cache_num_blocks` from here and must
not pay for FastAPI.
"""
