"""Multi-LoRA in the worker: PEFT adapters in a slot pool, applied per token segment."""
