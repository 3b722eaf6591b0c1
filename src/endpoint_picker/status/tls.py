"""TLS on the metrics port (``--metrics-cert-dir``, ``--metrics-client-ca-file``).

One ``ssl.SSLContext`` serves every connection. ``tls.crt`` and ``tls.key`` (the names of a
Kubernetes TLS Secret, as the reference EPP reads them) are looked at every
``reload_interval``; when either changes (inode, size or mtime: a Secret volume swaps a symlink,
cert-manager rewrites the files) the pair is first loaded into a scratch context, and only if
it is a valid, matching pair into the live one, so new handshakes present the new certificate
and open connections keep theirs. A half-written pair is logged and retried at the next look;
the old certificate serves meanwhile. With a client CA, clients must present a certificate it
signed (mutual TLS); the CA bundle is read once, at start.
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import structlog

from endpoint_picker.errors import ConfigError

log = structlog.get_logger(__name__)

Stamp = tuple[tuple[int, int, int], ...]


class ReloadingTls:
    """The metrics port's server context; ``watch()`` is the reload loop (a named app task)."""

    def __init__(
        self, cert_dir: Path, client_ca_file: Path | None = None, *, reload_interval: float = 1.0
    ) -> None:
        self._cert = cert_dir / "tls.crt"
        self._key = cert_dir / "tls.key"
        self._interval = reload_interval
        self._stamp: Stamp | None = None
        self._problem: str | None = None
        self.reloads = 0  # certificates loaded after the first (tests)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        if client_ca_file is not None:
            try:
                self.context.load_verify_locations(cafile=client_ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(
                    f"cannot load CA certificates from {client_ca_file}: {exc}",
                    "--metrics-client-ca-file",
                ) from exc
            self.context.verify_mode = ssl.CERT_REQUIRED
        problem = self._load()
        if problem is not None:  # at start a bad pair is a bad flag: exit 2
            raise ConfigError(problem, "--metrics-cert-dir")

    def _stat(self) -> Stamp:
        stamps = []
        for path in (self._cert, self._key):
            st = path.stat()
            stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(stamps)

    def _load(self) -> str | None:
        """Load the pair if it changed; what is wrong with it if it cannot be loaded."""
        try:
            stamp = self._stat()
            if stamp == self._stamp:
                return None
            # a scratch context first: a mismatched pair must not reach the live one
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self._cert, self._key)
            self.context.load_cert_chain(self._cert, self._key)
        except (OSError, ssl.SSLError) as exc:
            return f"cannot load {self._cert} and {self._key}: {exc}"
        if self._stamp is not None:
            self.reloads += 1
            log.info("metrics port: certificate reloaded", cert=str(self._cert))
        self._stamp = stamp
        return None

    def reload_if_changed(self) -> None:
        """One look at the files; a problem is logged when it starts or changes."""
        problem = self._load()
        if problem is not None and problem != self._problem:
            log.warning("metrics port: certificate not reloaded; the old one serves", error=problem)
        self._problem = problem

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            self.reload_if_changed()
