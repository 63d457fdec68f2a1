"""The HTTP side of the server: the FastAPI app, its routes (SGLang's native API and the
OpenAI-compatible one), the protocol models, and the tokenizer manager that talks to the
server's processes. Only the entry points (spectral.cli, spectral.launch_server) import it."""
