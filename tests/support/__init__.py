"""Shared test builders and harnesses."""
