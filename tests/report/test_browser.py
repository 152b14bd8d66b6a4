"""Open the HTML report in headless Chromium: its plots must decode and render."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)"
)
# Flags for a sandbox-less, network-less, first-run-free headless browser.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
# Counts the images that loaded and decoded (naturalWidth > 0) once the page has loaded.
PROBE = (
    "<script>window.addEventListener('load', () => { const ok = Array.from(document.images)"
    ".filter(i => i.complete && i.naturalWidth > 0).length; document.body.setAttribute('data-decoded', ok);"
    " document.body.setAttribute('data-images', document.images.length); });</script>"
)


def _chromium(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={tmp / 'profile'}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_html_renders_plots_in_chromium(report_result, tmp_path):
    html = report_result["paths"]["html"].read_text()
    probe = tmp_path / "probe.html"
    probe.write_text(html.replace("</body>", PROBE + "</body>"))
    proc = _chromium(["--virtual-time-budget=10000", "--dump-dom", probe.as_uri()], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    m = re.search(r'data-decoded="(\d+)" data-images="(\d+)"', dom)
    assert m, dom[:2000]
    decoded, total = int(m.group(1)), int(m.group(2))
    assert total >= 4 and decoded == total
    assert "Error jumps at LayerNormalization" in dom

    shot = tmp_path / "shot.png"
    proc = _chromium(
        [
            f"--screenshot={shot}",
            "--window-size=1100,1600",
            "--hide-scrollbars",
            report_result["paths"]["html"].as_uri(),
        ],
        tmp_path,
    )
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB"), dtype=np.int16)
    assert pixels.std() > 10  # not blank
    colored = (np.abs(pixels[..., 0] - pixels[..., 2]) > 60).mean()  # plot lines, bars, PASS/FAIL marks
    assert colored > 0.001
