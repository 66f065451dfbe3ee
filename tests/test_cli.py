"""`kvrestore demo` end to end on the real model, small enough for the suite."""

from __future__ import annotations

import io

import anyio
import pytest

from kvrestore.cli import main
from kvrestore.demo import run_demo


@pytest.mark.model
@pytest.mark.slow
def test_demo_answers_with_every_policy(smollm2, tmp_path):
    out = io.StringIO()
    runs = anyio.run(lambda: run_demo(n_tokens=600, store_url=f"file://{tmp_path}", max_new_tokens=8, out=out))
    text = out.getvalue()
    assert {r.name for r in runs} == {"compute-only", "load-only"}
    assert "identical for every policy" in text
    by_name = {r.name: r for r in runs}
    assert by_name["load-only"].loaded == 3 and by_name["load-only"].computed == 0
    assert by_name["compute-only"].computed == 3
    assert all(r.answer for r in runs)


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--tokens", "0"])
    assert "--tokens must be positive" in capsys.readouterr().err
