"""scripts/setup --dev waits for another apt or dpkg instead of failing at once.

apt itself cannot run in a test, so a stand-in `apt-get` first in PATH answers as apt does while
another apt holds its lock (apt's own message, exit 100) for as long as a file says the lock is
held. The rest of what setup runs is stood in for too (pip through $PYTHON, npm), and `promtool`
is left off PATH so that setup has a package to install. And the editable install setup makes
loads the pytest plugin with no warning.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.support.readme import python_block

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("bash", "dirname", "ls", "grep", "mktemp", "cat", "rm", "sleep", "sed", "env")
"""What setup runs besides apt-get, python and npm, linked into the test's PATH."""
APT_GET = """#!/bin/bash
if [ -e "$LOCK_HELD" ]; then
  echo "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 4242 (apt-get)" >&2
  echo "E: Unable to acquire the dpkg frontend lock (/var/lib/dpkg/lock-frontend)," \
       "is another process using it?" >&2
  exit 100
fi
echo "$*" >> "$CALLS"
"""
STAND_IN = "#!/bin/bash\nexit 0\n"


def _setup(tmp_path: Path, lock_wait: int) -> tuple[subprocess.Popen, Path, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        if found is None:
            pytest.skip(f"{tool} is not installed")
        (bin_dir / tool).symlink_to(found)
    for name, text in (("apt-get", APT_GET), ("npm", STAND_IN), ("python", STAND_IN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    if not Path("/usr/bin/chromium").exists() or not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        pytest.skip("setup would install Chromium and PostgreSQL too; this host has them (CI's does)")
    held, calls = tmp_path / "lock-held", tmp_path / "apt-calls"
    held.touch()
    env = {"PATH": str(bin_dir), "PYTHON": str(bin_dir / "python"), "LOCK_HELD": str(held),
           "CALLS": str(calls), "APT_LOCK_WAIT": str(lock_wait), "HOME": str(tmp_path)}
    child = subprocess.Popen([str(bin_dir / "bash"), "scripts/setup", "--dev"], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return child, held, calls


@pytest.mark.skipif(os.name != "posix", reason="a bash script")
def test_setup_waits_for_another_apt_to_let_go_of_its_lock(tmp_path: Path) -> None:
    child, held, calls = _setup(tmp_path, lock_wait=120)
    # The other apt finishes a few seconds later; however late, setup must still be waiting.
    threading.Timer(3.0, held.unlink).start()
    out, err = child.communicate(timeout=150)
    assert child.returncode == 0, err
    assert "waiting for another apt-get or dpkg to finish (held by process 4242 (apt-get))" in err
    assert err.count("waiting for another") == 1, "said once, not at every try"
    lines = calls.read_text().splitlines()
    assert lines[0].endswith("update -qq") and "install" in lines[1] and lines[1].endswith("prometheus")
    assert "setup done" in out


@pytest.mark.skipif(os.name != "posix", reason="a bash script")
def test_setup_gives_up_on_a_lock_held_past_apt_lock_wait_with_apts_own_error(tmp_path: Path) -> None:
    child, _, calls = _setup(tmp_path, lock_wait=2)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 100
    assert "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 4242" in err
    assert not calls.exists() and "setup done" not in out


@pytest.mark.slow
def test_the_editable_install_loads_the_pytest_plugin_without_a_warning(tmp_path: Path) -> None:
    # What scripts/setup makes (pip install -e): the entry point's module imports only the plugin's
    # package, so that pytest imports the plugin itself; imported early, pytest warned in every run
    # that it could not rewrite the plugin's asserts. A copy of the checkout's tracked files installed
    # editable into a venv over this interpreter's packages (its pip and setuptools; its own entry
    # point first on the path).
    copy = tmp_path / "checkout"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    for name in filter(None, tracked.stdout.split("\0")):
        if (REPO / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True)
    python = str(venv / "bin" / "python")
    installed = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                                "-e", str(copy)], capture_output=True, text=True, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_graphs.py").write_text(python_block("def test_decode_replays_its_graphs"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    ran = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--graph-debug", "tests"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "1 passed in" in ran.stdout and "warning" not in ran.stdout, ran.stdout
    assert "address checks in DEBUG mode" in ran.stdout, "the plugin ran"
