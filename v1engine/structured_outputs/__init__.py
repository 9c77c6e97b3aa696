"""Structured outputs: JSON schema, regex, choice and grammar constraints on what a request
generates, with xgrammar.

`params.py` (StructuredOutputsParams) is data that crosses processes inside SamplingParams;
`backend.py` compiles it, in the front end (to refuse a bad grammar before sending) and in the
engine core, whose `core/structured_output_manager.py` keeps one matcher per request and fills the
token bitmask that the sampling rank applies to the logits.
"""

from v1engine.structured_outputs.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
