"""The composition root (``root.App``) and the parts it builds, one module each:

```
 root.py          App: builds the parts, starts its role's, runs their tasks, stops them all
 roles.py         a builder per role (one EPP, workers' parent, worker): ports and named tasks
 pool.py          what feeds the datastore: source + scrapers, or (a worker) its parent
 sources.py       the pool file, or the Kubernetes watch with its Lease and token reviewer
 routing.py       the scheduler from its config, the director, outlier ejection, flow control
 grpc_ports.py    the ext_proc port (TLS, limits) and the health port
 metrics_port.py  the metrics port: its access (tokens, TLS), the status view, the server
 process.py       process-wide memory settings an entry point asks for
```
"""

from endpoint_picker.app.process import (
    LARGE_BLOCK_BYTES,
    freeze_startup_heap,
    return_large_blocks_to_os,
)
from endpoint_picker.app.roles import BoundPorts
from endpoint_picker.app.root import App

__all__ = [
    "LARGE_BLOCK_BYTES",
    "App",
    "BoundPorts",
    "freeze_startup_heap",
    "return_large_blocks_to_os",
]
