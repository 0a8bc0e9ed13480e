"""The worker service: model runner, paged-attention models, sampler."""
