"""Developer scripts (`python -m scripts.NAME`)."""
