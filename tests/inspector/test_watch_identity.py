"""Which frame names a watched graph: the user's code, never torch's or Inductor's generated code."""

from __future__ import annotations

import types

import pytest

from inspector.watch.frames import find_call_site


def _frame_in(filename: str, name: str) -> types.FrameType:
    namespace: dict = {}
    exec(compile(f"import sys\ndef {name}():\n    return sys._getframe()\n", filename, "exec"), namespace)
    return namespace[name]()


@pytest.mark.parametrize(
    "generated",
    ["/tmp/torchinductor_root/ab/cabcdef.py", "<eval_with_key>.12"],
)
def test_generated_torch_code_is_skipped_for_the_user_frame(generated: str) -> None:
    user = _frame_in("/srv/engine/step.py", "decode_step")
    compiled = _frame_in(generated, "call")
    site = find_call_site([compiled, user])
    assert site.filename == "/srv/engine/step.py" and site.function == "decode_step"


def test_a_custom_inductor_cache_dir_is_recognised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/scratch/inductor")
    user = _frame_in("/srv/engine/step.py", "decode_step")
    compiled = _frame_in("/scratch/inductor/xy/cxy.py", "call")
    assert find_call_site([compiled, user]).function == "decode_step"
