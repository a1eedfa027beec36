"""The recorder's pages in a real browser: Debian's chromium, headless, driven by selenium (chromium-driver).

Skipped where they are not installed: `apt-get install chromium chromium-driver` and `pip install selenium`.
The list links to the replay page; the page's player plays the cast, and the terminal shows its output.
"""
from __future__ import annotations

import asyncio
import shutil
import threading

import pytest

from recorder.server import Recorder
from recorder.store import FileStore

CAST = (b'{"version":2,"width":40,"height":6,"timestamp":1795823730,"command":"sh","srcNode":"laptop.t",'
        b'"srcNodeUser":"alice","kubernetes":{"PodName":"web","Namespace":"team-a","Container":"app",'
        b'"SessionType":"exec"}}\n[0.2,"o","$ echo replayed-42\\r\\n"]\n[0.4,"o","replayed-42\\r\\n$ "]\n')


def _driver():
    webdriver = pytest.importorskip("selenium.webdriver")
    chromium = shutil.which("chromium")
    driver_bin = shutil.which("chromedriver")
    if not chromium or not driver_bin:
        pytest.skip("chromium and chromedriver are not installed (apt-get install chromium chromium-driver)")
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(driver_bin), options=opts)


@pytest.fixture
def recorder_url(tmp_path):
    store = FileStore(str(tmp_path / "rec"))
    w = store.create()
    w.write(CAST)
    w.close()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        server = loop.run_until_complete(asyncio.start_server(Recorder(store, ui=True).handle, "127.0.0.1", 0))
        holder["port"] = server.sockets[0].getsockname()[1]
        started.set()
        loop.run_forever()
        server.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    started.wait(10)
    yield f"http://127.0.0.1:{holder['port']}", w.name
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)


def test_the_list_links_to_a_replay_page_whose_player_plays_the_cast(recorder_url):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait
    url, name = recorder_url
    d = _driver()
    try:
        d.get(url + "/")
        row = d.find_element(By.TAG_NAME, "tbody").text
        assert "alice" in row and "team-a/web" in row and "sh" in row
        d.find_element(By.LINK_TEXT, "play").click()
        WebDriverWait(d, 30).until(ec.presence_of_element_located((By.CSS_SELECTOR, ".ap-player")))
        assert d.current_url.endswith(f"/recordings/{name}/play")
        d.find_element(By.CSS_SELECTOR, ".ap-player").click()        # the player starts on a click
        WebDriverWait(d, 30).until(lambda drv: "replayed-42" in drv.find_element(
            By.CSS_SELECTOR, ".ap-term").text.replace("\u00a0", " ").split("echo")[-1])
        assert not [e for e in d.get_log("browser") if e.get("level") == "SEVERE"]
    finally:
        d.quit()
