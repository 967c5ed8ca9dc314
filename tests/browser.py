"""Headless Chromium driven through its DevTools protocol, for the page tests.

`--dump-dom` shows a page once its scripts have run; a reader does more: points at a
chart, picks from a menu, runs a cell. `Browser` opens a page and then does what a
reader does, through the protocol's websocket (tornado's client, which the notebook
tools already install): evaluate JavaScript in the page, press keys, move the pointer,
list every request the page made, and read which fonts drew its text.
"""

import asyncio
import json
import subprocess
import time
import urllib.request

from tornado.websocket import websocket_connect


class Browser:
    """One headless Chromium with one tab; `close` ends it (or use `with`)."""

    def __init__(self, chromium, flags, profile, timeout=60, size=(1280, 1000)):
        self.process = subprocess.Popen(
            [
                chromium,
                *flags,
                f"--user-data-dir={profile}",
                "--remote-debugging-port=0",  # Chromium picks a port and writes it
                "--window-size={},{}".format(*size),
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.loop = asyncio.new_event_loop()
        self.events, self.next_id = [], 0
        try:
            port = self._devtools_port(profile / "DevToolsActivePort", timeout)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as page:
                tabs = json.loads(page.read())
            tab = next(t for t in tabs if t["type"] == "page")
            url = tab["webSocketDebuggerUrl"]

            async def connect():  # tornado's client joins the loop it is called on
                return await websocket_connect(url, max_message_size=256 * 2**20)

            self.socket = self.loop.run_until_complete(connect())
            self.call("Network.enable")  # from now on, requests are recorded
            self.call("Page.enable")
        except BaseException:
            self.close()
            raise

    def _devtools_port(self, path, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "chromium exited at start"
            if path.is_file() and path.read_text().strip():
                return int(path.read_text().split()[0])
            time.sleep(0.1)
        raise AssertionError(f"chromium opened no DevTools port in {timeout} s")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        socket = getattr(self, "socket", None)
        if socket is not None:

            async def hang_up():  # tornado closes on the loop it is called from
                socket.close()

            self.loop.run_until_complete(hang_up())
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.loop.close()

    def call(self, method, timeout=60, **params):
        """Send one DevTools command and return its result; the events that arrive
        meanwhile are kept in `events`."""
        self.next_id += 1
        message_id = self.next_id

        async def exchange():
            message = {"id": message_id, "method": method, "params": params}
            await self.socket.write_message(json.dumps(message))
            while True:
                text = await self.socket.read_message()
                assert text is not None, "chromium closed the DevTools connection"
                answer = json.loads(text)
                if answer.get("id") != message_id:
                    self.events.append(answer)
                elif "error" in answer:
                    raise AssertionError(f"{method}: {answer['error']}")
                else:
                    return answer["result"]

        return self.loop.run_until_complete(asyncio.wait_for(exchange(), timeout))

    def evaluate(self, expression, timeout=60):
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.call(
            "Runtime.evaluate",
            timeout,
            expression=expression,
            awaitPromise=True,
            returnByValue=True,
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details["text"]
            raise AssertionError(f"JavaScript failed: {text}")
        return result["result"].get("value")

    def wait_for(self, expression, timeout=60, message=None):
        """Poll a JavaScript expression until it is truthy; return its value."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.25)
        raise AssertionError(message or f"still false after {timeout} s: {expression}")

    def open(self, url, timeout=60):
        """Load `url` and wait until the page and what it loads are in."""
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", timeout)

    def centre_of(self, element):
        """Scroll the element that the JavaScript expression `element` names into the
        middle of the view; return its centre (x, y) there."""
        return self.evaluate(
            f"(() => {{ const element = {element};"
            " element.scrollIntoView({block: 'center'});"
            " const box = element.getBoundingClientRect();"
            " return [box.x + box.width / 2, box.y + box.height / 2]; })()"
        )

    def click_on(self, element):
        """Click the middle of the element that `element` names, scrolled into view."""
        self.click(*self.centre_of(element))

    def move_pointer(self, x, y):
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    def click(self, x, y):
        """Press and release the left button at (x, y), as a reader's click."""
        self._down_and_up(
            "Input.dispatchMouseEvent",
            ("mousePressed", "mouseReleased"),
            x=x,
            y=y,
            button="left",
            clickCount=1,
        )

    def press(self, key, code, key_code, modifiers=0):
        """Press and release one key; modifiers: 8 is Shift (DevTools' bit mask)."""
        self._down_and_up(
            "Input.dispatchKeyEvent",
            ("rawKeyDown", "keyUp"),
            key=key,
            code=code,
            windowsVirtualKeyCode=key_code,
            modifiers=modifiers,
        )

    def _down_and_up(self, method, kinds, **params):
        """One input event of each kind, in order (a press, then its release)."""
        for kind in kinds:
            self.call(method, type=kind, **params)

    def requested_urls(self):
        """Every URL the page asked for so far (data: URLs included)."""
        self.evaluate("0")  # collect the events that wait in the connection
        return [
            event["params"]["request"]["url"]
            for event in self.events
            if event.get("method") == "Network.requestWillBeSent"
        ]

    def drawn_outside(self, fonts, script="Han"):
        """The visible elements of the page whose characters of `script` (a Unicode
        script: Han for Chinese) are not all drawn by one of `fonts` (family names),
        as Chromium reports the platform fonts it used (CSS.getPlatformFontsForNode,
        which counts the glyphs of an element's descendants too). A character that
        no installed font has is drawn as a missing-glyph box by the first font of
        the element's stack, which is then named. Returns (how many elements have
        such characters of their own, [(the element's text, {font: glyphs})] of
        those drawn otherwise)."""
        counts = self.evaluate(MARK_SCRIPT.replace("SCRIPT", script))
        self.call("DOM.enable")
        self.call("CSS.enable")
        root = self.call("DOM.getDocument", depth=0)["root"]["nodeId"]
        found = self.call("DOM.querySelectorAll", nodeId=root, selector="[data-script]")
        outside = []
        for index, node in enumerate(found["nodeIds"]):
            used = self.call("CSS.getPlatformFontsForNode", nodeId=node)["fonts"]
            drawn = sum(f["glyphCount"] for f in used if f["familyName"] in fonts)
            if drawn < counts[index]:
                text = self.evaluate(
                    f"document.querySelector('[data-script=\"{index}\"]').innerText"
                )
                outside.append(
                    (text[:60], {f["familyName"]: f["glyphCount"] for f in used})
                )
        return len(counts), outside


# Marks each visible element with characters of SCRIPT in a text node of its own
# (data-script="0", "1", ... in document order, as DOM.querySelectorAll finds them)
# and returns how many such characters each shows, its descendants' included.
MARK_SCRIPT = """(() => {
  const own = /\\p{Script=SCRIPT}/u;
  const all = /\\p{Script=SCRIPT}/gu;
  const counts = [];
  for (const element of document.body.querySelectorAll('*')) {
    const mine = [...element.childNodes].some(
      node => node.nodeType === Node.TEXT_NODE && own.test(node.data));
    if (!mine || !element.checkVisibility()) continue;
    element.setAttribute('data-script', counts.length);
    counts.push((element.innerText.match(all) || []).length);
  }
  return counts;
})()"""
