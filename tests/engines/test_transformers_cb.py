"""transformers' continuous batching, attached to, on this host's real transformers (5.24 or 5.25, a CPU).

A CPU runs no CUDA graphs: transformers turns them off and every step runs eagerly, so what runs here
is the integration on the real engine's every step (the wrappers, transformers' own objects read,
each step's real tokens, the Recorder, the database) with tokens compared against the bare engine,
and the refusals. The graphs themselves (keys, late captures, pool) are the CUDA test's
(``test_transformers_cb_cuda.py``), on the H200 with transformers 5.17.
"""

from __future__ import annotations

import logging
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sqlalchemy import select

from tests.inspector.workers import fetch_rows

transformers = pytest.importorskip("transformers")

from bench.gpu_transformers_cb import (  # noqa: E402
    arrival_waves,
    build_model,
    expected_real_tokens,
    serve,
    trace_requests,
)
from inspector.engines.transformers_cb import attach, current, detach  # noqa: E402
from inspector.engines.transformers_cb.ledger import Ledger  # noqa: E402
from inspector.engines.transformers_cb.patches import PATCHED  # noqa: E402
from inspector.storage.models import BatchSizeCount, EagerTotal, Graph, Run  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA test covers a GPU host")
REPO = Path(__file__).resolve().parents[2]
LOG = "graph_inspector.transformers"


@pytest.fixture(scope="module")
def model() -> object:
    return build_model("tiny", torch.device("cpu"))


@pytest.fixture(scope="module")
def requests() -> list:
    return trace_requests(12, prompt_scale=32, output_scale=16, max_prompt=48, max_output=6, vocab=128)


@pytest.fixture
def detached() -> Iterator[None]:
    yield
    detach()


def runner_methods() -> dict[str, object]:
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    return {name: ModelRunner.__dict__[name] for name in PATCHED}


def test_every_step_is_recorded_with_its_real_tokens_and_the_tokens_are_the_bare_ones(
    model: object, requests: list, tmp_path: Path, detached: None
) -> None:
    waves = arrival_waves(requests, 10.0)
    bare = serve(model, waves, "tiny")
    url = f"sqlite:///{tmp_path / 'cb.db'}"
    attachment = attach(url, label="cpu cb")
    assert attachment is not None and current() is attachment
    attached = serve(model, waves, "tiny")
    run_id = attachment.run_id
    detach()

    assert [p.tokens for p in attached.passes] == [p.tokens for p in bare.passes]
    assert attachment.errors == 0 and not attachment.stopped
    ledger: Ledger = attachment.ledger
    steps, real = ledger.eager["mode_none"]  # a CPU: transformers runs every step eagerly
    assert real == expected_real_tokens(requests) * len(attached.passes)
    assert ledger.graphs == []

    ((label, config),) = fetch_rows(url, select(Run.label, Run.config).where(Run.id == run_id))
    assert label == "cpu cb"
    assert f'"transformers": "{transformers.__version__}"' in config
    assert '"use_cuda_graph": [false, false]' in config
    assert '"source": "transformers continuous batching"' in config
    eager = select(EagerTotal.reason, EagerTotal.mode, EagerTotal.batches, EagerTotal.num_real_tokens)
    assert fetch_rows(url, eager) == [("mode_none", "none", steps, real)]
    sizes = fetch_rows(url, select(BatchSizeCount.num_real_tokens, BatchSizeCount.batches))
    assert sum(b for _, b in sizes) == steps and sum(n * b for n, b in sizes) == real
    assert fetch_rows(url, select(Graph.id)) == []


def test_paused_waves_run_transformers_own_methods_and_are_not_recorded(
    model: object, requests: list, tmp_path: Path, detached: None
) -> None:
    waves = arrival_waves(requests, 3.0)
    bare = runner_methods()
    attachment = attach(f"sqlite:///{tmp_path / 'cb.db'}", label="cpu cb")
    assert attachment is not None
    paused_waves = {1}

    def before_wave(pass_index: int, wave_index: int) -> None:
        if wave_index in paused_waves:
            attachment.pause()
            assert runner_methods() == bare
        else:
            attachment.resume()
            assert all(method is not bare[name] for name, method in runner_methods().items())

    served = serve(model, waves, "tiny", passes=1, before_wave=before_wave)
    detach()
    attachment.resume()  # after detach: nothing put back
    assert runner_methods() == bare
    assert len(waves) > 1 and attachment.errors == 0
    _, real = attachment.ledger.eager["mode_none"]
    recorded = [w for i, w in enumerate(waves) if i not in paused_waves]
    assert real == expected_real_tokens([r for wave in recorded for r in wave])
    assert served.passes[0].generated == sum(generated for _, generated in served.passes[0].waves)


def test_the_readme_line_attaches_and_generate_batch_is_recorded_in_its_database(
    model: object, requests: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, detached: None
) -> None:
    from bench.gpu_transformers_cb import cb_config, generation_config
    from tests.support.readme import python_block

    monkeypatch.chdir(tmp_path)
    line = python_block("from inspector.engines.transformers_cb import attach")
    exec(compile(line, "README.md", "exec"), {})
    attachment = current()
    assert attachment is not None
    model.generate_batch([list(r.prompt) for r in requests[:3]], generation_config=generation_config(),
                         continuous_batching_config=cb_config("tiny"), max_new_tokens=2)
    run_id = attachment.run_id
    detach()
    assert (tmp_path / "cb.db").exists()
    assert fetch_rows(f"sqlite:///{tmp_path / 'cb.db'}", select(Run.label).where(Run.id == run_id)) == [
        ("transformers continuous batching",)
    ]


def test_generate_batch_is_recorded_as_users_call_it(model: object, requests: list, tmp_path: Path,
                                                     detached: None) -> None:
    from bench.gpu_transformers_cb import cb_config, generation_config

    prompts = [list(r.prompt) for r in requests]
    attachment = attach(f"sqlite:///{tmp_path / 'cb.db'}")
    assert attachment is not None
    out = model.generate_batch(prompts, generation_config=generation_config(),
                               continuous_batching_config=cb_config("tiny"), max_new_tokens=4)
    detach()
    assert len(out) == len(prompts) and all(len(o.generated_tokens) == 4 for o in out.values())
    # however generate_batch batched them: every prompt token and every fed-back answer token once
    assert attachment.ledger.eager["mode_none"][1] == sum(len(p) + 3 for p in prompts)


def test_detach_puts_transformers_methods_back(detached: None, tmp_path: Path) -> None:
    before = runner_methods()
    assert attach(f"sqlite:///{tmp_path / 'cb.db'}") is not None
    assert all(runner_methods()[name] is not before[name] for name in PATCHED)
    detach()
    assert runner_methods() == before and current() is None


def test_attaching_twice_is_refused_until_detached(detached: None, tmp_path: Path) -> None:
    assert attach(f"sqlite:///{tmp_path / 'cb.db'}") is not None
    with pytest.raises(RuntimeError, match="detach"):
        attach(f"sqlite:///{tmp_path / 'cb.db'}")


def test_a_release_it_does_not_read_is_refused_in_one_line_and_nothing_is_patched(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    before = runner_methods()
    import transformers as installed  # transformers puts a new module in sys.modules as it loads its parts

    monkeypatch.setattr(installed, "__version__", "5.99.0")
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert attach("sqlite:///unused.db") is None
    (record,) = caplog.records
    assert "transformers 5.99.0 is not a release" in record.getMessage()
    assert runner_methods() == before and current() is None


def test_without_transformers_it_says_so_and_the_program_runs_on() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from inspector.engines.transformers_cb import attach\n"
        "print('attached:', attach('sqlite:///unused.db'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "attached: None"
    assert "transformers is not installed here" in result.stderr


def test_a_failure_inside_the_integration_is_contained_and_the_tokens_are_the_bare_ones(
    model: object, requests: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, detached: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    waves = arrival_waves(requests[:4], 10.0)
    bare = serve(model, waves, "tiny", passes=1)

    def broken(self: Ledger, *args: object) -> None:
        raise RuntimeError("planted in the integration's ledger")

    monkeypatch.setattr(Ledger, "count_eager", broken)
    attachment = attach(f"sqlite:///{tmp_path / 'cb.db'}")
    assert attachment is not None
    with caplog.at_level(logging.WARNING, logger=LOG):
        attached = serve(model, waves, "tiny", passes=1)
    assert attached.passes[0].tokens == bare.passes[0].tokens
    assert attachment.errors > 0
    assert [r.getMessage() for r in caplog.records if r.name == LOG] == [
        "graph-inspector: an error in the transformers integration was contained; generation goes on"
    ]


def test_another_applications_database_stops_the_recording_not_generation(
    model: object, requests: list, tmp_path: Path, detached: None, caplog: pytest.LogCaptureFixture
) -> None:
    """The Recorder refuses a database that is not its own at start, which the integration meets at
    the first step: it says so once and stops recording; transformers serves on. (A corrupt or
    unavailable database is the Recorder's to handle: it never raises for those.)"""
    waves = arrival_waves(requests[:4], 10.0)
    bare = serve(model, waves, "tiny", passes=1)
    other = tmp_path / "notes.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE notes (text TEXT)")
    attachment = attach(f"sqlite:///{other}")
    assert attachment is not None
    with caplog.at_level(logging.ERROR, logger=LOG):
        attached = serve(model, waves, "tiny", passes=1)
    assert attached.passes[0].tokens == bare.passes[0].tokens
    assert "not a graph-inspector database" in attachment.stopped and attachment.errors == 0
    (record,) = [r for r in caplog.records if r.name == LOG]
    assert record.getMessage().startswith("graph-inspector: not recording transformers' continuous")
    with sqlite3.connect(other) as conn:
        assert [name for (name,) in conn.execute("SELECT name FROM sqlite_master")] == ["notes"]
