"""The documentation site builds with no warning, its examples executed."""
import html
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dlgs_jax
from tests.helpers import child_env

ROOT = Path(__file__).resolve().parents[2]
# One worker builds the site for every test here: autosummary writes its pages
# into the source tree, which two builds at once would race on.
pytestmark = pytest.mark.xdist_group("docs")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
  out = tmp_path_factory.mktemp("site")
  done = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
       "-d", str(out / "doctrees"), str(ROOT / "docs"), str(out / "html")],
      env=child_env(), capture_output=True, text=True, timeout=900, cwd=ROOT)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return out / "html"


@pytest.mark.slow
def test_the_quickstart_page_shows_its_code_and_what_it_printed(site):
  # The text a reader sees: highlighting splits code into spans.
  page = html.unescape(re.sub(r"<[^>]+>", "", (site / "getting_started.html").read_text()))
  assert "dlgs_jax.data_parallel(loss_fn, tx, mesh)" in page
  # The outputs come from running the page: three loss lines and the comparison.
  losses = [float(x) for x in re.findall(r"step +\d+  loss (\d+\.\d+)", page)]
  assert len(losses) == 4 and losses[-1] < losses[0], losses
  ratio = re.search(r"DLGS (\d+) \((\d+)x less\)", page)
  assert ratio and int(ratio.group(2)) > 10


@pytest.mark.slow
def test_the_api_reference_has_a_page_for_every_public_name(site):
  api = (site / "api.html").read_text()
  for name in dlgs_jax.__all__:
    assert f"dlgs_jax.{name}" in api, name
    assert (site / "_autosummary" / f"dlgs_jax.{name}.html").exists(), name
  # The checkpointer the checkpoints page shows for your own loop.
  assert (site / "_autosummary" / "dlgs_jax.training.persistence.checkpoint.Checkpointer.html").exists()


def _browser() -> str:
  for name in ("chromium", "chromium-browser", "google-chrome"):
    found = shutil.which(name)
    if found:
      return found
  pytest.skip("no Chromium: scripts/setup_env.sh test installs it (as root, with apt-get)")


@pytest.mark.slow
def test_a_headless_browser_renders_the_quickstart_with_its_output(site, tmp_path):
  browser = _browser()
  page = (site / "getting_started.html").as_uri()
  flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           f"--user-data-dir={tmp_path / 'profile'}"]
  dom = subprocess.run([browser, *flags, "--dump-dom", page], capture_output=True, text=True,
                       timeout=120)
  assert dom.returncode == 0, dom.stderr[-2000:]
  text = html.unescape(re.sub(r"<[^>]+>", "", dom.stdout))
  assert "Getting started" in text and "data_parallel(loss_fn, tx, mesh)" in text
  assert re.search(r"step 299\s+loss \d\.\d+", text), text[-2000:]
  # Every page of the site renders its title and its text in the browser.
  toctree = (ROOT / "docs" / "index.md").read_text().split("```{toctree}", 1)[1].split("```")[0]
  pages = [line.strip() for line in toctree.splitlines()[1:] if line.strip()
           and not line.startswith(":")]
  assert len(pages) >= 10, pages
  for name in pages:
    heading = re.search(r"^# (.+)$", (ROOT / "docs" / f"{name}.md").read_text(), re.M).group(1)
    rendered = subprocess.run([browser, *flags, "--dump-dom", (site / f"{name}.html").as_uri()],
                              capture_output=True, text=True, timeout=120)
    text = html.unescape(re.sub(r"<[^>]+>", "", rendered.stdout))
    assert heading in text and len(text) > 3000, name
  # MathJax ships with the site: the equations render with no network.
  how = subprocess.run([browser, *flags, "--virtual-time-budget=10000", "--dump-dom",
                        (site / "how_dlgs_works.html").as_uri()], capture_output=True,
                       text=True, timeout=120)
  assert how.stdout.count("<mjx-container") > 20, how.stderr[-2000:]
  shot = tmp_path / "quickstart.png"
  done = subprocess.run([browser, *flags, "--window-size=1200,2000", f"--screenshot={shot}",
                         page], capture_output=True, text=True, timeout=120)
  assert done.returncode == 0 and shot.stat().st_size > 10_000, done.stderr[-2000:]


@pytest.mark.slow
def test_the_own_step_page_trains_with_shard_map_and_loses_nothing_under_vmap(site):
  page = html.unescape(re.sub(r"<[^>]+>", "", (site / "own_step.html").read_text()))
  before, after = map(float, re.search(r"loss (\d\.\d+) -> (\d\.\d+)", page).groups())
  assert after < 0.7 * before
  assert re.findall(r"(w[12]) nothing lost: (\w+)", page) == [("w1", "True"), ("w2", "True")]
  assert "'w1': (4, 16, 32)" in page  # pmap: one update per device
  linen = [float(x) for x in re.findall(r"step +(?:0|199)  loss (\d\.\d+)", page)]
  assert len(linen) == 2 and linen[1] < 0.8 * linen[0]  # Linen with BatchNorm trains


@pytest.mark.slow
def test_the_porting_page_trains_evaluates_and_restores_an_nnx_script(site):
  page = text_of(site, "porting_nnx")
  losses = [float(x) for x in re.findall(r"step +\d+  loss (\d\.\d+)  accuracy", page)]
  assert len(losses) == 5 and losses[-1] < 0.85 * losses[0], losses
  sent, dense = map(int, re.search(r"DLGS (\d+), a dense float32 all-reduce (\d+)", page).groups())
  assert dense > 10 * sent
  accuracy = float(re.search(r"'accuracy': (\d\.\d+)", page).group(1))
  assert accuracy > 0.25  # ten classes: chance is 0.1
  assert "restored module gives the same logits: True" in page
  assert "NNX loss" in text_of(site, "own_step")


def test_the_api_page_lists_every_public_name_in_a_readable_table():
  """docs/api.md reads in the repository too, not only as the built site."""
  table = (ROOT / "docs" / "api.md").read_text().split("## At a glance", 1)[1].split("\n## ")[0]
  listed = re.findall(r"^\| `(\w+)` \| `(\w+)\(", table, re.M)
  assert [name for name, _ in listed] == [call for _, call in listed]
  assert sorted(name for name, _ in listed) == sorted(dlgs_jax.__all__)


def text_of(site, page):
  return html.unescape(re.sub(r"<[^>]+>", "", (site / f"{page}.html").read_text()))


@pytest.mark.slow
def test_the_how_page_runs_dlgs_and_draws_its_thresholds_and_the_planners_timelines(site):
  page = text_of(site, "how_dlgs_works")
  k = int(re.search(r"k = (\d+) values of 8192", page).group(1))
  assert k == 410  # ceil(0.05 * 8192)
  # Step 0 starts from thresholds of 0 and fills the buffer; the step after an exact
  # one sends about k (the threshold is exact for the step before), never more.
  after = re.search(rf"values sent on step 0: {k}; on the steps after exact ones: "
                    r"\[([\d, ]+)\]", page).group(1)
  assert all(0.9 * k <= int(n) <= k for n in after.split(",")), after
  times = dict(re.findall(r"(wfbp|single|optimal)\s+\d+ messages, one iteration ([\d.]+) ms", page))
  assert float(times["optimal"]) <= float(times["single"]) < float(times["wfbp"])
  images = re.findall(r'<img [^>]*src="(_images/[^"]+\.png)"',
                      (site / "how_dlgs_works.html").read_text())
  assert len(images) == 2  # the thresholds and the Gantt chart
  for image in images:
    assert (site / image).read_bytes()[:4] == b"\x89PNG" and (site / image).stat().st_size > 20_000


@pytest.mark.slow
def test_the_checkpoints_page_restores_a_data_parallel_state_bit_for_bit(site):
  page = text_of(site, "checkpoints")
  assert "restored step 30" in page
  assert "identical to the run that never stopped: True" in page


@pytest.mark.slow
def test_the_choosing_page_prints_the_bytes_its_formulas_give(site):
  page = html.unescape(re.sub(r"<[^>]+>", "", (site / "choosing.html").read_text()))
  rows = re.findall(r"^\s*(\d+)" + r"\s+([\d.]+)" * 6 + r"\s*$", page, re.MULTILINE)
  assert [int(r[0]) for r in rows] == [4, 16, 64, 256]
  for p, dense, dense_bf16, gather, _, gtopk, owners in ((int(r[0]), *map(float, r[1:]))
                                                          for r in rows):
    assert gather / dense == pytest.approx(0.01 * p, rel=0.01)  # all-gather over dense: d P
    assert dense_bf16 == pytest.approx(dense / 2, abs=0.1)
  assert float(rows[-1][5]) < float(rows[-1][3]) / 20  # gTop-k's log P at 256 workers
  owners = [float(r[6]) for r in rows[1:]]
  assert max(owners) / min(owners) < 1.1  # the owners' bytes: flat in P


def test_the_docs_tests_share_one_worker(request):
  """Under `--dist loadgroup` this module's tests run on one worker (its pytestmark):
  pytest-xdist names the group in each test's node id, which a pytest that ignores
  the name it is given (9.2) leaves out, sending the tests to any worker."""
  if not getattr(request.config.option, "loadgroup", False):
    pytest.skip("not run by pytest-xdist with --dist loadgroup")
  assert request.node.nodeid.endswith("@docs"), request.node.nodeid
