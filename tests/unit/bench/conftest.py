"""Every test here must leave no task running on its loop."""

from tests.support.leaks import no_leaked_tasks

__all__ = ["no_leaked_tasks"]
