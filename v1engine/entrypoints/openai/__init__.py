"""The OpenAI-compatible HTTP server behind `python -m v1engine.serve`."""
