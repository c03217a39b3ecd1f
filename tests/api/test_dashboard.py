"""The dashboard in headless Chromium: it loads with no network but loopback, polls the live
API, and draws non-empty charts (read back from the DOM and from a screenshot's pixels)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from broker.client import RolloutClient
from tests.api.helpers import session_json
from tests.broker.helpers import wait_until

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed "
                       "(apt-get install -y chromium)"),
    pytest.mark.timeout(120),
]
CHARTS = ("chart-queue", "chart-kv", "chart-drift")
LINE_COLOURS = [(0x58, 0xA6, 0xFF), (0x3F, 0xB9, 0x50)]  # the first two series colours in app.js


def chromium(profile: Path, url: str, *extra: str) -> subprocess.CompletedProcess:
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--no-first-run", "--no-default-browser-check", f"--user-data-dir={profile}",
            # nothing resolves but loopback: a CDN reference would fail to load
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            "--virtual-time-budget=6000", "--window-size=1280,1100", *extra, url]
    return subprocess.run(args, capture_output=True, text=True, timeout=90)


@pytest.fixture
def busy_namespace(fleet, api, redis_url, namespace):
    """Results consumed off target (drift), backends with heartbeats, sessions left pending."""
    fleet.backend("b0")
    fleet.backend("b1")
    broker = fleet.start_broker("least_loaded")
    api.put("/v1/mixture", json={"shares": {"rlvr": 0.5, "rlhf": 0.3, "agentic": 0.2}})
    api.post("/v1/sessions", json={"sessions": [session_json(i, workload=("rlvr", "rlhf")[i % 3 == 0])
                                                for i in range(30)]})
    with RolloutClient(redis_url, namespace) as trainer:
        got: list = []
        assert wait_until(lambda: got.extend(trainer.results(30 - len(got), timeout=0.2))
                          or len(got) >= 30, timeout=20, every=0)
    broker.stop()
    fleet.broker = None
    api.post("/v1/sessions", json={"sessions": [
        session_json(i, workload=("rlvr", "agentic")[i % 2], prefix="p") for i in range(25)]})


def test_dashboard_draws_live_charts(busy_namespace, live_server, tmp_path):
    url = live_server() + "/"
    dom = chromium(tmp_path / "profile-dom", url, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    for chart in CHARTS:
        m = re.search(rf'<svg id="{chart}"[^>]*>', dom.stdout)
        assert m, f"{chart} missing from the page"
        points = int(re.search(r'data-points="(\d+)"', m.group(0)).group(1))
        series = int(re.search(r'data-series="(\d+)"', m.group(0)).group(1))
        assert series >= 1 and points >= 2 * series, (chart, m.group(0))
    assert "<polyline" in dom.stdout
    assert "broker" in dom.stdout and "b0" in dom.stdout and "agentic" in dom.stdout
    # the header answers "busy? failing?": sessions/s and tok/s, failures and dead letters
    assert re.search(r"1 min: [0-9.]+ sessions/s, [0-9.k]+ tok/s", dom.stdout), dom.stdout[:3000]
    assert re.search(r'id="failures" class="tag (ok|bad)">failed \d+ · dead letters \d+', dom.stdout)
    assert "<th>tokens/s (1 min)</th>" in dom.stdout and "<th>failed</th>" in dom.stdout
    assert ">latency p50 / p95 / p99</th>" in dom.stdout

    shot = tmp_path / "dashboard.png"
    r = chromium(tmp_path / "profile-shot", url, f"--screenshot={shot}", "--hide-scrollbars")
    assert r.returncode == 0 and shot.exists(), r.stderr[-2000:]
    if os.environ.get("RB_ARTIFACTS_DIR"):
        shutil.copy(shot, Path(os.environ["RB_ARTIFACTS_DIR"]) / "dashboard.png")
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    colours = img.getcolors(maxcolors=1 << 20) or []
    assert len(colours) > 50, "the screenshot is nearly uniform"
    drawn = {c: 0 for c in LINE_COLOURS}
    for count, rgb in colours:
        for c in LINE_COLOURS:
            if all(abs(a - b) <= 12 for a, b in zip(rgb, c)):
                drawn[c] += count
    # Legend swatches and the "healthy" text use these colours too, but add up to ~300 pixels;
    # lines across the plots add ~500 per chart.
    assert all(n > 800 for n in drawn.values()), f"chart lines barely drawn: {drawn}"


def test_dashboard_shows_who_is_active_and_why_the_status_is_down(fleet, settings, tmp_path):
    """With a broker: who holds the lease and its policy. With Redis gone: the API's reason,
    not a bare HTTP status."""
    from api.app import create_app
    from broker.redis_server import free_port

    fleet.backend("b0")
    fleet.start_broker("least_loaded")
    import threading
    import time

    import uvicorn

    def serve(app) -> str:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                               log_level="warning", lifespan="on"))
        threading.Thread(target=server.run, daemon=True).start()
        deadline = time.monotonic() + 15
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        servers.append(server)
        return f"http://127.0.0.1:{port}/"

    servers: list = []
    try:
        up = chromium(tmp_path / "p1", serve(create_app(settings)), "--dump-dom")
        assert re.search(r"broker broker-[0-9a-f]+ active, policy least_loaded", up.stdout), \
            up.stdout[:3000]
        down_settings = settings.model_copy(update={"redis_url":
                                                    f"redis://127.0.0.1:{free_port()}/0"})
        down = chromium(tmp_path / "p2", serve(create_app(down_settings)), "--dump-dom")
        assert re.search(r'id="updated" class="bad">status unavailable: redis: ', down.stdout), \
            down.stdout[:3000]
    finally:
        for server in servers:
            server.should_exit = True


def test_a_dashboard_opened_now_starts_with_the_apis_history(settings, redis_client, tmp_path):
    """The API keeps the charts' last minutes; the page plots them at once, by their age."""
    import threading
    import time

    import uvicorn

    from api.app import create_app
    from api.history import ChartSample
    from broker.redis_server import free_port

    app = create_app(settings)
    now = time.time()
    for age in range(120, 0, -4):  # two minutes of a queue draining, every 4 s
        app.state.chart_trail.add(ChartSample(at=now - age, queue={"rlvr": age}, kv={"b0": 0.5},
                                              drift={"total": 0.1}))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    threading.Thread(target=server.run, daemon=True).start()
    try:
        deadline = time.monotonic() + 15
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        dom = chromium(tmp_path / "p", f"http://127.0.0.1:{port}/", "--dump-dom")
    finally:
        server.should_exit = True
    m = re.search(r'<svg id="chart-queue"[^>]*data-points="(\d+)"', dom.stdout)
    assert m and int(m.group(1)) >= 30, dom.stdout[:2000]
    chart = dom.stdout[m.start():dom.stdout.index("</svg>", m.start())]
    assert re.search(r">-1[12]\d+s<", chart), chart[:2000]  # the axis spans the two minutes
