"""Text: prompts become token ids (chat templates, tools) and sampled ids become streamed text (the incremental
detokenizer, UTF-8 byte runs, stop strings, each request's state). The router and the local pipeline use it; no
torch here."""
