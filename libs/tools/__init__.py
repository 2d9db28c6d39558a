"""Tool calling (docs/api.md#tool-calling): the model families' call formats, the grammar that
enforces a call, the parser that reads calls out of a finished text, the split of an output into
content and call deltas as it is generated (streaming.py, envelope.py), and the rendering of
tools, calls and results into a conversation for a chat template."""
