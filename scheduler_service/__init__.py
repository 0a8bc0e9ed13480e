"""The scheduler service: the EngineCore loop (schedule -> execute -> update). Imports no torch.

Public entry points:
- `engine.EngineCore(scheduler_config, cache_config, workers)`: in-process core
  (KV handshake, add_request / abort_requests / step / stats); used by the
  gRPC service and by the offline `tessera.LLM`.
- `service.EngineCoreServer(address, engine, worker_addresses)`: the
  `tessera.v1.EngineCore` gRPC service with health and reflection.
- `worker_client.GrpcWorkerClient(address)`: WorkerProtocol over gRPC.
- `python -m scheduler_service --worker HOST:PORT ...`: the process.

Inside: `scheduler.Scheduler` (continuous batching), `kv_cache_manager` /
`block_pool` / `prefix_cache` (paged blocks and prefix caching), `request`.
"""
