"""Tessera: the CLI and the offline API."""
