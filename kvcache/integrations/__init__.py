"""Adapters that plug kvcache into serving engines (each imports its engine lazily)."""
