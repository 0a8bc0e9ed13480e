"""The gateway: OpenAI-compatible REST (SSE) and the public gRPC text API."""
