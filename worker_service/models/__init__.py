"""Llama-family models written for paged attention."""
