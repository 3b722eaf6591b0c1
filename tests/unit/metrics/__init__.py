"""Tests of endpoint_picker.metrics."""
