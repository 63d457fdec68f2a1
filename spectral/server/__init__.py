"""The server: launch, HTTP app, tokenizer manager, detokenizer, IPC transport and messages."""
