"""The command line's flags, each declared once (``spec``), read by ``values``; ``serve``'s table
builds ``epp serve``'s parser, its ``Settings`` and ``docs/flags.md``."""
