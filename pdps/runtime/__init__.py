"""Shared effectful machinery that roles and adapters may both use."""
