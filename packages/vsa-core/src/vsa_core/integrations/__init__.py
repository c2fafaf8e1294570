"""Integrations of VSA into model libraries (each imports its library lazily, if at all)."""
