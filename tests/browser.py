"""Debian's headless Chromium, driven by Selenium through Debian's chromedriver, for
the tests of the rendered book (test_site.py) and of JupyterLab (test_lab.py).

`start_chromium()` starts one. Selenium Manager never runs: the chromedriver on
the PATH is named, so nothing is downloaded. Chromium's performance log records
every request a page makes (`requested_urls`), and its DevTools protocol reports
which fonts drew the text (`drawn_outside`).
"""

import json
import os
import shutil

from conftest import skip_or_fail_in_ci
from selenium import webdriver
from selenium.webdriver.support.wait import WebDriverWait

# Headless, no profile state, none of Chromium's own background traffic, /tmp for
# shared memory (containers get a 64 MB /dev/shm); the host resolver rule makes any
# request for a remote page, script or font fail at once, except for 127.0.0.1,
# where the JupyterLab test's server listens.
CHROMIUM_FLAGS = """--headless --no-sandbox --disable-gpu --disable-dev-shm-usage
--no-first-run --disable-sync --disable-background-networking
--disable-component-update --disable-quic""".split()
CHROMIUM_FLAGS += ["--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]


def start_chromium(size=(1280, 1000)):
    """A headless Chromium with a window of `size`, as a Selenium driver: use it in
    a `with` block, which quits it. Without Chromium or chromedriver the test
    skips, and fails under CI=true."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        skip_or_fail_in_ci(
            os.environ,
            "Chromium or its chromedriver is not installed, so the book cannot be "
            "opened in a browser: `apt-get install --no-install-recommends chromium "
            "chromium-driver` (.ci/run does).",
        )
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in [*CHROMIUM_FLAGS, "--window-size={},{}".format(*size)]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    service = webdriver.ChromeService(executable_path=driver)
    browser = webdriver.Chrome(options=options, service=service)
    browser.set_script_timeout(120)  # an asynchronous script's (MathJax's) wait
    return browser


def wait_for(browser, expression, timeout=60, message=None):
    """Poll a JavaScript expression until it is truthy; return its value."""
    message = message or f"still false after {timeout} s: {expression}"
    return WebDriverWait(browser, timeout, 0.25).until(
        lambda _: browser.execute_script(f"return {expression}"), message
    )


def requested_urls(browser):
    """Every URL the browser's pages asked for (data: URLs included), once: this
    empties Chromium's log."""
    events = [
        json.loads(e["message"])["message"] for e in browser.get_log("performance")
    ]
    asked = [e["params"] for e in events if e["method"] == "Network.requestWillBeSent"]
    return [params["request"]["url"] for params in asked]


def drawn_outside(browser, fonts):
    """The visible elements of the page whose Chinese (Han) characters are not all
    drawn by one of `fonts` (family names), as Chromium reports the platform fonts
    it used (CSS.getPlatformFontsForNode counts an element's descendants' glyphs
    too). A character no installed font has is drawn as a missing-glyph box by the
    first font of the element's stack, which is then named. Returns (how many
    elements have Han characters of their own, [(text, {font: glyphs})] of those
    drawn otherwise)."""
    counts = browser.execute_script(MARK_HAN)
    cdp = browser.execute_cdp_cmd
    cdp("DOM.enable", {}), cdp("CSS.enable", {})
    root = cdp("DOM.getDocument", {"depth": 0})["root"]["nodeId"]
    nodes = cdp("DOM.querySelectorAll", {"nodeId": root, "selector": "[data-han]"})
    outside = []
    for node, (count, text) in zip(nodes["nodeIds"], counts, strict=True):
        used = cdp("CSS.getPlatformFontsForNode", {"nodeId": node})["fonts"]
        glyphs = {f["familyName"]: f["glyphCount"] for f in used}
        if sum(n for name, n in glyphs.items() if name in fonts) < count:
            outside.append((text[:60], glyphs))
    return len(counts), outside


# Marks each visible element with Han characters in a text node of its own
# (data-han, in document order, as DOM.querySelectorAll finds them) and returns
# [how many Han characters it shows, its descendants' included; its text].
MARK_HAN = """const counts = [], han = /\\p{Script=Han}/gu;
for (const element of document.body.querySelectorAll('*')) {
  const own = [...element.childNodes].filter(node => node.nodeType === Node.TEXT_NODE);
  if (!own.some(node => node.data.match(han)) || !element.checkVisibility()) continue;
  element.setAttribute('data-han', '');
  counts.push([(element.innerText.match(han) || []).length, element.innerText]);
}
return counts;"""
