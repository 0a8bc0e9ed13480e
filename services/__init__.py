"""Code shared by the three services: generated stubs, config, conversion, gRPC helpers."""
