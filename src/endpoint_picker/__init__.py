"""endpoint-picker: a Python Endpoint Picker for the Gateway API Inference Extension."""

__version__ = "0.1.0"
