"""A minimal headless-Chromium driver over the DevTools protocol, for the HTML report tests.

Needs Debian's ``chromium`` and the ``websocket-client`` package (the ``test`` extra)."""
from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import struct
import subprocess
import tempfile
import time
import urllib.request
import zlib
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-port=0", "--window-size=1400,1000"]


def find_chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


class Browser:
    """One Chromium process with one page; records console errors and uncaught exceptions."""

    def __init__(self, binary: str):
        try:
            import websocket
        except ImportError as e:
            raise ImportError("the browser tests drive Chromium with websocket-client: "
                              "pip install websocket-client (in autopar's test extra)") from e

        self.profile = tempfile.TemporaryDirectory(prefix="autopar-chromium-")
        # A session of its own: close() ends Chromium's helper processes too, which otherwise go on
        # writing into the profile while it is removed.
        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={self.profile.name}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = Path(self.profile.name) / "DevToolsActivePort"
        deadline = time.time() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            if time.time() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not start its DevTools endpoint")
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as r:
            page = next(t for t in json.load(r) if t["type"] == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=30)
        self.next_id = 0
        self.errors: list[str] = []
        self.loaded = False
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")

    def _event(self, msg: dict) -> None:
        method, p = msg.get("method"), msg.get("params", {})
        if method == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            self.errors.append(d.get("exception", {}).get("description") or d.get("text", "exception"))
        elif method == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
            self.errors.append(" ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
        elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
            self.errors.append(p["entry"]["text"])
        elif method == "Page.loadEventFired":
            self.loaded = True

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]
            self._event(msg)

    def open(self, url: str) -> None:
        self.loaded = False
        self.call("Page.navigate", url=url)
        while not self.loaded:
            self._event(json.loads(self.ws.recv()))

    def js(self, expression: str):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression!r}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def click(self, selector: str) -> None:
        """A real mouse click at the centre of the first element matching ``selector``."""
        box = self.js(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.scrollIntoView({{block: 'center'}});"
                      "const r = e.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    def screenshot(self, path: Path) -> bytes:
        data = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        path.write_bytes(data)
        return data

    def close(self) -> None:
        if getattr(self, "ws", None):
            self.ws.close()
        self._signal_group(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._signal_group(signal.SIGKILL)
        self.proc.wait()
        self.profile.cleanup()

    def _signal_group(self, sig) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:      # every process of the group has exited
            pass


def png_distinct_pixels(data: bytes, limit: int = 2) -> int:
    """How many distinct pixels (up to ``limit``) an 8-bit RGB/RGBA PNG has: 1 means blank."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", chunk[:10])
            assert depth == 8 and color in (2, 6), "only 8-bit RGB(A) PNGs"
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw, stride, prev, seen = zlib.decompress(idat), width * bpp, bytearray(width * bpp), set()
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):  # undo the PNG row filter
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        seen.update(bytes(line[i:i + bpp]) for i in range(0, stride, bpp * 7))
        if len(seen) >= limit:
            return len(seen)
        prev = line
    return len(seen)
