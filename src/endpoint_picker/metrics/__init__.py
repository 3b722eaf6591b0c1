"""Model-server metrics: per-engine metric names, a pure parser, and the scrape loops.

``engines`` maps engine types to metric names, ``parser`` turns a ``/metrics`` payload into a
``MetricsSnapshot``, ``scraper`` runs one guarded task per endpoint, each fetching over its own
kept-alive connection (``http``, a lean HTTP/1.1 client on httptools), and ``budget`` stretches
the scrape interval so that scraping stays within a CPU budget.
"""
