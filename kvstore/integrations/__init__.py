"""Adapters that let serving engines use the store as their external KV cache."""
