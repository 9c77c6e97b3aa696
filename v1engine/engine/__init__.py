"""The client process below the entrypoints: the processor (prompt -> core requests), the
clients of the engine core, output processing and detokenization, and `AsyncLLM`. See
../shared/DESIGN.md §1 for the processes and the data flow.
"""
