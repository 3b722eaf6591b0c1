"""A headless Chromium page for tests that look at what a person sees (Playwright).

The browser is Debian's ``chromium`` (``make unit`` installs it when /usr/bin/chromium is
missing): Playwright's own browser download is never used, only its Python package and the
driver inside it. A page's JavaScript errors and failed requests fail the test.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

from playwright.async_api import ConsoleMessage, Page, async_playwright

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",  # tests and CI run as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> Path:
    found = CHROMIUM if CHROMIUM.exists() else None
    found = found or (Path(p) if (p := shutil.which("chromium")) else None)
    if found is None:
        raise AssertionError(
            "Debian's chromium is missing: `make unit` installs it "
            "(apt-get install -y --no-install-recommends chromium)"
        )
    return found


@contextlib.asynccontextmanager
async def chromium_page(profile_dir: Path, expected: tuple[str, ...] = ()) -> AsyncIterator[Page]:
    """A fresh page (own profile in ``profile_dir``); JavaScript errors fail the test, except
    console errors containing one of ``expected`` (Chromium logs every HTTP error a fetch
    gets, such as the 401 a page without a token is meant to receive)."""
    errors: list[str] = []

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error" and not any(text in message.text for text in expected):
            errors.append(f"console: {message.text}")

    async with async_playwright() as playwright:
        context = await playwright.chromium.launch_persistent_context(
            str(profile_dir),
            executable_path=str(chromium_path()),
            args=CHROMIUM_ARGS,
            headless=True,
            viewport={"width": 1440, "height": 900},
        )
        try:
            page = context.pages[0] if context.pages else await context.new_page()
            page.on("console", on_console)
            page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
            yield page
        finally:
            await context.close()
    assert not errors, errors
