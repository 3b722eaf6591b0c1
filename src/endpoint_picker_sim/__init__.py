"""Simulated vLLM model servers for testing and benchmarking the Endpoint Picker.

Stands alone: it never imports ``endpoint_picker`` (an import-linter contract checks this).
"""
