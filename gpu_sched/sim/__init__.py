"""Serving simulator: traces and workload generation."""
