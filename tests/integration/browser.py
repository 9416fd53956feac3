"""Headless Debian Chromium driven over the DevTools protocol, for tests that check what the Prefect
UI renders (a single-page app: the page's text exists only after its scripts ran and its API calls
came back, so the tests wait for the rendered text, click tabs, and take screenshots).

One browser, one tab, in a session of its own; :meth:`Chromium.close` leaves no process behind
(the browser, its zygotes and renderers all run in that session's process group). The protocol goes
over the ``websockets`` package that Prefect installs.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
"""Binaries tried in order (Debian's package is `chromium`)."""

ENV_BINARY = "ATOLL_CHROMIUM"
"""A browser binary to use instead (a path)."""


def find_chromium() -> str | None:
    """The browser binary: $ATOLL_CHROMIUM, else the first of CANDIDATES on PATH; None if none."""
    given = os.environ.get(ENV_BINARY)
    if given:
        return given if Path(given).exists() else None
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


class Chromium:
    """A headless browser with one tab (see the module docstring)."""

    def __init__(self, *, width: int = 1400, height: int = 900, env: Mapping[str, str] | None = None,
                 log: Path | None = None, start_timeout_s: float = 60.0) -> None:
        from websockets.sync.client import connect

        binary = find_chromium()
        if binary is None:
            raise FileNotFoundError("no chromium binary (apt-get install chromium, or set ATOLL_CHROMIUM)")
        self.profile = tempfile.mkdtemp(prefix="atoll-chromium-")
        self.width, self.height = width, height
        self._next_id = 0
        out: Any = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - closed in close()
        self._log = out if log else None
        # Flags: headless without a sandbox (root in containers) or GPU, offline (no background
        # networking, no component updates, no QUIC), the debugging port chosen by the browser.
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
             "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--disable-extensions", "--mute-audio",
             f"--user-data-dir={self.profile}", "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
             f"--window-size={width},{height}", "about:blank"],
            stdout=out, stderr=subprocess.STDOUT, env=dict(env) if env is not None else None, start_new_session=True)
        try:
            port = self._devtools_port(start_timeout_s)
            target = self._page_target(port, start_timeout_s)
            self.ws = connect(target, max_size=None, open_timeout=start_timeout_s)
            self.send("Page.enable")
            self.send("Runtime.enable")
            # The window size is not always the layout's: a desktop viewport, so the UI shows its sidebar.
            self._viewport(width, height)
        except BaseException:
            self.close()
            raise

    # -- start --------------------------------------------------------------------------------
    def _devtools_port(self, timeout_s: float) -> int:
        """The browser writes its debugging port to DevToolsActivePort in its profile."""
        marker = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode} before it listened")
            with contextlib.suppress(OSError, ValueError, IndexError):
                return int(marker.read_text().splitlines()[0])
            time.sleep(0.1)
        raise TimeoutError(f"chromium did not open its debugging port within {timeout_s:.0f}s")

    @staticmethod
    def _page_target(port: int, timeout_s: float) -> str:
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:  # noqa: S310
                    for t in json.loads(r.read()):
                        if t.get("type") == "page" and t.get("webSocketDebuggerUrl"):
                            return str(t["webSocketDebuggerUrl"])
            time.sleep(0.2)
        raise TimeoutError("chromium opened no page target")

    # -- the protocol -------------------------------------------------------------------------
    def send(self, method: str, timeout_s: float = 60.0, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result (events that arrive meanwhile are dropped)."""
        self._next_id += 1
        mid = self._next_id
        self.ws.send(json.dumps({"id": mid, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if msg.get("id") != mid:
                continue
            if "error" in msg:
                raise RuntimeError(f"{method}: {msg['error']}")
            return dict(msg.get("result", {}))

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited if it is a promise)."""
        res = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression[:80]}: {res['exceptionDetails'].get('text')}")
        return res.get("result", {}).get("value")

    # -- what tests use -----------------------------------------------------------------------
    def goto(self, url: str) -> None:
        self.send("Page.navigate", url=url)

    def text(self) -> str:
        """The page's rendered text (what a person reads)."""
        return str(self.evaluate("document.body ? document.body.innerText : ''") or "")

    def wait_for(self, cond: Callable[[str], bool], timeout_s: float, what: str) -> str:
        """Poll the rendered text until ``cond(text)``; the text. Fails with the last text seen."""
        deadline = time.monotonic() + timeout_s
        text = ""
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError):  # between two documents while navigating
                text = self.text()
                if cond(text):
                    return text
            time.sleep(0.3)
        raise AssertionError(f"the page never showed {what} within {timeout_s:.0f}s; it showed:\n{text[:3000]}")

    def click(self, label: str) -> bool:
        """Click the innermost visible element whose own text is ``label`` (a tab, a link, a button)."""
        return bool(self.evaluate(f"""(() => {{
            const want = {json.dumps(label)};
            const all = [...document.querySelectorAll('button, a, [role=tab], li, span, div')];
            const hits = all.filter(e => e.offsetParent !== null && e.innerText && e.innerText.trim() === want);
            const el = hits.find(e => ![...e.children].some(c => hits.includes(c))) || hits[0];
            if (!el) return false;
            el.click();
            return true;
        }})()"""))

    def images(self) -> list[dict[str, Any]]:
        """Every <img> of the page: its src's first 40 characters, its src's length, natural size."""
        value = self.evaluate("""[...document.images].map(i => ({src: i.src.slice(0, 40), length: i.src.length,
                                    width: i.naturalWidth, height: i.naturalHeight, complete: i.complete}))""")
        return list(value or [])

    def screenshot(self, path: Path, *, height: int | None = None) -> Path:
        """A PNG of the window; ``height``: of a window this tall instead (the UI scrolls inside its
        own panes, so a taller window is how a long page fits in one picture)."""
        if height:
            self._viewport(self.width, height)
            time.sleep(1.0)  # relayout and repaint
        try:
            res = self.send("Page.captureScreenshot", format="png")
        finally:
            if height:
                self._viewport(self.width, self.height)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(res["data"]))
        return path

    def _viewport(self, width: int, height: int) -> None:
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    # -- stop ---------------------------------------------------------------------------------
    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            with contextlib.suppress(Exception):
                self.send("Browser.close", timeout_s=5)
            with contextlib.suppress(Exception):
                ws.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        # The whole session's group: renderers and zygotes that outlive the browser process.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
            time.sleep(0.2)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        if self._log is not None:
            self._log.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
