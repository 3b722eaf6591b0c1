"""Suite-wide test settings: the Hypothesis profile every property-based test runs under.

``make test`` and CI run the ``epp`` profile: a bounded number of examples, derandomized
(the same examples on every run, so a red CI run reproduces locally) and no example database
written into the work tree. ``HYPOTHESIS_PROFILE=epp-deep`` explores 50 times more, with fresh
random examples each run, for hunting bugs by hand (lift the per-test timeout for it:
``HYPOTHESIS_PROFILE=epp-deep .venv/bin/pytest --timeout=0 tests/unit/fuzz``).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "epp",
    max_examples=100,
    deadline=None,  # the machine is shared with benchmarks: time limits would be flaky
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "epp-deep",
    parent=settings.get_profile("epp"),
    max_examples=5_000,
    derandomize=False,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "epp"))
