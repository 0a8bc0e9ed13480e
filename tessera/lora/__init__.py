"""vLLM's `vllm.lora` names: `from tessera.lora.request import LoRARequest`."""
