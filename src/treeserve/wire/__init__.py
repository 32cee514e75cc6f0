"""What the server and the gateway both speak, below both of them: error bodies in OpenAI's schema,
the request bodies (pydantic), the broker's message format, the graceful drain of an HTTP server and
the OpenAPI document. The server and the gateway import this package and never each other; nothing
here imports PyTorch or the engine (tests/test_layering.py holds it to that)."""
