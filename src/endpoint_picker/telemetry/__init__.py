"""The EPP's own observability: Prometheus metrics, structured logs, usage extraction."""
