"""vLLM's KV-cache events: the wire format (``wire``), the subscriptions (``subscriber``), the
index of which endpoint holds which block (``index``) and the prompt's tokens (``tokens``), for
``precise-prefix-cache-scorer`` (``scheduling/plugins/precise.py``; docs/scheduling.md)."""
